"""End to end as a user runs it: ``slime-core train --plugin grpo --plugin verifiers`` for 2 steps on the tiny model
(real Ray actors, router, embedded engine, fsdp trainer), on the shipped example taskset played by verifiers' null
harness: each sample's reward is the taskset's own ``@vf.reward``, its tokens are what the session recorded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from slimecore.types import Sample

pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")


def test_train_grpo_on_a_verifiers_environment_for_two_steps(tiny_hf_checkpoint, tmp_path):
    log_dir, dump = tmp_path / "run", tmp_path / "dump" / "rollout_{rollout_id}.pt"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--plugin", "verifiers",
         "--hf-checkpoint", str(tiny_hf_checkpoint), "--vf-env-args", '{"num_tasks": 8}',
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "16",
         "--num-rollout", "2", "--lr", "1e-5", "--agent-timeout", "120", "--log-dir", str(log_dir),
         "--no-use-tensorboard", "--save-debug-rollout-data", str(dump)],
        capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/step"] for m in steps] == [0, 1]
    for m in steps:
        assert "train/grad_norm" in m and m["rollout/reward_failures"] == 0
        assert 0.0 <= m["verifiers/reward/correct"] <= 1.0 and "verifiers/metric/reply_chars" in m
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3  # engine vs trainer on the recorded tokens
    answers = {json.loads(line)["question"]: json.loads(line)["answer"]
               for line in open(os.path.join(os.path.dirname(__import__("slime_vf_compare").__file__),
                                             "compare.jsonl"))}
    for step in range(2):
        samples = [Sample.from_dict(d) for d in torch.load(str(dump).format(rollout_id=step),
                                                           weights_only=False)["samples"]]
        assert len(samples) == 8 and not [s for s in samples if s.status == Sample.Status.FAILED]
        for sample in samples:
            meta = sample.metadata["verifiers"]
            question = next(q for q in answers if q in sample.prompt)
            numbers = re.findall(r"\d+", sample.response)
            assert sample.reward == meta["reward"] == float(bool(numbers) and numbers[0] == answers[question])
            assert sample.session_id.startswith("slime-") and 0 < sum(sample.loss_mask) <= 16
