"""Errors that cross Ray intact, bounded failures, checkpoints interrupted mid-save, one run per log dir."""

from __future__ import annotations

import importlib
import json
import logging
import os
import pickle
import pkgutil
import subprocess
import sys
import time

import pytest

import slimecore
from slimecore.config import Config, ConfigError
from slimecore.errors import RewardFailureError, check_reward_failures, describe
from slimecore.plugins import HookCallError
from slimecore.agents.protocol import APIError
from slimecore.answers import HookAnswerError
from slimecore.testing import timeout
from slimecore.types import Sample, Status


class _NeedsTwoArguments(Exception):
    """A plugin's own exception that does not pickle (its __init__ wants more than the message)."""

    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")


def _project_exceptions() -> list[type]:
    found = set()
    for module in pkgutil.walk_packages(slimecore.__path__, "slimecore."):
        if module.name.startswith("slimecore.compat."):  # the `import slime` shim: importable as `slime` only
            continue
        mod = importlib.import_module(module.name)
        for value in vars(mod).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__.startswith("slimecore"):
                found.add(value)
    return sorted(found, key=lambda cls: cls.__qualname__)


def _instance(cls):
    if cls is HookCallError:
        return HookCallError("my_plugin", "slime_reward", _NeedsTwoArguments(7, "the judge is down"))
    if cls is APIError:
        return APIError("invalid_request", "what happened; what to do", param="messages")
    if cls is HookAnswerError:
        return HookAnswerError("my_plugin", "slime_reward", "'good' (a str); a reward is a float")
    return cls("what happened; what to do")


@pytest.mark.parametrize("cls", _project_exceptions(), ids=lambda cls: cls.__qualname__)
def test_every_project_exception_pickles(cls):
    error = _instance(cls)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls and str(copy) == str(error)


def test_a_hook_error_crosses_ray_with_plugin_hook_and_process(ray_session):
    ray = ray_session

    @ray.remote
    class Worker:  # defined here, so Ray ships it by value (the tests directory is not importable in workers)
        def score(self):
            class JudgeDown(Exception):  # does not pickle: its __init__ wants two arguments
                def __init__(self, code, detail):
                    super().__init__(f"{code}: {detail}")

            try:
                raise JudgeDown(7, "the judge is down")
            except JudgeDown as exc:  # as Hooks wraps what a plugin's hook raises
                raise HookCallError("my_plugin", "slime_reward", exc) from exc

    with pytest.raises(Exception) as err:
        ray.get(Worker.remote().score.remote(), timeout=120)
    failure = describe(err.value)
    assert (failure.plugin, failure.hook, failure.kind) == ("my_plugin", "slime_reward", "JudgeDown")
    assert failure.message == "7: the judge is down" and failure.process.startswith("Worker.score (pid ")
    assert 'raise JudgeDown(7, "the judge is down")' in failure.remote_traceback
    assert failure.text().endswith(f"(from plugin 'my_plugin', hook slime_reward, process {failure.process})")


def test_a_killed_train_rank_is_named_with_its_stage(ray_session):
    import os
    import signal
    import types

    from slimecore.config import Config
    from slimecore.trainers.ray_actors import RankDiedError, TrainGroup

    ray = ray_session

    @ray.remote(num_cpus=0)
    class Rank:
        def train(self, killed: bool):
            if killed:
                os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or kill -9 would
            return {"train/loss": 1.0}

    ranks = [Rank.remote(), Rank.remote()]
    group = types.SimpleNamespace(role="actor", config=Config.make(train_timeout=120))
    with pytest.raises(RankDiedError) as err:
        TrainGroup._wait(group, [rank.train.remote(i == 1) for i, rank in enumerate(ranks)], "training on rollout 3")
    text = describe(err.value).text()
    assert text.startswith("RankDiedError: actor rank 1 of 2 died in training on rollout 3: its process (pid "), text
    assert "ended without a Python error" in text and "(from" not in text


def _samples(failed: int, total: int) -> list[Sample]:
    samples = [Sample(index=i, reward=1.0) for i in range(total)]
    for sample in samples[:failed]:
        sample.status, sample.metadata["reward_error"] = Status.FAILED, f"boom {sample.index}"
    return samples


