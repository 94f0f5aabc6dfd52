"""``--ref-load`` on the megatron backend, in a fresh spawned process (``run_ranks``) with the CPU shim of
tests/megatron: the reference policy and the starting weights come from an HF directory, then from a torch_dist
checkpoint; the answers are plain numbers for tests/test_slime_flags.py."""

from __future__ import annotations

import sys
from pathlib import Path

MEGATRON_TESTS = Path(__file__).resolve().parents[1] / "megatron"


def _max_diff(weights: dict, expected: dict) -> float:
    return max(float((weights[k].float() - expected[k].float()).abs().max()) for k in expected)


def megatron_ref_load(rank: int, world: int, policy: str, reference: str, torch_dist: str) -> dict:
    sys.path.insert(0, str(MEGATRON_TESTS))
    import megatron_checks

    megatron_checks._setup()
    import torch
    from safetensors.torch import load_file

    from slimecore.convert import hf_to_megatron
    from slimecore.trainers.megatron import MegatronBackend

    hooks = megatron_checks._hooks()
    expected, initial = load_file(f"{reference}/model.safetensors"), load_file(f"{policy}/model.safetensors")
    out = {}
    for name, ref_load in (("hf", reference), ("torch_dist", torch_dist)):
        if name == "torch_dist":
            hf_to_megatron(reference, torch_dist, hooks)
        config = megatron_checks.grpo_config(policy, ref_load=ref_load)
        backend = MegatronBackend(config, hooks, keep_reference=True)
        start = dict(backend.model.hf_weights())
        with torch.no_grad():
            for p in backend.modules.parameters():
                p.add_(1.0)  # a training step's worth of change
            with backend.reference_weights():
                ref = dict(backend.model.hf_weights())
        out[name] = {"start_vs_ref_load": _max_diff(start, expected), "reference_vs_ref_load": _max_diff(ref, expected),
                     "start_vs_hf_checkpoint": _max_diff(start, initial)}
    return out
