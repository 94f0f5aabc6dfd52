"""The ``fsdp`` training backend: an HF ``AutoModelForCausalLM`` trained with plain torch.

Parallelism. Every data-parallel rank runs its own micro-batches (``slimecore.trainers.schedule``) and the
gradients are **summed** across ranks: the loss reducer already divides by the step's global rollout (or
token) count, so the sum is the exact gradient of the step objective whatever the micro-batching and DP
split. Two ways to hold the weights:
- replica (CPU default): every rank holds the full model; gradients are all-reduced in flat buckets.
  With world size 1 no process group is needed.
- FSDP2 (``torch.distributed.fsdp.fully_shard``, default on CUDA with world size > 1, or ``shard=True``):
  decoder layers and the root are sharded; FSDP reduce-scatters with a divide factor of 1 (a sum).
  The tests exercise it on CPU with gloo; it has not been run on GPUs here.

Micro-batches are right-padded batches with an attention mask (no sequence packing), so a sample's logits
do not depend on its neighbours beyond kernel rounding (checked to 1e-6 in the tests). Sample i's response
log-probs are logits rows ``[prompt_len - 1, len - 1)`` scoring tokens ``[prompt_len, len)``. Dropout is
switched off at load (as slime's scripts do), so the training forward equals the old-policy forward.

Precision. Weights and optimizer state stay fp32; ``--bf16`` runs the forward in bf16 (autocast, or FSDP2's
``MixedPrecisionPolicy`` with fp32 gradient reduction). Pure-bf16 weights would lose small Adam updates.
Log-prob and entropy math is always fp32 (``slimecore.ops``).

Value model (a role declared with ``model="value"`` through ``slime_train_roles``, as PPO's critic): the
role's ``hf_checkpoint`` backbone with a one-output token-classification head (``AutoModelForTokenClassification``,
``num_labels=1``; the head is initialised from ``--seed``, identically on every rank). ``V`` of response token
``t`` is read at the same position that scores it (row ``prompt_len - 1 + t``), as slime does. The critic
trains on the ``returns`` the actor's advantage hook produced (its feed), with ``slime_loss(role=<its name>)``.

Reference policy (``ref_log_probs``): the initial weights. Full fine-tuning keeps a CPU copy of them (taken
at construction, only when a plugin asks for ``ref_log_probs``) and swaps it into the same model for one
forward; with LoRA it is the same model with the adapters disabled (no copy).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from slimecore.ops.logprobs import log_probs_and_entropy
from slimecore.trainers.flops import forward_flops
from slimecore.ops.reducers import Reducer, make_sample_mean_reducer, make_token_mean_reducer

log = logging.getLogger("slimecore.fsdp")

TENSOR_KEYS = ("loss_masks", "rollout_log_probs", "teacher_log_probs", "values", "returns")  # per-sample lists -> fp32 tensors
BUCKET_ELEMENTS = 1 << 24  # gradient all-reduce bucket (64 MiB of fp32)


def lr_lambda(config, warmup: int | None = None, lr: float | None = None):
    """LR multiplier for optimizer step ``it`` (0-based): linear warm-up, then constant / linear / cosine decay
    to ``--min-lr`` at ``--train-iters`` (constant after warm-up when ``train_iters`` is None).

    Matches Megatron's schedule except that warm-up step ``it`` uses ``(it + 1) / warmup`` rather than
    ``it / warmup``, so the first update is not made with a learning rate of 0.
    """
    warmup = (config.lr_warmup_iters if warmup is None else warmup) or 0
    total, lr = config.train_iters, config.lr if lr is None else lr
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


def _without_dropout(checkpoint: str):
    """The checkpoint's HF config with every dropout probability set to 0.

    RL needs the training forward to equal the old-policy forward: with dropout the ratio is not 1 at the
    old policy, and a sample's loss would depend on its micro-batch. slime's model scripts pass
    ``--attention-dropout 0 --hidden-dropout 0`` for the same reason; HF configs such as GPT-2's default to
    0.1. Attention modules copy the probability from the config when built, hence the config override.
    """
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(checkpoint)
    changed = {}
    for key, value in hf_config.to_dict().items():
        if re.search(r"dropout|pdrop", key) and isinstance(value, float) and value > 0:
            setattr(hf_config, key, 0.0)
            changed[key] = value
    if changed:
        log.info("training without dropout; was %s", changed)
    return hf_config


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class FSDPTrainer:
    """One DP rank of one training role. The caller has initialised torch.distributed when world_size > 1.

    ``hooks`` exposes ``train_inputs``, ``compute_advantages``, ``rollout_data_postprocess`` and ``loss``
    (keyword arguments only), as ``slimecore.plugins.Hooks`` does.
    """

    def __init__(self, config, hooks, rank: int = 0, world_size: int = 1, role: str = "actor",
                 process_group=None, shard: bool | None = None):
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        if world_size > 1 and not dist.is_initialized():
            raise RuntimeError(f"FSDPTrainer(world_size={world_size}) needs torch.distributed initialised first")
        from slimecore.trainers.roles import role_config

        spec, config = role_config(config, hooks, role)  # the role's own options (a critic's --critic-lr) applied
        self.config, self.hooks, self.rank, self.world_size, self.role = config, hooks, rank, world_size, role
        self.group = process_group
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.sharded = (cuda and world_size > 1) if shard is None else (shard and world_size > 1)

        self.is_value = spec.model == "value"
        if self.is_value:
            checkpoint = config.hf_checkpoint
            hf_config = _without_dropout(checkpoint)
            hf_config.num_labels = 1
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # the new head is "missing" from the checkpoint, as intended
            try:
                with torch.random.fork_rng():
                    torch.manual_seed(config.seed)  # the new value head must be the same on every rank
                    model = AutoModelForTokenClassification.from_pretrained(checkpoint, dtype=torch.float32,
                                                                            config=hf_config)
            finally:
                hf_logging.set_verbosity(verbosity)
        else:
            model = AutoModelForCausalLM.from_pretrained(config.hf_checkpoint, dtype=torch.float32,
                                                         config=_without_dropout(config.hf_checkpoint))
        self.hf_config = model.config
        for module in model.modules():  # dropout modules built under names the config sweep missed
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        model.config.use_cache = False
        if config.gradient_checkpointing:
            # non-reentrant: works when the inputs of a checkpointed block need no grad (frozen LoRA base)
            if hasattr(model, "activation_checkpointing_enable"):  # the name in recent transformers 5.x
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if config.use_lora and not self.is_value:  # the critic is always fully fine-tuned
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(
                r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=list(config.lora_target_modules),
                lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
        self.model = model.to(self.device)

        if self.sharded:
            self._shard()
        # Taken before any load(), so the reference is the initial checkpoint; each rank keeps its own shards.
        self._ref_params: dict[str, torch.Tensor] | None = None
        if not self.is_value and not config.use_lora and "ref_log_probs" in set(hooks.train_inputs(config=config, role=role)):
            self._ref_params = {name: _local(p).detach().to("cpu", copy=True)
                                for name, p in self.model.named_parameters()}
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                           eps=config.adam_eps, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        self.outputs: dict = {}  # per-sample results another role needs (the actor's returns, for the critic)

    def _shard(self) -> None:
        """FSDP2: shard every decoder layer, then the root (embeddings, norm, head). Not run on GPUs here."""
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        mesh = (DeviceMesh.from_group(self.group, self.device.type) if self.group is not None
                else init_device_mesh(self.device.type, (self.world_size,)))
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.config.bf16
                  else MixedPrecisionPolicy())
        base = self.model.get_base_model() if self.config.use_lora else self.model
        layer_types = set(getattr(base, "_no_split_modules", None) or ())
        for module in self.model.modules():
            if type(module).__name__ in layer_types:
                fully_shard(module, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # sum, not mean: the reducer already divides
                module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)

    # -- forward -------------------------------------------------------------------------------
    def _autocast(self):
        if self.config.bf16 and not self.sharded:  # FSDP2 casts through its MixedPrecisionPolicy instead
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward(self, tokens: list[list[int]], response_lengths: list[int], temperature: float,
                 with_entropy: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-sample response log-probs (and entropies) of one non-empty micro-batch, each ``(R_i,)``; for the
        value model, the values at the same positions (and None)."""
        longest = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), longest, dtype=torch.long)  # (B, T), right-padded with id 0
        attention = torch.zeros(len(tokens), longest, dtype=torch.long)  # (B, T)
        for i, seq in enumerate(tokens):
            ids[i, :len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            attention[i, :len(seq)] = 1
        # Only positions that predict a response token need the LM head: ask the model for logits there
        # alone (``logits_to_keep`` with positions), which saves the (B, T, V) logits of every prompt.
        rows_b = torch.cat([torch.full((r,), i) for i, r in enumerate(response_lengths)])  # (N,)
        rows_t = torch.cat([torch.arange(len(t) - r - 1, len(t) - 1) for t, r in zip(tokens, response_lengths)])
        split = list(response_lengths)
        if self.is_value:
            with self._autocast():
                out = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device))
            values = out.logits[rows_b.to(self.device), rows_t.to(self.device), 0].float()  # (N,)
            return list(values.split(split)), None
        keep, column = torch.unique(rows_t, return_inverse=True)  # (K,), (N,)
        with self._autocast():
            out = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device),
                             logits_to_keep=keep.to(self.device))
        rows = out.logits[rows_b.to(self.device), column.to(self.device)]  # (N, V)
        targets = ids[rows_b, rows_t + 1].to(self.device)  # (N,)
        log_probs, entropy = log_probs_and_entropy(rows, targets, temperature, with_entropy)
        return list(log_probs.split(split)), (list(entropy.split(split)) if with_entropy else None)

    def _empty_forward(self) -> torch.Tensor:
        """A rank with an empty micro-batch still runs a forward (and backward) of one token with zero
        loss, so FSDP's all-gathers and reduce-scatters stay matched across ranks (slime's
        ``loss += 0 * logits.sum()`` guard)."""
        with self._autocast():
            logits = self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device)).logits
        return 0.0 * logits.float().sum()

    @torch.no_grad()
    def _score(self, data: dict, temperature: float, with_entropy: bool):
        """No-grad log-probs (and entropies) of every local sample, micro-batched as the steps are. CPU fp32."""
        n = len(data["tokens"])
        log_probs: list[torch.Tensor | None] = [None] * n
        entropy: list[torch.Tensor | None] = [None] * n
        self.model.eval()
        for step in data["steps"]:
            for mb in step["micro_batches"]:
                if not mb:
                    self._empty_forward()
                    continue
                lps, ents = self._forward([data["tokens"][i] for i in mb], [data["response_lengths"][i] for i in mb],
                                          temperature, with_entropy)
                for k, i in enumerate(mb):
                    log_probs[i] = lps[k].float().cpu()
                    if with_entropy:
                        entropy[i] = ents[k].float().cpu()
        return log_probs, (entropy if with_entropy else None)

    def compute_log_probs(self, data: dict, temperature: float | None = None) -> list[torch.Tensor]:
        """Current-policy log-probs of every local sample (``(R_i,)`` each, CPU fp32), without gradient."""
        temperature = self.config.rollout_temperature if temperature is None else temperature
        return self._score(data, temperature, with_entropy=False)[0]

    def compute_values(self, data: dict) -> dict:
        """The value model's ``{"values": [(R_i,) ...]}`` for every local sample (CPU fp32, no gradient).
        Kept for the ``train`` call on the same data that follows (the old values of the value loss)."""
        self._old_values = {"values": self._score(data, 1.0, with_entropy=False)[0]}
        return self._old_values

    @contextlib.contextmanager
    def _reference_weights(self):
        """Swap the reference weights in (LoRA: disable the adapters), restore the current ones after."""
        if self.config.use_lora:
            with self.model.disable_adapter():
                yield
            return
        if self._ref_params is None:
            raise RuntimeError("ref_log_probs was not requested by slime_train_inputs when the trainer was built, "
                               "so no reference copy exists; train_inputs must not depend on the step")
        self._reshard()
        current = {}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                shard = _local(p)
                current[name] = shard.detach().to("cpu", copy=True)
                shard.copy_(self._ref_params[name])
        try:
            yield
        finally:
            self._reshard()
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    _local(p).copy_(current[name])

    def _reshard(self) -> None:
        """FSDP2 leaves the root's parameters gathered after a forward; shard them back so that
        ``named_parameters`` yields this rank's shards."""
        if self.sharded:
            from torch.distributed.fsdp import FSDPModule

            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    # -- one rollout's training ----------------------------------------------------------------------
    def train(self, rollout_id: int, data: dict, update: bool = True) -> dict[str, float]:
        """Pre-compute the requested inputs, call the advantage and post-process hooks, then run one optimizer
        step per ``data["steps"]`` entry (none when ``update`` is False: advantages and returns only).
        ``data`` may carry another role's per-sample results: ``values`` (from the critic) for the actor,
        ``returns`` (from the actor) for the critic, which then skips the advantage hook.
        Returns ``train/*`` metrics (summed over ranks, mean over steps)."""
        config, role = self.config, self.role
        inputs = set(self.hooks.train_inputs(config=config, role=role))
        if self.is_value:  # the old values of the clipped value loss: those just sent to the actor, if any
            old, self._old_values = getattr(self, "_old_values", None), None
            data = {**data, **(old if old is not None else self.compute_values(data))}
        elif "values" in inputs and data.get("values") is None:
            raise RuntimeError(f"slime_train_inputs asked for 'values' (role {role!r}) but no value model fed them; "
                               f"the plugin that needs values must declare a value role whose scores feed {role!r} "
                               "(slime_train_roles)")
        temperature = config.rollout_temperature
        batch = {k: v for k, v in data.items() if k != "steps"}
        for key in TENSOR_KEYS:
            if batch.get(key) is not None:
                batch[key] = [torch.as_tensor(v, dtype=torch.float32) for v in batch[key]]

        metrics: dict[str, float] = {}
        start = time.perf_counter()
        if "log_probs" in inputs or "entropy" in inputs:
            log_probs, entropy = self._score(data, temperature, with_entropy="entropy" in inputs)
            if "log_probs" in inputs:
                batch["log_probs"] = log_probs
            if entropy is not None:
                batch["entropy"] = entropy
        if "ref_log_probs" in inputs:
            with self._reference_weights():
                batch["ref_log_probs"] = self._score(data, temperature, with_entropy=False)[0]
        if inputs & {"log_probs", "entropy", "ref_log_probs"}:
            metrics["perf/log_probs_time"] = time.perf_counter() - start
        # The engine/trainer log-prob mismatch is measured on the pre-update policy: on the recomputed
        # log-probs when a plugin asked for them, otherwise on the first optimizer step's own forward
        # (before that step the model is exactly the policy that generated the rollout).
        measure_in_first_step = (not self.is_value and batch.get("rollout_log_probs") is not None
                                 and "log_probs" not in batch)
        if "log_probs" in batch and batch.get("rollout_log_probs") is not None and data["steps"]:
            metrics["train/train_rollout_logprob_abs_diff"] = self._logprob_abs_diff(batch, data["steps"][0])

        if batch.get("returns") is None:
            batch.update(self.hooks.compute_advantages(config=config, role=role, batch=batch))
        self.hooks.rollout_data_postprocess(config=config, rollout_id=rollout_id, batch=batch)
        self.outputs = {"returns": [r.detach().float().cpu() for r in batch["returns"]]}

        self.model.train()
        steps = data["steps"] if update else []
        start = time.perf_counter()
        per_step = [self._optimizer_step(batch, step, measure_mismatch=measure_in_first_step and n == 0)
                    for n, step in enumerate(steps)]
        for key in {k for m in per_step for k in m}:
            values = [m[key] for m in per_step if key in m]
            metrics[key] = sum(values) / len(values)
        if steps:
            metrics.update(self._throughput(batch, steps, time.perf_counter() - start))
        return metrics

    def _throughput(self, batch: dict, steps: list[dict], seconds: float) -> dict[str, float]:
        """Trained tokens per second (all ranks) and model TFLOP/s per rank (``slimecore.trainers.flops``: forward
        + backward = 3 forwards; the recompute of activation checkpointing is not useful work, so not counted)."""
        local = [i for step in steps for mb in step["micro_batches"] for i in mb]
        lengths = [len(batch["tokens"][i]) for i in local]
        scored = sum(batch["response_lengths"][i] for i in local)
        flops = 3 * forward_flops(self.hf_config, lengths, head_tokens=scored, head_size=1 if self.is_value else None)
        total = self._sum_across_ranks({"tokens": float(sum(lengths)), "flops": flops})
        return {f"perf/{self.role}_train_tok_per_s": total["tokens"] / seconds,
                f"perf/{self.role}_train_tflops": total["flops"] / seconds / self.world_size / 1e12}

    def _micro_batch(self, batch: dict, mb: list[int]) -> dict:
        """Rows ``mb`` of every per-sample list (tensors moved to the device); other values as they are."""
        n = len(batch["tokens"])
        out = {}
        for key, value in batch.items():
            if isinstance(value, list) and len(value) == n:
                out[key] = [value[i].to(self.device) if isinstance(value[i], torch.Tensor) else value[i] for i in mb]
            else:
                out[key] = value
        return out

    def _reducer(self, mb_batch: dict, step: dict) -> Reducer:
        masks = mb_batch["loss_masks"]
        if self.config.calculate_per_token_loss:
            return make_token_mean_reducer(masks, step["num_tokens"])
        return make_sample_mean_reducer(masks, mb_batch["rollout_mask_sums"], step["num_rollouts"])

    def _logprob_abs_diff(self, batch: dict, step: dict) -> float:
        """``|old log-prob - rollout log-prob|`` reduced like the loss over the first step's samples."""
        local = [i for mb in step["micro_batches"] for i in mb]
        mb_batch = self._micro_batch(batch, local)
        diffs = [(lp - roll).abs() for lp, roll in zip(mb_batch["log_probs"], mb_batch["rollout_log_probs"])]
        share = self._reducer(mb_batch, step)(diffs).detach().float().cpu()
        return self._sum_across_ranks({"d": float(share)})["d"]

    def _optimizer_step(self, batch: dict, step: dict, measure_mismatch: bool = False) -> dict[str, float]:
        config = self.config
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        micro_batches = step["micro_batches"]
        for k, mb in enumerate(micro_batches):
            if self.sharded:  # reduce-scatter once, after the last micro-batch
                self.model.set_requires_gradient_sync(k == len(micro_batches) - 1)
            if not mb:
                self._empty_forward().backward()
                continue
            mb_batch = self._micro_batch(batch, mb)
            log_probs, entropy = self._forward(mb_batch["tokens"], mb_batch["response_lengths"],
                                               config.rollout_temperature, with_entropy=not self.is_value)
            outputs = {"values": log_probs} if self.is_value else {"log_probs": log_probs, "entropy": entropy}
            loss, mb_metrics = self.hooks.loss(config=config, role=self.role, batch=mb_batch, outputs=outputs,
                                               reducer=self._reducer(mb_batch, step))
            loss.backward()
            if measure_mismatch:
                reducer = self._reducer(mb_batch, step)
                diffs = [(lp.detach() - roll).abs() for lp, roll in zip(log_probs, mb_batch["rollout_log_probs"])]
                mb_metrics = {**mb_metrics, "train_rollout_logprob_abs_diff": reducer(diffs)}
            for key, value in {"loss": loss.detach(), **mb_metrics}.items():
                sums[key] = sums.get(key, 0.0) + float(value)

        self._all_reduce_grads()
        grad_norm = self._clip_grad()
        lr = self.optimizer.param_groups[0]["lr"]
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:  # an update with NaN/inf gradients would corrupt the weights for good
            log.warning("gradient norm is %s; skipping this optimizer step", grad_norm)
        self.scheduler.step()
        metrics = {f"train/{k}": v for k, v in self._sum_across_ranks(sums).items()}
        metrics.update({"train/grad_norm": grad_norm, "train/lr": lr})
        return metrics

    # -- collectives ---------------------------------------------------------------------------------
    def _all_reduce_grads(self) -> None:
        """Replica mode: sum gradients over the DP ranks in flat buckets (FSDP2 already reduce-scattered)."""
        for p in self.params:
            if p.grad is None:  # a parameter no micro-batch touched still takes part in the sum
                p.grad = torch.zeros_like(p)
        if self.world_size == 1 or self.sharded:
            return
        bucket: list[torch.Tensor] = []
        for i, p in enumerate(self.params):
            bucket.append(p.grad)
            if sum(g.numel() for g in bucket) >= BUCKET_ELEMENTS or i == len(self.params) - 1:
                flat = torch.cat([g.reshape(-1) for g in bucket])
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
                for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                    g.copy_(part.view_as(g))
                bucket = []

    def _clip_grad(self) -> float:
        """Global gradient norm (all ranks; grads are already reduced), clipped to ``--clip-grad`` if > 0."""
        if self.config.clip_grad > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.clip_grad)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params])
        return float(_full(norm))

    def _sum_across_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Sum each key over the ranks; a rank that lacks a key (only empty micro-batches) adds 0."""
        if self.world_size == 1:
            return dict(values)
        gathered: list[dict | None] = [None] * self.world_size
        dist.all_gather_object(gathered, values, group=self.group)
        return {k: sum(g.get(k, 0.0) for g in gathered) for k in sorted({k for g in gathered for k in g})}

    # -- weights and checkpoints ----------------------------------------------------------------------
    def _state_dict(self) -> dict[str, torch.Tensor]:
        """Full model state on CPU under the model's own names. Collective when sharded (rank 0 gets it)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.model.state_dict().items()}

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF-named full weights on CPU for the engines, LoRA merged (``W + scaling * B @ A``, computed out of
        place so the trained base weights never drift through merge/unmerge). Collective when sharded:
        every rank must call it; only rank 0 gets the weights (the others an empty dict)."""
        state = self._state_dict()
        if not self.config.use_lora or not state:
            return state
        from peft.tuners.lora import LoraLayer

        adapter = self.model.active_adapter
        scaling = {name: module.scaling[adapter] for name, module in self.model.named_modules()
                   if isinstance(module, LoraLayer)}
        merged = {}
        for key, value in state.items():
            if ".lora_" in key:
                continue
            if key.endswith(".base_layer.weight"):
                module = key[: -len(".base_layer.weight")]
                a, b = state[f"{module}.lora_A.{adapter}.weight"], state[f"{module}.lora_B.{adapter}.weight"]
                value = (value.float() + (b.float() @ a.float()) * scaling[module]).to(value.dtype)  # (out, in)
            merged[key.replace(".base_layer.", ".").removeprefix("base_model.model.")] = value
        return merged

    # -- colocate offload (--offload-train) -------------------------------------------------------------
    def offload(self) -> None:
        """Parameters, gradients and optimizer state to CPU, the device's cache emptied (a no-op on CPU)."""
        self._move_to(torch.device("cpu"))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Back onto the training device."""
        self._move_to(self.device)

    def _move_to(self, device: torch.device) -> None:
        self.model.to(device)  # moves each parameter's .grad with it
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)

    def hf_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Rank 0's HF-named weights in buckets of at most ``bucket_bytes``, for the engines. Unsharded and
        without LoRA they are the live tensors on the training device (no copy: the sender copies each
        bucket once into its transfer buffer); otherwise ``named_weights()``, which is collective when
        sharded, so every rank must iterate this (ranks other than 0 get no buckets)."""
        from slimecore.engines.weight_sync import bucketize, unique_tensors

        if self.sharded or self.config.use_lora:
            named = self.named_weights().items()
        else:
            named = ((k, v.detach()) for k, v in self.model.state_dict().items())
        if self.rank == 0:
            yield from bucketize(unique_tensors(named), bucket_bytes)

    def save(self, directory: str) -> None:
        """Write ``directory``: the model via ``save_pretrained`` (HF safetensors; the adapter only with LoRA),
        ``optimizer.pt`` (optimizer + LR scheduler; one ``optimizer_rank{r}.pt`` per rank when sharded) unless
        ``--no-save-optim``, and ``rng_rank{r}.pt`` (torch / python / numpy RNG) per rank."""
        path = Path(directory)
        self.save_pretrained(path)
        if not self.config.no_save_optim and (self.sharded or self.rank == 0):
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                       path / self._optimizer_file())
        self._save_rng(path)

    def save_pretrained(self, path: Path) -> None:
        """The model via ``save_pretrained``: the whole model, or with LoRA the adapter only (peft's layout).
        Collective when sharded; rank 0 writes."""
        path.mkdir(parents=True, exist_ok=True)
        state = self._state_dict() if self.sharded else None  # gathering shards is a collective
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=state, safe_serialization=True)

    def _rng_state(self) -> dict:
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return rng

    def _set_rng_state(self, rng: dict) -> None:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])

    def _save_rng(self, path: Path) -> None:
        torch.save(self._rng_state(), path / f"rng_rank{self.rank}.pt")

    def _load_rng(self, path: Path) -> None:
        """This rank's RNG from ``rng_rank{r}.pt`` when the checkpoint has one (another DP size may not)."""
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            self._set_rng_state(torch.load(rng_file, weights_only=False))

    def _optimizer_file(self) -> str:
        # replica ranks hold identical optimizer state, so one file serves all; FSDP2 shards it per rank
        return f"optimizer_rank{self.rank}.pt" if self.sharded else "optimizer.pt"

    def load(self, directory: str) -> None:
        """Restore what ``save`` wrote. The reference policy stays the initial checkpoint."""
        from safetensors.torch import load_file

        path = Path(directory)
        files = sorted(path.glob("adapter_model.safetensors" if self.config.use_lora else "model*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} holds no {'adapter_model' if self.config.use_lora else 'model'}"
                                    "*.safetensors; point --load at a directory written by --save")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        if self.config.use_lora:  # peft saves adapter keys without the adapter name
            adapter = self.model.active_adapter
            state = {re.sub(r"\.(lora_[AB])\.weight$", rf".\1.{adapter}.weight", k): v for k, v in state.items()}
        self._load_state(state, str(path))

        opt_file = path / self._optimizer_file()
        if opt_file.is_file():
            saved = torch.load(opt_file, weights_only=False)
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
        elif not self.config.no_save_optim:
            raise FileNotFoundError(f"{opt_file} is missing; the checkpoint was saved with --no-save-optim? "
                                    "Pass --no-save-optim to resume with a fresh optimizer")
        self._load_rng(path)

    def _load_state(self, state: dict[str, torch.Tensor], where: str) -> None:
        trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        known = set(self.model.state_dict())
        unexpected = sorted(set(state) - known)
        missing = sorted(trainable - set(state))
        if unexpected or missing:
            raise ValueError(f"checkpoint {where} does not match the model: missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]} (was it saved with the same --hf-checkpoint and --use-lora?)")
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        else:
            self.model.load_state_dict(state, strict=False)
