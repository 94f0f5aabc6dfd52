"""End to end as a user runs it: ``slime-core train --plugin grpo --plugin openenv`` for 2 steps on the tiny model
(real Ray actors, router, embedded engine, fsdp trainer), on the shipped guessing game served by openenv-core's
server in its own process: each sample's reward is the environment's, its tokens are what the session recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from slimecore.types import Sample

from slime_openenv.guess.server import first_integer, secret_for

pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")


def test_train_grpo_on_an_openenv_environment_for_two_steps(tiny_hf_checkpoint, tmp_path):
    log_dir, dump = tmp_path / "run", tmp_path / "dump" / "rollout_{rollout_id}.pt"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--plugin", "openenv",
         "--hf-checkpoint", str(tiny_hf_checkpoint), "--openenv-episodes", "8", "--openenv-max-turns", "3",
         "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
         "--num-rollout", "2", "--lr", "1e-5", "--agent-timeout", "120", "--log-dir", str(log_dir),
         "--no-use-tensorboard", "--save-debug-rollout-data", str(dump)],
        capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/step"] for m in steps] == [0, 1]
    for m in steps:
        assert "train/grad_norm" in m and m["rollout/reward_failures"] == 0
        assert 1.0 <= m["openenv/steps"] <= 3.0 and 0.0 <= m["openenv/done"] <= 1.0
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3  # engine vs trainer on the recorded tokens
    for step in range(2):
        samples = [Sample.from_dict(d) for d in torch.load(str(dump).format(rollout_id=step),
                                                           weights_only=False)["samples"]]
        assert len(samples) == 8 and not [s for s in samples if s.status == Sample.Status.FAILED]
        for sample in samples:
            meta = sample.metadata["openenv"]
            secret = secret_for(meta["seed"])
            assert sample.prompt.startswith("I picked a whole number")
            # every reply was one guess: the episode ends early exactly when one hits (reward 1), and that is the
            # last reply recorded; with 3 turns allowed of the game's 4 guesses, an episode without a hit is cut off
            hit = first_integer(sample.metadata["final_text"]) == secret
            assert sample.reward == meta["reward"] == sum(meta["rewards"]) == float(hit) == float(meta["done"])
            assert sample.metadata["turns"] == meta["steps"] == (len(meta["rewards"])) and meta["steps"] <= 3
            assert sample.session_id.startswith("slime-") and 0 < sum(sample.loss_mask) <= 3 * 6
