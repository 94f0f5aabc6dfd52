"""Several rewards combined (TRL's reward_funcs + reward_weights): every answering reward plugin is called, the
sample's reward is the weighted sum, each part is logged under its own name; start-up checks of the weights."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from slimecore.config import Config, ConfigError
from slimecore.defaults.reward import NAME, check_reward_sources, combined_reward, reward_sources
from slimecore.plugins import HookCallError, load_plugins
from slimecore.types import Sample

LENGTH = '''
from slimecore import hookimpl

@hookimpl
async def slime_reward(config, sample):
    return len(sample.response) / 10
'''
MENTIONS = '''
from slimecore import hookimpl

@hookimpl
async def slime_reward(config, sample):
    if sample.metadata.get("skip_mentions"):
        return None  # not applicable to this sample: left out of its sum
    return {"score": float(str(sample.label) in sample.response), "extra": 7.0}
'''


@pytest.fixture
def plugin_files(tmp_path):
    (tmp_path / "length.py").write_text(LENGTH)
    (tmp_path / "mentions.py").write_text(MENTIONS)
    return [str(tmp_path / "length.py"), str(tmp_path / "mentions.py")]


def _config(plugins, weights=None, **overrides):
    return Config.make(plugins=plugins, plugin_values={NAME: {"reward_weights": weights}}, reward_key="score",
                       **overrides)


def _score(hooks, config, sample):
    return asyncio.run(combined_reward(hooks, config, sample))


def test_weighted_sum_of_every_reward_plugin_in_plugin_order(plugin_files):
    config = _config(plugin_files, [0.5, 2.0])
    hooks = load_plugins(plugin_files).bind(config)
    hooks.check(skip_required=["slime_compute_advantages", "slime_loss"])  # two plugins answering slime_reward is not a conflict: its answers are combined
    assert [name for name, _ in reward_sources(hooks, config)] == ["length", "mentions"]
    sample = Sample(label="7", response="it is 7")
    assert _score(hooks, config, sample) == pytest.approx(0.5 * 0.7 + 2.0 * 1.0)
    assert sample.metadata["rewards"] == {"length": pytest.approx(0.7), "mentions": 1.0}
    # without weights, each counts once (TRL's default)
    assert _score(hooks.bind(_config(plugin_files)), _config(plugin_files), Sample(label="7", response="8")) == \
        pytest.approx(0.1)


def test_none_is_left_out_and_metrics_per_reward(plugin_files):
    config = _config(plugin_files, [1.0, 1.0])
    hooks = load_plugins(plugin_files).bind(config)
    samples = [Sample(label="1", response="1234", metadata={"skip_mentions": True}),
               Sample(label="1", response="12")]
    assert [_score(hooks, config, s) for s in samples] == [pytest.approx(0.4), pytest.approx(1.2)]
    assert samples[0].metadata["rewards"] == {"length": pytest.approx(0.4)}
    metrics: dict = {}
    hooks.slime_log_rollout(config=config, rollout_id=0, samples=samples, metrics=metrics)
    assert metrics == {"rollout/reward/length": pytest.approx(0.3), "rollout/reward/mentions": 1.0}


def test_dict_answer_needs_a_reward_key(plugin_files):
    config = Config.make(plugins=plugin_files, plugin_values={NAME: {"reward_weights": [1.0, 1.0]}})
    hooks = load_plugins(plugin_files).bind(config)
    with pytest.raises(HookCallError, match="'mentions' raised in slime_reward.*--reward-key"):
        _score(hooks, config, Sample(label="1", response="1"))


def test_builtin_reward_joins_with_rm_type_and_weights(plugin_files):
    config = _config(plugin_files[:1], [3.0, 1.0], rm_type="compare")
    hooks = load_plugins(plugin_files[:1]).bind(config)
    assert [name for name, _ in reward_sources(hooks, config)] == ["compare", "length"]
    sample = Sample(label="82", response="82", metadata={})
    assert _score(hooks, config, sample) == pytest.approx(3.0 * 1.0 + 0.2)
    # one plugin and no weights: it replaces the built-in, as before
    plain = _config(plugin_files[:1], None, rm_type="compare")
    assert [name for name, _ in reward_sources(hooks.bind(plain), plain)] == ["length"]


def test_weights_are_checked_at_startup(plugin_files):
    config = _config(plugin_files, [1.0])
    with pytest.raises(ConfigError, match=r"1 weight\(s\) but this run has 2 reward\(s\): length, mentions"):
        check_reward_sources(load_plugins(plugin_files).bind(config), config)
    config = _config(plugin_files, [1.0, 1.0], group_rm=True)
    with pytest.raises(ConfigError, match="--group-rm scores whole groups"):
        check_reward_sources(load_plugins(plugin_files).bind(config), config)


def test_cli_combines_rewards_in_a_real_run(tiny_checkpoint, plugin_files, tmp_path):
    pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"Say {i}", "label": str(i)}) + "\n" for i in range(4)))
    base = [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--plugin", plugin_files[0],
            "--plugin", plugin_files[1], "--hf-checkpoint", str(tiny_checkpoint), "--prompt-data", str(prompts),
            "--label-key", "label", "--reward-key", "score", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--num-rollout", "1",
            "--log-dir", str(tmp_path / "run"), "--no-use-tensorboard"]
    bad = subprocess.run(base + ["--reward-weights", "1", "2", "3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "3 weight(s) but this run has 2 reward(s)" in bad.stderr, bad.stderr[-2000:]
    assert "Started a local Ray instance" not in bad.stderr
    proc = subprocess.run(base + ["--reward-weights", "0.5", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (step,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    parts = step["rollout/reward/length"], step["rollout/reward/mentions"]
    assert 0.0 <= parts[1] <= 1.0 and parts[0] >= 0.0
    assert step["rollout/raw_reward"] == pytest.approx(0.5 * parts[0] + 2.0 * parts[1])
