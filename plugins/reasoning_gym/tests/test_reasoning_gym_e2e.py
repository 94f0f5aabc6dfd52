"""End to end as a user runs it: ``slime-core train --plugin grpo --plugin reasoning_gym`` for 3 steps on the tiny
model (real Ray actors, router, embedded engine, fsdp trainer, the real reasoning-gym package). The tasks start
at level 2 with a lower threshold the random model cannot pass, so each step's results move the levels down:
adaptation happens inside a real run and is logged per task."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")


def test_train_grpo_on_reasoning_gym_tasks_for_three_steps(tiny_hf_checkpoint, tmp_path):
    log_dir = tmp_path / "run"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--plugin", "reasoning_gym",
         "--hf-checkpoint", str(tiny_hf_checkpoint), "--rg-tasks", "basic_arithmetic", "leg_counting",
         "--rg-start-level", "2", "--rg-min-samples", "4", "--rg-window", "8", "--rg-lower-at", "0.5",
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "16",
         "--num-rollout", "3", "--lr", "1e-5", "--log-dir", str(log_dir), "--no-use-tensorboard"],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/step"] for m in steps] == [0, 1, 2]
    for m in steps:
        assert "train/grad_norm" in m and 0.0 <= m["rollout/raw_reward"] <= 1.0
        rewards = [v for k, v in m.items() if k.startswith("reasoning_gym/") and k.endswith("/reward")]
        assert rewards and all(0.0 <= r <= 1.0 for r in rewards)
    levels = {task: [m[f"reasoning_gym/{task}/level"] for m in steps] for task in ("basic_arithmetic", "leg_counting")}
    # a random model passes nothing: every task that was drawn 4 times at its level went down, none went up
    for task, history in levels.items():
        assert all(b <= a for a, b in zip([2.0, *history], history)), (task, history)
    assert min(history[-1] for history in levels.values()) < 2.0, levels
