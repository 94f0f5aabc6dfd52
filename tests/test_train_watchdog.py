"""--train-timeout: a training step that hangs on a rank fails the run with the rank and the stage, and
the rank's Python stack, instead of waiting out --ray-timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")


def test_a_hung_training_step_fails_naming_rank_stage_and_stack(tiny_checkpoint, tmp_path):
    args = [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo",
            "--plugin", str(Path(__file__).parent / "hang_plugin.py"), "--hang-at-step", "1",
            "--hf-checkpoint", str(tiny_checkpoint), "--task", "compare", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8", "--num-rollout", "3",
            "--log-dir", str(tmp_path / "run"), "--no-use-tensorboard", "--train-timeout", "20"]
    start = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "actor rank(s) [0] of 1 hung in training on rollout 1: no answer after 20s (--train-timeout)" in output
    # the hung rank's stack, printed by faulthandler in the train actor, names the line that hangs
    assert "Timeout (0:00:18)!" in output and "hang_plugin.py" in output
    # step 0 trained; the run ended soon after the timeout instead of waiting out --ray-timeout (1800 s)
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
    assert elapsed < 200, elapsed
