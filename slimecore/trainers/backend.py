"""What a training backend provides, and the pieces every backend shares.

A backend owns the model of one rank of one training role: it builds it, runs its forward (per-token
log-probs of response tokens, with entropies, or a value model's values) and backward over micro-batches,
steps the optimizer, exports HF-named weights for the engines, saves and loads checkpoints and moves its
state off the device and back. Everything else about a training step (which inputs to pre-compute, the
advantage and loss hooks, the reducer, the metrics) is ``slimecore.trainers.trainer.Trainer``, the same
for every backend. ``fsdp.py`` and ``megatron.py`` are the two backends; ``docs/backends.md`` says how to
write a third.

This module imports no torch at import time. The backends' table, ``TRAIN_BACKENDS``, stands in ``slimecore.config``
(the ``--train-backend`` choices).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager, Protocol

from slimecore.config import TRAIN_BACKENDS

REFERENCE = "ref_log_probs"  # the column scored under the reference policy (``reference_weights()``)

if TYPE_CHECKING:
    import torch

# The model outputs of one micro-batch, per sample (``(R_i,)`` each, over its response tokens):
# ``{"log_probs": [...], "entropy": [...] or None}`` for a policy, ``{"values": [...]}`` for a value model.
Outputs = dict[str, Any]
# Called once per non-empty micro-batch with its sample indices and outputs: ``(loss, info)``.
MicroBatchFn = Callable[[list[int], Outputs], "tuple[torch.Tensor, Any]"]


class TrainBackend(Protocol):
    """One rank's model, optimizer and weights, behind the backend-independent ``Trainer``.

    Built as ``cls(config, hooks, rank=, world_size=, value_model=, keep_reference=, other_weights=, **options)``:
    the caller has initialised torch.distributed when ``world_size`` > 1; ``hooks`` is the run's hook facade (a
    backend may ask ``slime_model_bridge`` for its model); ``value_model`` asks for a value head (one output per
    token, role ``critic``) instead of the LM head; ``keep_reference`` asks for the initial weights to be kept for
    ``reference_weights()``; ``other_weights`` (``{column: checkpoint}``, ``slime_scoring_weights``) for each
    checkpoint's weights to be kept for ``reference_weights(column)``, read as ``--ref-load`` reads its
    checkpoint. Unknown ``options`` are a ``TypeError``.
    """

    device: torch.device  # where micro-batch tensors go
    hf_config: Any  # the HF config of the model trained (FLOPs figures)
    rank: int
    world_size: int
    collective_export: bool  # every rank must call named_weights / iterate hf_weight_buckets (rank 0 gets them)

    def run_micro_batches(self, batch: dict, micro_batches: list[list[int]], fn: MicroBatchFn, *,
                          temperature: float, with_entropy: bool, train: bool) -> list:
        """Forward the micro-batches (indices into the per-sample lists of ``batch``, which hold at least
        ``tokens`` and ``response_lengths``) in order; for each non-empty one call ``fn(micro_batch, outputs)``
        with the model outputs (log-probs of ``logits / temperature``, entropies if ``with_entropy``; values
        for a value model, temperature ignored) and collect its ``info``.

        ``train=True``: the gradients are reset, then ``fn``'s losses are back-propagated so that the
        gradient is exactly the sum of the losses' gradients (a backend whose own schedule divides by the
        micro-batch count or averages over data-parallel ranks scales the loss back up); returns the infos
        of the ranks that compute losses (other pipeline stages: ``[]``). ``train=False``: no gradient,
        ``fn``'s loss is ignored (it may be None), and every rank gets the infos. An empty micro-batch still
        runs a forward (and backward) with zero loss, so that the collectives of all ranks stay matched.

        MoE routing replay (``slimecore.routing_replay``): the policy's routers take ``batch["rollout_routed_experts"]``
        outside ``reference_weights``; with ``--use-routing-replay`` alone a ``train=False`` pass there instead routes
        freely and adds ``outputs["routed_experts"]``, each sample's choice in that column's format."""
        ...

    def optimizer_step(self) -> tuple[float, float]:
        """Sum the gradients over data-parallel ranks, clip the global norm to ``--clip-grad`` (when > 0),
        update (skipped, with a warning, when the norm is not finite) and advance the LR schedule
        (``lr_lambda``). Returns ``(grad_norm, lr)``, the LR this update used."""
        ...

    def sum_across_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Each key summed over the data-parallel replicas (a replica lacking a key adds 0)."""
        ...

    def reference_weights(self, column: str = REFERENCE) -> ContextManager[None]:
        """Within the block the model is the reference policy (the initial weights), or for another ``column`` the
        weights of its ``other_weights`` checkpoint; after it, the current weights again. The reference only when
        built with ``keep_reference`` (or when it costs nothing, as LoRA's disabled adapters)."""
        ...

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Every HF-named full weight on CPU, on rank 0 (LoRA merged); other ranks get ``{}``."""
        ...

    def hf_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full weights in buckets of at most ``bucket_bytes`` (a larger tensor alone), each tensor
        once, for ``slimecore.trainers.weight_sender`` on rank 0. When ``collective_export``, every rank must
        iterate it (what ranks other than 0 get is not used)."""
        ...

    def save(self, directory: str) -> None:
        """Write a checkpoint (model, optimizer and LR schedule unless ``--no-save-optim``, each rank's RNG
        state through ``save_rng``) that ``load`` restores. Collective."""
        ...

    def load(self, directory: str) -> None:
        """Restore what ``save`` wrote; the reference policy stays the initial weights. Collective."""
        ...

    def offload(self) -> None:
        """``--offload-train``: parameters, gradients and optimizer state to CPU, the device cache emptied."""
        ...

    def onload(self) -> None:
        """Back onto the training device after ``offload``."""
        ...


