"""Each algorithm trains: ``slime-core train --plugin NAME`` on the tiny random model raises its reward
within 20 steps, through the whole loop (Ray, router, embedded engine, fsdp trainer, plus a critic for PPO).

The objective is ``digits_reward_plugin`` (share of digit characters in the answer) on the built-in
``compare`` prompts: a random 100k-parameter model never earns the task's own 0/1 reward, so no algorithm
could show progress on it in a CPU test. The SmolLM2 runs on the real task are in the plugins' READMEs."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from slimecore.testing import timeout as scaled

pytest.importorskip("slime_ppo", reason="the algorithm plugins are installed by scripts/setup.sh")
REWARD = str(Path(__file__).with_name("digits_reward_plugin.py"))

ALGORITHMS = {
    "grpo": ["--plugin", "grpo"],
    "dr-grpo": ["--plugin", "grpo", "--disable-grpo-std-normalization"],
    # (this dense reward seldom gives all-equal groups; tests/test_rollout.py checks the zero-std filter)
    "dapo": ["--plugin", "grpo", "--eps-clip-high", "0.28", "--dynamic-sampling-filter", "nonzero_std",
             "--over-sampling-batch-size", "6", "--overlong-buffer-len", "2", "--calculate-per-token-loss"],
    "gspo": ["--plugin", "gspo"],
    "ppo": ["--plugin", "ppo", "--num-critic-only-steps", "1", "--critic-lr", "1e-2"],
    "reinforce++": ["--plugin", "ppo", "--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages"],
    "reinforce++-baseline": ["--plugin", "ppo", "--advantage-estimator", "reinforce_plus_plus_baseline",
                             "--normalize-advantages"],
}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_algorithm_raises_the_reward(name, tiny_checkpoint, tmp_path):
    log_dir = tmp_path / "run"
    args = [sys.executable, "-m", "slimecore_cli", "train", *ALGORITHMS[name], "--plugin", REWARD,
            "--hf-checkpoint", str(tiny_checkpoint), "--task", "compare", "--apply-chat-template",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "4",
            "--lr", "1e-2", "--num-rollout", "20", "--log-dir", str(log_dir), "--no-use-tensorboard"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=scaled(400))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [m["rollout/raw_reward"] for m in steps]
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    assert last > first + 0.1, (name, [round(r, 2) for r in rewards])
    trained = [m for m in steps if "train/pg_loss" in m]
    # the first actor update is on-policy: ratio 1, nothing clipped
    assert abs(trained[0]["train/ppo_kl"]) < 1e-6 and trained[0]["train/pg_clipfrac"] == 0.0
    if name == "ppo":
        assert "train/pg_loss" not in steps[0] and "critic/value_loss" in steps[0]  # critic-only first step
        assert all("critic/value_loss" in m for m in steps)
        assert all(m["perf/critic_train_tok_per_s"] > 0 for m in steps)