def test_a_step_with_too_many_failed_samples_stops_the_run():
    config = Config.make(max_reward_failure_fraction=0.5)
    check_reward_failures(config, _samples(2, 4), rollout_id=0)  # exactly the fraction: allowed
    with pytest.raises(RewardFailureError, match=r"(?s)rollout 3: 3 of 4 samples failed to be scored.*sample 0: boom 0"):
        check_reward_failures(config, _samples(3, 4), rollout_id=3)


def test_a_prompt_longer_than_the_models_context_is_dropped_and_counted(tiny_checkpoint, tmp_path, caplog):
    from slimecore.data.source import PromptDataSource
    from slimecore.hf_checkpoint import load_tokenizer

    context = json.loads((tiny_checkpoint / "config.json").read_text())["max_position_embeddings"]
    rows = [{"input": "What is 1 + 2?"}, {"input": "apple " * (2 * context)}, {"input": "What is 3 + 4?"}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = Config.make(prompt_data=str(data), hf_checkpoint=str(tiny_checkpoint), rollout_batch_size=1)
    with caplog.at_level(logging.WARNING, "slimecore.data"):
        source = PromptDataSource.from_config(config, load_tokenizer(tiny_checkpoint))
    assert len(source) == 2 and source.num_filtered == 1
    assert f"dropped 1 of 3 prompts longer than the model's context ({context}) - 1 = {context - 1}" in caplog.text


def test_load_skips_a_checkpoint_interrupted_mid_save(tmp_path):
    from slimecore.checkpoint import COMPLETE, iteration_dir, latest_complete, resume_point

    for rollout_id in (1, 3):
        iteration_dir(tmp_path, rollout_id).mkdir(parents=True)
        (iteration_dir(tmp_path, rollout_id) / COMPLETE).write_bytes(b"state")
    (iteration_dir(tmp_path, 5) / "actor").mkdir(parents=True)  # killed while the trainer was writing
    assert latest_complete(tmp_path) == 3
    text = resume_point(tmp_path).describe(num_rollout=8)
    assert f"resuming from {iteration_dir(tmp_path, 3)}: 4 steps done, running steps 5-8 of --num-rollout 8" in text
    assert "skipped iter_0000005: incomplete (a save was interrupted), kept as they are" in text
    empty = tmp_path / "empty"
    (empty / "iter_0000000").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint there .*1 incomplete iteration"):
        latest_complete(empty)


def test_two_runs_cannot_share_a_log_dir(tmp_path):
    from slimecore.preflight import LOCK_FILE, claim_log_dir, release_log_dir

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_FILE).write_text(str(other.pid))
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {other.pid}\\); give this run its own"):
            claim_log_dir(str(tmp_path))
    finally:
        other.kill()
        other.wait()
    claim_log_dir(str(tmp_path))  # the other run is gone: its lock is stale
    assert (tmp_path / LOCK_FILE).read_text() == str(os.getpid())
    release_log_dir(str(tmp_path))
    assert not (tmp_path / LOCK_FILE).exists()


def test_runs_claiming_one_log_dir_at_the_same_instant_get_it_once(tmp_path):
    """The lock is made atomically: of 6 runs that claim one --log-dir at the same moment, exactly one gets it."""
    go = time.time() + 3
    code = ("import sys, time\nfrom slimecore.config import ConfigError\n"
            "from slimecore.preflight import claim_log_dir\n"
            f"time.sleep(max(0, {go} - time.time()))\n"
            "try:\n    claim_log_dir(sys.argv[1]); print('claimed', flush=True)\n"
            "except ConfigError as exc:\n    print('refused', exc, flush=True)\n"
            "time.sleep(3)\n")
    runs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
            for _ in range(6)]
    answers = [run.communicate(timeout=timeout(60))[0] for run in runs]
    assert sum(a.startswith("claimed") for a in answers) == 1, answers
    assert all("is in use by another run" in a for a in answers if not a.startswith("claimed")), answers


def test_test_timeouts_scale_from_one_place(monkeypatch):
    from slimecore.testing import timeout

    monkeypatch.delenv("SLIMECORE_TEST_TIMEOUT_SCALE", raising=False)
    assert timeout(10) == 10
    monkeypatch.setenv("SLIMECORE_TEST_TIMEOUT_SCALE", "2.5")
    assert timeout(10) == 25
