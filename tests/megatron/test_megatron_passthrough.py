"""Megatron arguments given on the command line reach megatron-core's configs in a real megatron backend (CPU shim,
as the other megatron tests): a TransformerConfig field, the optimizer choice and a DDP setting."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from slimecore.testing.distributed import run_ranks

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("megatron.core", "mbridge", "slime_grpo", "slime_models")),
    reason="needs megatron-core, mbridge and the grpo and models plugins (scripts/setup.sh installs them)")
HERE = Path(__file__).resolve().parent


def built_with_passed_args(rank, world, checkpoint):
    sys.path.insert(0, str(HERE))
    import cpu_shim

    cpu_shim.install()
    import torch
    from megatron.core.utils import get_model_config
    from megatron_checks import _hooks, grpo_config

    from slimecore.config import parse_config
    from slimecore.trainers.trainer import Trainer

    parsed = parse_config(["--rollout-batch-size", "2", "--hidden-dropout", "0.25", "--attention-softmax-in-fp32",
                           "--optimizer", "sgd", "--check-for-nan-in-grad"], [], {})
    config = grpo_config(checkpoint)
    config.megatron_args.update(parsed.megatron_args)
    backend = Trainer(config, _hooks(), rank=rank, world_size=world, backend="megatron").backend
    model_config = get_model_config(backend.chunks[0])
    inner = backend.optimizer
    while not isinstance(inner, torch.optim.Optimizer):
        inner = getattr(inner, "optimizer", None) or inner.chained_optimizers[0]
    return (model_config.hidden_dropout, model_config.attention_softmax_in_fp32, type(inner).__name__,
            backend.chunks[0].ddp_config.check_for_nan_in_grad)


def test_megatron_arguments_reach_megatron_core(tiny_checkpoint):
    [(dropout, softmax_fp32, optimizer, nan_check)] = run_ranks(built_with_passed_args, str(tiny_checkpoint), world=1)
    assert (dropout, softmax_fp32, optimizer, nan_check) == (0.25, True, "SGD", True)