# --train-backend NAME -> the module of what the driver asks of that backend before its ranks exist:
# ``check_startup(config, hooks)`` (checks before Ray; returns the model's shape it found, a Megatron bridge, or
# None) and ``data_parallel_rank(config, rank, world_size)`` (the data a rank trains on, when model-parallel ranks
# share it). Imported only for a run on that backend, so these may stand beside its torch code; a backend with no
# entry is checked by its ranks and gives every rank its own data (the fsdp driver imports no torch).
DRIVER_SIDE = {"megatron": "slimecore.trainers.megatron"}


def _driver_side(config):
    module = DRIVER_SIDE.get(config.train_backend)
    return importlib.import_module(module) if module else None


def backend_class(name: str) -> type:
    """The backend class of ``--train-backend name``."""
    if name not in TRAIN_BACKENDS:
        raise ValueError(f"unknown training backend {name!r}; known: {', '.join(TRAIN_BACKENDS)}")
    module, _, attr = TRAIN_BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def data_parallel_ranks(config, world_size: int) -> list[int]:
    """Each train rank's data-parallel rank (``DRIVER_SIDE``): the ranks of one model-parallel group train on the
    same data; without model parallelism every rank is its own."""
    side = _driver_side(config)
    if side is None:
        return list(range(world_size))
    return [side.data_parallel_rank(config, rank, world_size) for rank in range(world_size)]


def check_startup(config, hooks) -> None:
    """Before Ray (``slimecore.startup.prepare``): routing replay's needs (``slimecore.routing_replay``), the run's
    backend's own checks (``DRIVER_SIDE``), then the Megatron arguments given as flags against the checkpoint's
    ``config.json`` (through the shape those checks found, where they found one)."""
    from slimecore.routing_replay import check_config

    check_config(config)
    side = _driver_side(config)
    shape = side.check_startup(config, hooks) if side else None
    if config.megatron_args:
        from transformers import AutoConfig

        from slimecore.trainers.megatron_args import check_against_hf

        check_against_hf(config, AutoConfig.from_pretrained(config.hf_checkpoint), shape)
    check_scoring_weights(config, hooks)


# config.json fields two checkpoints must share for one's weights to load into the other's model
SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_local_experts")


def check_scoring_weights(config, hooks) -> None:
    """The checkpoints of ``slime_scoring_weights`` (each policy role's): readable by the backend and, for an HF
    directory, of the policy's architecture (``SHAPE_FIELDS``); a torch_dist one is checked against the model when
    the megatron backend loads it. Not with ``--use-lora`` (the copy would be of the base weights alone)."""
    from slimecore.config import ConfigError, check_weights_dir
    from slimecore.trainers.roles import declared_roles

    for role in declared_roles(config, hooks):
        if role.model == "value":
            continue
        for column, checkpoint in hooks.slime_scoring_weights(config=config, role=role.name).items():
            what = f"the {column} checkpoint (slime_scoring_weights)"
            if config.use_lora:
                raise ConfigError(f"{what} with --use-lora: other weights are kept for full fine-tuning only; drop "
                                  "--use-lora")
            if not check_weights_dir(config, what, checkpoint):
                continue
            from transformers import AutoConfig

            ours, theirs = (AutoConfig.from_pretrained(c).to_dict() for c in (config.hf_checkpoint, checkpoint))
            differ = [f"{k} {theirs.get(k)} (the policy's {ours.get(k)})" for k in SHAPE_FIELDS
                      if ours.get(k) != theirs.get(k)]
            if differ:
                raise ConfigError(f"{what} {checkpoint} is not of the policy's architecture (--hf-checkpoint "
                                  f"{config.hf_checkpoint}): {', '.join(differ)}")


