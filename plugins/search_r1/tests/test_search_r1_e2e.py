"""End to end as a user runs it, on the tiny model taught the Search-R1 format: ``slime-core train --plugin grpo
--plugin search_r1`` for 2 steps with the BM25 retriever, real Ray actors, router, embedded engine and fsdp trainer.
Searches happen, the dumped samples keep tokens, loss masks and log-probs aligned with every observation masked,
and the trainer's log-probs of the model's tokens match the engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from search_r1_testkit import check_episode, search_data, taught_checkpoint  # noqa: F401
from slimecore.types import Sample
from slimecore.testing import timeout as scaled

pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")


def test_train_grpo_with_search_r1_for_two_steps(taught_checkpoint, search_data, tmp_path):
    corpus, qa = search_data
    log_dir, dump = tmp_path / "run", tmp_path / "dump" / "rollout_{rollout_id}.pt"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--plugin", "search_r1",
         "--hf-checkpoint", str(taught_checkpoint), "--prompt-data", str(qa), "--label-key", "label",
         "--apply-chat-template", "--search-corpus", str(corpus), "--search-topk", "1", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "4", "--rollout-max-response-len", "48", "--num-rollout", "2", "--lr", "1e-5",
         "--log-dir", str(log_dir), "--no-use-tensorboard", "--save-debug-rollout-data", str(dump)],
        capture_output=True, text=True, timeout=scaled(400), env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    steps = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/step"] for m in steps] == [0, 1]
    for m in steps:
        assert m["search_r1/searches_per_sample"] > 0 and 1 <= m["search_r1/turns_per_sample"] <= 2
        assert 0.0 <= m["search_r1/em"] <= 1.0 and "train/grad_norm" in m
    assert steps[0]["train/train_rollout_logprob_abs_diff"] < 1e-3  # engine vs trainer on model tokens
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(taught_checkpoint)
    searched = 0
    for step in range(2):
        samples = [Sample.from_dict(d) for d in torch.load(str(dump).format(rollout_id=step),
                                                           weights_only=False)["samples"]]
        assert len(samples) == 8
        for sample in samples:
            searched += check_episode(sample, tokenizer, corpus).count("search")
    assert searched >= 8  # the taught policy searches in most of its 16 episodes
