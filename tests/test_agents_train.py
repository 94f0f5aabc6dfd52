"""End to end as a user runs it: ``slime-core train --plugin grpo --plugin tests/agents/blackbox_plugin.py`` for 2
steps on the tiny model, real Ray actors, router (manual policy: one engine per session), embedded engine and fsdp
trainer. The agent is a separate program that knows only the official openai / anthropic SDKs and the
environment variables its session sets; its episodes become trained samples with exact tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slimecore.types import Sample

pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")
PLUGIN = Path(__file__).parent / "agents" / "blackbox_plugin.py"


def test_train_a_black_box_sdk_agent_for_two_steps(tiny_checkpoint, tmp_path):
    log_dir, dump = tmp_path / "run", tmp_path / "dump" / "rollout_{rollout_id}.pt"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--plugin", str(PLUGIN),
         "--hf-checkpoint", str(tiny_checkpoint), "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
         "--rollout-max-response-len", "8", "--num-rollout", "2", "--lr", "1e-5", "--agent-timeout", "120",
         "--log-dir", str(log_dir), "--no-use-tensorboard", "--save-debug-rollout-data", str(dump)],
        capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/step"] for m in steps] == [0, 1]
    assert all("train/grad_norm" in m and m["rollout/reward_failures"] == 0 for m in steps)
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3  # engine vs trainer on the agent's tokens
    apis = set()
    for step in range(2):
        samples = [Sample.from_dict(d) for d in torch.load(str(dump).format(rollout_id=step),
                                                           weights_only=False)["samples"]]
        assert len(samples) >= 8 and all(s.status != Sample.Status.FAILED for s in samples)
        for sample in samples:
            apis.add(sample.metadata["blackbox"]["api"])
            assert sample.session_id.startswith("slime-") and sample.rollout_id == sample.index
            assert sample.reward == (1.0 if any(c.isdigit() for c in sample.metadata["blackbox"]["answer"]) else 0.0)
            assert 0 < sum(sample.loss_mask) <= 8 * sample.metadata["turns"]
    assert apis == {"openai", "anthropic"}
