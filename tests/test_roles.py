"""Training roles as data (``slimecore.trainers.roles``): declarations are checked before Ray starts, with the
plugin named, and a role set the core does not know runs through the whole loop with its feeds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slimecore import hookimpl
from slimecore.config import Config
from slimecore.data.tasks import write_task_jsonl
from slimecore.plugins import PluginError, load_plugins
from slimecore.testing import timeout as scaled
from slimecore.trainers.roles import Feed, TrainRole, declared_roles

ROLES_PLUGIN = Path(__file__).with_name("roles_plugin.py")
DIGITS_REWARD = Path(__file__).with_name("digits_reward_plugin.py")


def _roles(*answers):
    plugins = []
    for i, answer in enumerate(answers):
        plugin = type(f"Plugin{i}", (), {"slime_train_roles": hookimpl(lambda self, config, answer=answer: answer)})
        plugins.append(plugin())
    return declared_roles(Config.make(), load_plugins([], extra=plugins))


def test_roles_train_in_feed_order_with_the_actor_first():
    roles = _roles([TrainRole("late", feeds=[Feed("early", "outputs")]), TrainRole("early", model="value"),
                    "plain"])
    assert [r.name for r in roles] == ["actor", "early", "late", "plain"]
    assert [r.name for r in _roles([])] == ["actor"]
    # a plugin may move the actor after a role whose outputs it takes
    roles = _roles([TrainRole("actor", feeds=[Feed("teacher", "outputs")]), TrainRole("teacher")])
    assert [r.name for r in roles] == ["teacher", "actor"]


@pytest.mark.parametrize("answer, message", [
    ([TrainRole("critic", feeds=[Feed("ghost")])], "fed by role 'ghost', which no active plugin declares"),
    ([TrainRole("a", feeds=[Feed("b", "scores")]), TrainRole("b")], "only value models score a batch"),
    ([TrainRole("a", feeds=[Feed("b")]), TrainRole("b", feeds=[Feed("a")])], "in a circle"),
    ([TrainRole("critic", model="reward")], "model must be one of"),
    ([TrainRole("critic", options={"rollout_batch_size": 2})], "a role may set"),
    ([TrainRole("critic", options={"critic_lr": 2})], "not core options"),
    ([TrainRole("actor", model="value")], "the actor is the policy the engines serve"),
    ([TrainRole("critic", feeds=[Feed("actor", "values")])], "kind in ('scores', 'outputs')"),
    (["bad name"], "must be an identifier"),
    ([3], "must return TrainRole declarations"),
])
def test_bad_declarations_name_the_plugin(answer, message):
    with pytest.raises(PluginError, match="Plugin0") as caught:
        _roles(answer)
    assert message in str(caught.value)


def test_two_plugins_declaring_one_role_differently_is_an_error():
    same = TrainRole("critic", model="value", options={"lr": 0.1})
    assert [r.name for r in _roles([same], [TrainRole("critic", model="value", options={"lr": 0.1})])] == \
        ["actor", "critic"]
    with pytest.raises(PluginError, match="plugins 'Plugin.' and 'Plugin.' declare training role 'critic' differently"):
        _roles([same], [TrainRole("critic", model="value", options={"lr": 0.2})])


def test_a_role_set_the_core_does_not_know_trains_with_its_feeds(tiny_checkpoint, tmp_path):
    """Three roles from a test plugin, one epoch of 6 prompts in batches of 2 (``--num-epoch``, no
    ``--num-rollout``): 3 steps, each role's own learning rate on its own linear schedule of 3 steps."""
    prompts = write_task_jsonl("compare", tmp_path / "prompts.jsonl", 6, seed=0)
    log_dir, save = tmp_path / "run", tmp_path / "ckpt"
    args = [sys.executable, "-m", "slimecore_cli", "train", "--plugin", str(ROLES_PLUGIN), "--plugin",
            str(DIGITS_REWARD), "--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", str(prompts),
            "--label-key", "label", "--apply-chat-template", "--rollout-batch-size", "2", "--n-samples-per-prompt",
            "2", "--rollout-max-response-len", "4", "--num-epoch", "1", "--lr", "1e-3", "--lr-decay-style", "linear",
            "--save", str(save), "--save-interval", "3", "--log-dir", str(log_dir), "--no-use-tensorboard"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=scaled(400))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/step"] for m in steps] == [0, 1, 2]  # --num-epoch 1: 6 prompts / 2 per step
    for m in steps:
        assert {"perf/actor_train_time", "perf/baseline_train_time", "perf/shadow_train_time"} <= set(m)
        assert {"baseline/value_loss", "shadow/value_loss"} <= set(m)
        # the shadow trained on the actor's returns (reward + 1), the baseline on its own (reward)
        assert m["shadow/target_mean"] == pytest.approx(m["baseline/target_mean"] + 1, abs=1e-5)
    assert "train/pg_loss" not in steps[0] and all("train/pg_loss" in m for m in steps[1:])  # update_from=1
    assert all(m["train/fed_values"] != 0.0 for m in steps[1:])  # the baseline's values reached the actor
    # the schedules have the run's length (3 optimizer steps): linear decay to 0, each role at its own lr
    assert [m["baseline/lr"] for m in steps] == pytest.approx([0.05, 0.05 * 2 / 3, 0.05 / 3])
    assert [m["train/lr"] for m in steps[1:]] == pytest.approx([1e-3, 1e-3 * 2 / 3])
    assert sorted(p.name for p in (save / "iter_0000002").iterdir() if p.is_dir()) == ["actor", "baseline", "shadow"]
