"""End to end, as a user runs it: ``slime-core train --plugin sft`` on the tiny model, the built-in ``compare``
task as conversations, real Ray actors and the fsdp trainer, no inference engine; the loss goes down."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from slimecore.testing import timeout as scaled


def test_slime_core_train_plugin_sft_lowers_the_loss_on_a_built_in_task(tiny_hf_checkpoint, tmp_path):
    log_dir = tmp_path / "run"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "slimecore_cli", "train", "--plugin", "sft", "--hf-checkpoint",
                           str(tiny_hf_checkpoint), "--task", "compare", "--task-size", "48", "--num-rollout", "6",
                           "--lr", "1e-3", "--log-dir", str(log_dir), "--no-use-tensorboard"],
                          capture_output=True, text=True, timeout=scaled(300), env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "plugin 'sft' runs with --no-engines --n-samples-per-prompt 1" in proc.stderr
    steps = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/step"] for m in steps] == list(range(6))  # 6 steps of the task's 8 conversations: one epoch
    losses = [m["train/loss"] for m in steps]
    assert statistics.fmean(losses[-2:]) < statistics.fmean(losses[:2]) - 0.3, losses
    assert all(m["perf/update_weights_time"] == 0.0 for m in steps)  # no engine, so no weight sync
    assert all(m["rollout/raw_reward"] == 0.0 and m["train/grad_norm"] > 0 for m in steps)
