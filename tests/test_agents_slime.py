"""slime users' agent functions run unchanged: tests/agents/slime_agent_function.py, written for THUDM/slime as its
docs show (``slime.agent.adapters.OpenAIAdapter``, ``run_app_in_thread``, ``open_session`` / ``finish_session``),
trains 2 steps in a real ``slime-core train --custom-generate-function-path`` on the tiny model taught to call a
tool; the adapter is slime-core's session server, so the samples are the engine's exact tokens."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from slimecore.data.tasks import write_task_jsonl
from slimecore.types import Sample

pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")
FUNCTION = Path(__file__).parent / "agents" / "slime_agent_function.py"


def test_a_slime_agent_function_trains_unchanged(tool_checkpoint, tmp_path):
    shutil.copy(FUNCTION, tmp_path / FUNCTION.name)
    log_dir, dump = tmp_path / "run", tmp_path / "dump" / "rollout_{rollout_id}.pt"
    tasks = write_task_jsonl("compare", tmp_path / "compare.jsonl", 32, seed=0)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--hf-checkpoint", str(tool_checkpoint),
         "--custom-generate-function-path", "slime_agent_function.generate", "--prompt-data", str(tasks),
         "--label-key", "label", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
         "--rollout-max-response-len", "96", "--num-rollout", "2", "--lr", "1e-5", "--log-dir", str(log_dir),
         "--no-use-tensorboard", "--save-debug-rollout-data", str(dump)],
        cwd=tmp_path, capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/step"] for m in steps] == [0, 1] and all("train/grad_norm" in m for m in steps)
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3  # engine vs trainer on the adapter's tokens
    tool_episodes = 0
    for step in range(2):
        samples = [Sample.from_dict(d) for d in torch.load(str(dump).format(rollout_id=step),
                                                           weights_only=False)["samples"]]
        assert len(samples) == 8 and set(Counter(s.rollout_id for s in samples).values()) == {1}
        for sample in samples:
            results, answer = sample.metadata["tool_results"], sample.metadata["answer"]
            assert sample.session_id.startswith("slime-agent-") and sample.rollout_id == sample.index
            assert sample.reward == (1.0 if results and str(results[-1]) in answer else 0.0)
            if results:  # call (trained), tool result (masked), answer (trained)
                tool_episodes += 1
                assert "<tool_call>" in sample.response and "<tool_response>" in sample.response
                assert 0 < sum(sample.loss_mask) < len(sample.loss_mask)
    assert tool_episodes >= 8
