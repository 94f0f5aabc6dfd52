"""End to end through the CLI: real Ray actors, the real router, embedded engines, the fsdp trainer,
the grpo plugin, on a tiny random model. Each run is its own process, as a user would run it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures_engine import shm_left_behind, torch_shm_files
from slimecore.testing import timeout as scaled

pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")


def _train_args(checkpoint: Path, log_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--hf-checkpoint", str(checkpoint),
            "--task", "compare", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "8", "--lr", "1e-4", "--log-dir", str(log_dir), "--no-use-tensorboard",
            "--apply-chat-template", *extra]


def _run(args: list[str], timeout: float = scaled(240)) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc




def _metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_sync_loop_runs_and_logprobs_match(tiny_checkpoint, tmp_path):
    log_dir = tmp_path / "run"
    _run(_train_args(tiny_checkpoint, log_dir, "--num-rollout", "3", "--eval-prompt-data", "cmp", "task:compare",
                     "--eval-interval", "2", "--skip-eval-before-train", "--update-weight-transport", "disk"))
    steps = _metrics(log_dir)
    assert [m["rollout/step"] for m in steps] == [0, 1, 2]
    # eval after steps 2 and 3 (the last), on the held-out prompts
    assert [("eval/cmp" in m) for m in steps] == [False, True, True]
    assert 0.0 <= steps[1]["eval/cmp"] <= 1.0 and "eval/cmp-truncated_ratio" in steps[1]
    assert [p.name for p in (log_dir / "weights").iterdir()] == ["v3"]  # disk transport keeps the newest version
    first = steps[0]
    # the trainer's recomputed log-probs reproduce the engine's (fp32 on both sides)
    assert first["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert abs(first["train/ppo_kl"]) < 1e-6 and first["train/pg_clipfrac"] == 0.0  # on-policy first step
    for m in steps:
        for key in ("rollout/raw_reward", "perf/rollout_time", "perf/actor_train_time", "perf/update_weights_time",
                    "train/grad_norm", "perf/step_time"):
            assert key in m, key
    assert (log_dir / "config.yaml").is_file() and (log_dir / "final" / "model.safetensors").is_file()


def test_plugins_load_in_every_process_and_lifecycle_hooks_run(tiny_checkpoint, tmp_path):
    events_file = tmp_path / "events.jsonl"
    recorder = str(Path(__file__).parent / "recorder_plugin.py")
    before = torch_shm_files()
    _run(_train_args(tiny_checkpoint, tmp_path / "log", "--num-rollout", "2", "--plugin", recorder,
                     "--events-file", str(events_file), "--actor-num-gpus-per-node", "2"))
    assert not shm_left_behind(before), "the run left its weights in /dev/shm"
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    started = {(e["process"], e["pid"]) for e in events if e["event"] == "startup"}
    assert sorted(p for p, _ in started) == ["driver", "rollout", "train", "train"]  # 2 DP ranks
    assert len({pid for _, pid in started}) == 4  # four distinct processes loaded the plugin
    stopped = sorted(e["process"] for e in events if e["event"] == "shutdown")
    assert stopped == ["driver", "rollout", "train", "train"]
    post = [e for e in events if e["event"] == "postprocess"]
    assert sorted(e["rollout_id"] for e in post) == [0, 0, 1, 1] and all(e["has_advantages"] for e in post)
    assert sum(e["samples"] for e in post if e["rollout_id"] == 0) == 8  # split over the two ranks
    steps = _metrics(tmp_path / "log")
    assert [m["recorder/step_end"] for m in steps] == [0.0, 1.0]
    assert all(m["recorder/all_samples_processed"] == 1.0 for m in steps)


def test_async_loop_overlaps_and_bounds_staleness(tiny_checkpoint, tmp_path):
    log_dir = tmp_path / "async"
    _run(_train_args(tiny_checkpoint, log_dir, "--num-rollout", "4", "--train-async", "--max-staleness", "1"))
    steps = _metrics(log_dir)
    assert len(steps) == 4
    # generation of step N+1 started before training on step N ended
    overlaps = [steps[n + 1]["timeline/rollout_start"] < steps[n]["timeline/train_end"] for n in range(3)]
    assert all(overlaps), overlaps
    assert max(m["train/max_staleness"] for m in steps) <= 1
    assert max(m["train/max_staleness"] for m in steps[1:]) == 1  # one step off-policy, really
    assert all(m["train/stale_samples_dropped"] == 0 for m in steps)


def test_fully_async_bounds_staleness_and_checkpoints_the_groups_it_holds(tiny_checkpoint, tmp_path):
    log_dir, save = tmp_path / "fully", tmp_path / "ckpt"
    eval_yaml = tmp_path / "eval.yaml"
    eval_yaml.write_text("eval:\n  datasets:\n    - {name: cmp, path: 'task:compare', rm_type: compare, "
                         "n_samples_per_eval_prompt: 4, max_response_len: 4}\n")
    _run(_train_args(tiny_checkpoint, log_dir, "--num-rollout", "5", "--fully-async", "--max-staleness", "1",
                     "--fully-async-groups", "4", "--save", str(save), "--save-interval", "5",
                     "--eval-config", str(eval_yaml), "--eval-interval", "5", "--skip-eval-before-train"))
    steps = _metrics(log_dir)
    assert len(steps) == 5
    # eval runs in the fully-async mode too, with the data set's own settings
    assert {"eval/cmp", "eval/cmp/pass@1", "eval/cmp/pass@2", "eval/cmp/pass@4"} <= set(steps[-1])
    assert steps[-1]["eval/cmp/response_length"] <= 4
    assert steps[-1]["eval/cmp/pass@1"] == pytest.approx(steps[-1]["eval/cmp"])  # 0/1 rewards
    # no trained sample is older than the bound: the rollout re-generated the stale groups instead
    assert max(m["train/max_staleness"] for m in steps) <= 1
    assert all(m["train/stale_samples_dropped"] == 0 for m in steps)
    assert all("rollout/stale_groups_regenerated" in m and m["rollout/async_max_lag"] <= 1 for m in steps)
    # the groups queued or in flight when the checkpoint was taken are back in the saved buffer
    state = torch.load(save / "iter_0000004" / "rollout_state.pt", weights_only=False)["data_state"]
    assert state["buffer"] and all(s["response_length"] == 0 for g in state["buffer"] for s in g)
    held = {s["index"] for g in state["buffer"] for s in g}
    assert held and min(held) < state["sample_index"]


def test_debug_rollout_only_then_train_only_on_the_dump(tiny_checkpoint, tmp_path):
    dump = str(tmp_path / "dump" / "rollout_{rollout_id}.pt")
    _run(_train_args(tiny_checkpoint, tmp_path / "gen", "--num-rollout", "2", "--debug-rollout-only",
                     "--save-debug-rollout-data", dump))
    generated = _metrics(tmp_path / "gen")
    assert len(generated) == 2 and not any(k.startswith("train/") and k != "train/step" for m in generated for k in m)
    _run(_train_args(tiny_checkpoint, tmp_path / "train", "--num-rollout", "2", "--load-debug-rollout-data", dump))
    trained = _metrics(tmp_path / "train")
    assert [m["rollout/step"] for m in trained] == [0, 1] and all("train/grad_norm" in m for m in trained)
    assert [m["rollout/raw_reward"] for m in trained] == [m["rollout/raw_reward"] for m in generated]


def test_colocated_placement(tiny_checkpoint, tmp_path):
    _run(_train_args(tiny_checkpoint, tmp_path / "co", "--num-rollout", "1", "--colocate"))
    assert len(_metrics(tmp_path / "co")) == 1


def _prompts(dump: Path) -> list[tuple]:
    samples = torch.load(dump, weights_only=False)["samples"]
    return [(s["index"], s["group_index"], s["prompt"]) for s in samples]


def _tokens(dump: Path) -> list[list[int]]:
    return [s["tokens"] for s in torch.load(dump, weights_only=False)["samples"]]


def test_sigkill_then_resume_continues_with_the_same_prompts(tiny_checkpoint, tmp_path):
    # reference: an uninterrupted run of 4 steps
    ref = tmp_path / "ref"
    _run(_train_args(tiny_checkpoint, ref / "log", "--num-rollout", "4", "--rollout-shuffle",
                     "--save-debug-rollout-data", str(ref / "dump_{rollout_id}.pt")))
    # the same run, killed with SIGKILL right after step 1 (its checkpoint is complete); --load DIR --save DIR
    # on a DIR that does not exist yet (slime's scripts do so on a first run) starts fresh, saying so
    run = tmp_path / "run"
    save = run / "ckpt"
    args = _train_args(tiny_checkpoint, run / "log", "--num-rollout", "4", "--rollout-shuffle", "--save", str(save),
                       "--load", str(save), "--save-interval", "1",
                       "--save-debug-rollout-data", str(run / "dump_{rollout_id}.pt"),
                       "--plugin", str(Path(__file__).parent / "kill_plugin.py"), "--kill-after-step", "1")
    run.mkdir()
    with open(run / "first.log", "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
        assert proc.wait(timeout=scaled(240)) == -signal.SIGKILL
    assert f"--load {save}: no checkpoint in it yet; starting fresh" in (run / "first.log").read_text()
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
    # resume: continues at step 2 with exactly the prompts the uninterrupted run used, and says from where
    resumed = _run(_train_args(tiny_checkpoint, run / "log2", "--num-rollout", "4", "--rollout-shuffle", "--load",
                               str(save), "--save-debug-rollout-data", str(run / "resumed_{rollout_id}.pt")))
    assert f"resuming from {save / 'iter_0000001'}: 2 steps done, running steps 3-4 of --num-rollout 4" in \
        resumed.stderr
    assert [m["rollout/step"] for m in _metrics(run / "log2")] == [2, 3]
    for step in (2, 3):
        assert _prompts(run / f"resumed_{step}.pt") == _prompts(ref / f"dump_{step}.pt")
    # and the resumed run's next rollout samples the uninterrupted run's tokens (the same weights and sampling seeds)
    assert _tokens(run / "resumed_2.pt") == _tokens(ref / "dump_2.pt")