def training_device() -> torch.device:
    """This process's current CUDA device (the actor set it to its bundle's GPU), else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def add_up(per_rank: Iterable[dict[str, float]]) -> dict[str, float]:
    """Key-wise sums of the ranks' metric dicts (a rank lacking a key adds 0), keys sorted."""
    per_rank = list(per_rank)
    return {k: sum(d.get(k, 0.0) for d in per_rank) for k in sorted({k for d in per_rank for k in d})}


def lr_lambda(config):
    """LR multiplier for optimizer step ``it`` (0-based): linear warm-up, then constant / linear / cosine decay
    to ``--min-lr`` at ``--train-iters`` (constant after warm-up when ``train_iters`` is None).

    Matches Megatron's schedule except that warm-up step ``it`` uses ``(it + 1) / warmup`` rather than
    ``it / warmup``, so the first update is not made with a learning rate of 0.
    """
    warmup, total, lr = config.lr_warmup_iters or 0, config.train_iters, config.lr
    floor = config.min_lr / lr if lr else 0.0

    def factor(it: int) -> float:
        if it < warmup:
            return (it + 1) / warmup
        if config.lr_decay_style == "constant" or not total:
            return 1.0
        progress = min(1.0, (it - warmup) / max(1, total - warmup))
        if config.lr_decay_style == "linear":
            return floor + (1 - floor) * (1 - progress)
        if config.lr_decay_style == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        raise ValueError(f"unknown --lr-decay-style {config.lr_decay_style!r}; use constant, linear or cosine")

    return factor


def save_rng(path: Path, rank: int, **extra) -> None:
    """This rank's torch / python / numpy (and CUDA) RNG state, plus a backend's ``extra`` streams, in
    ``rng_rank{rank}.pt``."""
    import numpy as np
    import torch

    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(), **extra}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, path / f"rng_rank{rank}.pt")


def load_rng(path: Path, rank: int) -> dict:
    """Restore what ``save_rng`` wrote and return it (for a backend's extra streams); ``{}`` when the
    checkpoint has no file for this rank (it was saved with another number of ranks)."""
    import numpy as np
    import torch

    rng_file = path / f"rng_rank{rank}.pt"
    if not rng_file.is_file():
        return {}
    rng = torch.load(rng_file, weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return rng


class ReferenceCopy:
    """A CPU copy of this rank's initial weights (or weight shards), or of another checkpoint's, swapped into the
    live tensors for the reference-policy (or that checkpoint's) forward: the current weights are kept on CPU
    meanwhile and copied back after."""

    def __init__(self, tensors: Iterable[tuple[str, torch.Tensor]]):
        self.saved = {name: t.detach().to("cpu", copy=True) for name, t in tensors}

    @contextlib.contextmanager
    def swapped_in(self, live: Callable[[], Iterable[tuple[str, torch.Tensor]]]):
        """``live()`` yields the tensors to overwrite (called again to restore them)."""
        import torch

        current = {}
        with torch.no_grad():
            for name, t in live():
                current[name] = t.detach().to("cpu", copy=True)
                t.copy_(self.saved[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, t in live():
                    t.copy_(current[name])


    @classmethod
    def of_loaded(cls, live: Callable[[], Iterable[tuple[str, torch.Tensor]]], load: Callable[[], None]):
        """A copy of the weights that ``load()`` puts into the live tensors (a checkpoint read into the model, so
        that each rank keeps its own shards); afterwards the live tensors hold what they held before."""
        import torch

        before = cls(live())
        try:
            load()
            return cls(live())
        finally:
            with torch.no_grad():
                for name, t in live():
                    t.copy_(before.saved[name])


def kept_copy(kept: dict[str, ReferenceCopy], column: str) -> ReferenceCopy:
    """``kept[column]``, or the error saying why the trainer kept no such copy."""
    if column in kept:
        return kept[column]
    if column == REFERENCE:
        raise RuntimeError("ref_log_probs was not requested by slime_train_inputs when the trainer was built, so no "
                           "reference copy exists; train_inputs must not depend on the step")
    raise RuntimeError(f"no weights were kept for column {column!r}: slime_scoring_weights did not name it when the "
                       "trainer was built")
