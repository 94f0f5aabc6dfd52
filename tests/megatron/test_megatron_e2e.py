"""End to end through the CLI with ``--train-backend megatron`` on CPU: real Ray, the real router, an embedded
engine, the grpo plugin, the models plugin's bridge, and two train ranks in one tensor-parallel group (TP = 2),
dynamic micro-batches by token budget. ``cpu_plugin.py`` installs the CPU shim in each train process. (Resuming
from the torch_dist checkpoint is tested on the trainer, in ``test_megatron_backend.py``.)"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from slimecore.testing import timeout as scaled

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("megatron.core", "mbridge", "slime_grpo", "slime_models")),
    reason="needs megatron-core, mbridge and the grpo and models plugins (scripts/setup.sh installs them)")

CPU_PLUGIN = str(Path(__file__).with_name("cpu_plugin.py"))
DIGITS = str(Path(__file__).parent.parent / "digits_reward_plugin.py")


def _train(checkpoint: Path, log_dir: Path, *extra: str) -> list[dict]:
    args = [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--plugin", "models",
            "--train-backend", "megatron", "--plugin", CPU_PLUGIN, "--hf-checkpoint", str(checkpoint),
            "--task", "compare", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--rollout-max-response-len", "8", "--lr", "1e-4", "--log-dir", str(log_dir), "--no-use-tensorboard",
            "--apply-chat-template", "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", *extra]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_on_megatron_tp2_trains_syncs_weights_and_saves(tiny_checkpoint, tmp_path):
    steps = _train(tiny_checkpoint, tmp_path / "run", "--num-rollout", "2", "--save", str(tmp_path / "ckpt"),
                   "--save-hf", "--plugin", DIGITS)  # a dense reward, so the weights move in two steps
    assert [m["rollout/step"] for m in steps] == [0, 1]
    for m in steps:
        # the engine generated with the weights the trainer exported (TP-gathered, HF names): same log-probs
        assert m["train/train_rollout_logprob_abs_diff"] < 1e-4
        assert "train/grad_norm" in m and "perf/update_weights_time" in m
        assert m["perf/actor_train_tok_per_s"] > 0 and m["perf/actor_train_tflops"] > 0
    assert abs(steps[0]["train/ppo_kl"]) < 1e-6 and steps[0]["train/pg_clipfrac"] == 0.0
    actor = tmp_path / "ckpt" / "iter_0000001" / "actor"
    meta = json.loads((actor / "megatron_checkpoint.json").read_text())
    assert meta["tensor_model_parallel_size"] == 2 and meta["iteration"] == 2 and meta["optimizer"]
    assert sorted(p.name for p in actor.glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]
    assert (actor / "torch_dist" / "metadata.json").is_file()
    _exports_the_trained_model_as_hf(tiny_checkpoint, tmp_path / "run" / "final", tmp_path / "ckpt" / "iter_0000001")


def _exports_the_trained_model_as_hf(start: Path, final: Path, last_checkpoint: Path) -> None:
    """final/ (and --save-hf's hf/) come from the bridge's TP-gathered HF export: the model HF tools load, trained."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    def weights(directory: Path) -> dict:
        return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    exported, initial = weights(final), weights(start)
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in initial.items()}
    assert not torch.equal(exported["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"])
    saved = weights(last_checkpoint / "hf")  # --save-hf at the last step: the same weights
    assert all(torch.equal(saved[k], v) for k, v in exported.items())
    assert AutoModelForCausalLM.from_pretrained(final).state_dict()["lm_head.weight"].shape[0] > 0
    assert AutoTokenizer.from_pretrained(final).chat_template
    out = pipeline("text-generation", model=str(final))("Which number is larger", max_new_tokens=4, do_sample=False)
    assert out[0]["generated_text"].startswith("Which number is larger")
