"""The ``fsdp`` training backend: an HF ``AutoModelForCausalLM`` trained with plain torch
(``slimecore.trainers.backend.TrainBackend``; the step around it is ``slimecore.trainers.trainer``).

Parallelism. Every data-parallel rank runs its own micro-batches (``slimecore.rollout.schedule``) and the
gradients are **summed** across ranks: the loss reducer already divides by the step's global rollout (or
token) count, so the sum is the exact gradient of the step objective whatever the micro-batching and DP
split. Two ways to hold the weights:
- replica (CPU default): every rank holds the full model; gradients are all-reduced in flat buckets.
  With world size 1 no process group is needed.
- FSDP2 (``torch.distributed.fsdp.fully_shard``, default on CUDA with world size > 1, or ``shard=True``):
  decoder layers and the root are sharded; FSDP reduce-scatters with a divide factor of 1 (a sum).
  The tests exercise it on CPU with gloo; it has not been run on GPUs here.

Forward. On CUDA a micro-batch is one packed stream without padding (``_forward_packed``: the samples
concatenated, ``position_ids`` restarting per sample, attention kept inside each sample by transformers'
packed-sequence mask; for ``PLAIN_HEAD_MODEL_TYPES``). On the CPU its samples run in chunks of similar length
(``forward_chunks``: length-sorted, split to minimise padded tokens plus a cost per forward, ``forward_cost_tokens``, larger for a small model), each
right-padded to its own longest sample with an attention mask (none when no row is padded; no sequence
packing), so a sample's logits do not depend on its neighbours beyond kernel rounding (checked to 1e-6 in the
tests). The loss still sees the whole micro-batch, in its order; FSDP2 runs one chunk, so that every rank runs
the same forwards. Sample i's response log-probs are logits rows ``[prompt_len - 1, len - 1)`` scoring tokens
``[prompt_len, len)``. Dropout is switched off at load (as slime's scripts do), so the training forward equals
the old-policy forward.

LM head. On CUDA the decoder's hidden states of the response positions go through the head, log-softmax,
log-prob and entropy in chunks of ``CHUNK_TOKENS`` positions, the chunk's logits recomputed in backward
(``slimecore.ops.linear_logprobs``): the fp32 logits of every response token (tokens x vocabulary x 4 bytes,
10 GB for 16k tokens of Qwen2.5) never exist at once. Only for the plain-head architectures
(``PLAIN_HEAD_MODEL_TYPES``), unsharded, without a LoRA head. On the CPU the model's own head runs on the kept
positions (``logits_to_keep``): the recompute would cost time there, and memory is not what limits it.

Precision. Weights and optimizer state stay fp32; ``--bf16`` runs the forward in bf16 (autocast, or FSDP2's
``MixedPrecisionPolicy`` with fp32 gradient reduction). Pure-bf16 weights would lose small Adam updates.
Log-prob and entropy math is always fp32 (``slimecore.ops``).

Value model (a role declared with ``model="value"`` through ``slime_train_roles``, as PPO's critic): the
role's ``hf_checkpoint`` backbone with a one-output token-classification head (``AutoModelForTokenClassification``,
``num_labels=1``; the head is initialised from ``--seed``, identically on every rank). ``V`` of response token
``t`` is read at the same position that scores it (row ``prompt_len - 1 + t``), as slime does.

Reference policy (``ref_log_probs``): the initial weights. Full fine-tuning keeps a CPU copy of them (taken
at construction, only when a plugin asks for ``ref_log_probs``) and swaps it into the same model for one
forward; with LoRA it is the same model with the adapters disabled (no copy). Other weights a plugin scores with
(``slime_scoring_weights``, an OPD teacher): one more CPU copy each, read from its HF directory as ``--ref-load`` is,
swapped in the same way.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from slimecore.ops.linear_logprobs import CHUNK_TOKENS, linear_log_probs_and_entropy
from slimecore.ops.logprobs import log_probs_and_entropy
from slimecore.routers import RouterReplay
from slimecore.routing_replay import NO_ROUTING_COLUMN, records, replays
from slimecore.trainers.backend import (REFERENCE, MicroBatchFn, ReferenceCopy, add_up, kept_copy, load_rng, lr_lambda,
                                        save_rng, training_device)

log = logging.getLogger("slimecore.fsdp")

BUCKET_ELEMENTS = 1 << 24  # gradient all-reduce bucket (64 MiB of fp32)
FORWARD_COST_TOKENS = 64  # what one more forward (and its backward) costs, in padded tokens (see forward_chunks)
# ... at least: a forward and backward also cost ~2 ms of Python and dispatch whatever the model, which on a small
# model is worth many tokens (a token costs ~6 x parameters FLOPs; ~1.6e11 FLOP/s measured on two CPU cores; the
# CUDA figure is an assumed order of magnitude for a recent GPU, not measured here)
FORWARD_OVERHEAD_S, DEVICE_FLOPS = 2e-3, {"cpu": 1.6e11, "cuda": 2e14}
# Causal LMs whose forward is ``lm_head(decoder(...).last_hidden_state)`` with nothing after the head (no logit
# scaling or soft-capping): their response log-probs can take the chunked head (``ops.linear_logprobs``); their
# masks come from transformers' create_causal_mask, which keeps packed samples apart by their position_ids.
PLAIN_HEAD_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}


def forward_cost_tokens(num_params: int, device: str) -> int:
    """``forward_chunks``' cost of one more forward for a model of ``num_params`` parameters on ``device``."""
    per_token_s = 6 * num_params / DEVICE_FLOPS.get(device, DEVICE_FLOPS["cpu"])
    return max(FORWARD_COST_TOKENS, round(FORWARD_OVERHEAD_S / per_token_s))


def forward_chunks(lengths: list[int], forward_cost: int = FORWARD_COST_TOKENS) -> list[list[int]]:
    """Indices of the samples of lengths ``lengths`` in chunks to forward one after the other, each chunk
    padded to its longest sample: the split of the length-sorted samples that minimises the padded tokens
    plus ``forward_cost`` per chunk (a dynamic program over the sorted order, O(n^2))."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    cost = [0.0] + [math.inf] * len(order)  # cost[j]: the best split of the j shortest samples
    start = [0] * (len(order) + 1)  # start[j]: where that split's last chunk starts
    for j in range(1, len(order) + 1):
        for i in range(j):
            c = cost[i] + (j - i) * lengths[order[j - 1]] + forward_cost
            if c < cost[j]:
                cost[j], start[j] = c, i
    chunks, j = [], len(order)
    while j:
        chunks.append(order[start[j]:j])
        j = start[j]
    return chunks[::-1]


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


def _per_sample(log_probs: torch.Tensor, entropy: torch.Tensor | None, sizes: list[int]) -> dict:
    """A micro-batch's outputs: its (N,) log-probs and entropies split into the samples' (R_i,) pieces."""
    return {"log_probs": list(log_probs.split(sizes)),
            "entropy": list(entropy.split(sizes)) if entropy is not None else None}


class FSDPBackend:
    """The fsdp ``TrainBackend`` of one rank (see ``slimecore.trainers.backend``). ``process_group``: the
    group to shard or all-reduce over (default: the world); ``shard``: FSDP2 (default: on CUDA with more
    than one rank); ``device``: where to train (default: ``training_device()``, the current GPU or the CPU)."""

    def __init__(self, config, hooks=None, *, rank: int = 0, world_size: int = 1, value_model: bool = False,
                 keep_reference: bool = False, other_weights: dict[str, str] | None = None, process_group=None,
                 shard: bool | None = None, device: str | torch.device | None = None):
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        if world_size > 1 and not dist.is_initialized():
            raise RuntimeError(f"FSDPBackend(world_size={world_size}) needs torch.distributed initialised first")
        self.config, self.rank, self.world_size = config, rank, world_size
        self.group = process_group
        self.device = torch.device(device) if device is not None else training_device()
        self.sharded = (self.device.type == "cuda" and world_size > 1) if shard is None else (shard and world_size > 1)
        self.collective_export = self.sharded

        self.is_value = value_model
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
        # routing replay: the policy's MoE routers route each token to the rollout's experts (R3) or to those the
        # old-policy log-prob pass recorded (R2: self.records)
        self.router_replay = RouterReplay(self.model) if replays(config) and not self.is_value else None
        self.records = self.router_replay is not None and records(config)

        self.shared_files: list[str] = []  # /dev/shm files the driver unlinks when the run ends
        if self.sharded:
            self._shard()
        elif self._pushes_from_shared_memory():
            from slimecore.engines.weight_sync import share_weights, shared_file

            share_weights(self.model)
            self.shared_files.append(shared_file(next(iter(self.model.state_dict().values()))))
        if config.ref_load and not self.is_value:  # slime's --ref-load: the reference, and the start unless --load
            self._load_hf(config.ref_load, f"--ref-load {config.ref_load}")
        # Taken before any load(), so the reference is the initial checkpoint; each rank keeps its own shards.
        self._kept: dict[str, ReferenceCopy] = {}  # column -> the weights it is scored under (reference_weights)
        if keep_reference and not config.use_lora:  # LoRA's reference is the model with its adapters disabled
            self._kept[REFERENCE] = ReferenceCopy((name, _local(p)) for name, p in self.model.named_parameters())
        for column, checkpoint in (other_weights or {}).items():  # read as --ref-load is, then the start put back
            self._kept[column] = ReferenceCopy.of_loaded(self._live_weights, functools.partial(
                self._load_hf, checkpoint, f"the {column} checkpoint {checkpoint}"))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # response rows per chunk of the fused head (0: the model's own head; see the module docstring)
        self.head_chunk = CHUNK_TOKENS if self.device.type == "cuda" else 0
        # a micro-batch as one packed stream (CUDA) or in length-sorted padded chunks (the CPU, where measured faster)
        self.packed = self.device.type == "cuda" and self.hf_config.model_type in PLAIN_HEAD_MODEL_TYPES
        self.forward_cost = forward_cost_tokens(sum(p.numel() for p in self.model.parameters()), self.device.type)
        # torch's fused AdamW kernel (fp32 parameters, plain or DTensor shards, on CPU or CUDA: the training
        # devices): one pass over each tensor instead of the default's chain of elementwise ops
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                           eps=config.adam_eps, weight_decay=config.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))

    def _pushes_from_shared_memory(self) -> bool:
        """Rank 0 of the policy on CPU, whose full weights go to the engines as they are (no LoRA merge): it
        keeps them in shared memory, so a ``tensor`` push sends them without copying (``weight_sync.share_weights``)."""
        c = self.config
        return (self.device.type == "cpu" and self.rank == 0 and not self.is_value and not c.use_lora
                and c.starts_engines and c.update_weight_transport in ("auto", "tensor"))

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
                 with_entropy: bool) -> dict:
        """Per-sample response log-probs (and entropies) of one non-empty micro-batch, each ``(R_i,)``; for the
        value model, the values at the same positions, in the micro-batch's order (forwarded in chunks: see
        the module docstring)."""
        if self.packed:
            return self._forward_packed(tokens, response_lengths, temperature, with_entropy)
        # one forward for the whole micro-batch when sharded (every rank runs the same forwards) or when replaying
        # routing (the routers hold one micro-batch's experts until its backward, which may recompute layers)
        chunks = ([list(range(len(tokens)))] if self.sharded or self.router_replay
                  else forward_chunks([len(t) for t in tokens], self.forward_cost))
        outputs: dict[str, list | None] = {}
        for chunk in chunks:
            part = self._forward_padded([tokens[i] for i in chunk], [response_lengths[i] for i in chunk],
                                        temperature, with_entropy)
            for key, values in part.items():
                merged = outputs.setdefault(key, None if values is None else [None] * len(tokens))
                for i, value in zip(chunk, values or ()):
                    merged[i] = value
        return outputs

    def _forward_packed(self, tokens: list[list[int]], response_lengths: list[int], temperature: float,
                        with_entropy: bool) -> dict:
        """``_forward`` of the micro-batch as one stream (1, T) without padding: ``position_ids`` restart at 0 per
        sample and no attention mask is passed, from which transformers' mask builder makes each sample attend to
        itself only (its packed-sequence detection)."""
        ids = torch.tensor([[tok for seq in tokens for tok in seq]], device=self.device)  # (1, T)
        positions = torch.cat([torch.arange(len(seq)) for seq in tokens])[None].to(self.device)  # (1, T)
        rows, start = [], 0
        for seq, r in zip(tokens, response_lengths):
            rows.append(torch.arange(start + len(seq) - r - 1, start + len(seq) - 1))
            start += len(seq)
        rows_t = torch.cat(rows).to(self.device)  # (N,) stream rows that score the response tokens
        split = list(response_lengths)
        if self.is_value:
            with self._autocast():
                out = self.model(input_ids=ids, position_ids=positions, use_cache=False)
            return {"values": list(out.logits[0, rows_t, 0].float().split(split))}
        targets = ids[0, rows_t + 1]  # (N,)
        head = self._plain_head() if self.head_chunk else None
        with self._autocast():
            if head is not None:
                decoder, lm_head = head
                hidden = decoder(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
                log_probs, entropy = linear_log_probs_and_entropy(hidden[0, rows_t], lm_head.weight, targets,
                                                                  temperature, with_entropy, bias=lm_head.bias,
                                                                  chunk_size=self.head_chunk)
            else:
                keep, column = torch.unique(rows_t, return_inverse=True)
                out = self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep)
                log_probs, entropy = log_probs_and_entropy(out.logits[0, column], targets, temperature, with_entropy)
        return _per_sample(log_probs, entropy, split)

    def _forward_padded(self, tokens: list[list[int]], response_lengths: list[int], temperature: float,
                        with_entropy: bool) -> dict:
        """``_forward`` of samples right-padded to the longest one (no attention mask when none is padded)."""
        longest = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), longest, dtype=torch.long)  # (B, T), right-padded with id 0
        attention = torch.zeros(len(tokens), longest, dtype=torch.long)  # (B, T)
        for i, seq in enumerate(tokens):
            ids[i, :len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            attention[i, :len(seq)] = 1
        mask = None if all(len(t) == longest for t in tokens) else attention.to(self.device)
        # Only positions that predict a response token need the LM head: ask the model for logits there
        # alone (``logits_to_keep`` with positions), which saves the (B, T, V) logits of every prompt.
        rows_b = torch.cat([torch.full((r,), i) for i, r in enumerate(response_lengths)])  # (N,)
        rows_t = torch.cat([torch.arange(len(t) - r - 1, len(t) - 1) for t, r in zip(tokens, response_lengths)])
        split = list(response_lengths)
        if self.is_value:
            with self._autocast():
                out = self.model(input_ids=ids.to(self.device), attention_mask=mask)
            values = out.logits[rows_b.to(self.device), rows_t.to(self.device), 0].float()  # (N,)
            return {"values": list(values.split(split))}
        targets = ids[rows_b, rows_t + 1].to(self.device)  # (N,)
        head = self._plain_head() if self.head_chunk else None
        if head is not None:
            decoder, lm_head = head
            with self._autocast():
                hidden = decoder(input_ids=ids.to(self.device), attention_mask=mask).last_hidden_state  # (B, T, H)
                log_probs, entropy = linear_log_probs_and_entropy(
                    hidden[rows_b.to(self.device), rows_t.to(self.device)], lm_head.weight, targets, temperature,
                    with_entropy, bias=lm_head.bias, chunk_size=self.head_chunk)
            return _per_sample(log_probs, entropy, split)
        keep, column = torch.unique(rows_t, return_inverse=True)  # (K,), (N,)
        with self._autocast():
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask, logits_to_keep=keep.to(self.device))
        rows = out.logits[rows_b.to(self.device), column.to(self.device)]  # (N, V)
        log_probs, entropy = log_probs_and_entropy(rows, targets, temperature, with_entropy)
        return _per_sample(log_probs, entropy, split)

    def _plain_head(self) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
        """The decoder and the ``nn.Linear`` head of a plain-head causal LM, unsharded (FSDP2 gathers the root's
        parameters in the root's forward, which this would bypass); None otherwise."""
        base = self.model.get_base_model() if self.config.use_lora else self.model
        if self.sharded or getattr(base.config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
            return None
        head = base.get_output_embeddings()
        return (base.get_decoder(), head) if type(head) is torch.nn.Linear else None

    def _empty_forward(self) -> torch.Tensor:
        """A rank with an empty micro-batch still runs a forward (and backward) of one token with zero
        loss, so FSDP's all-gathers and reduce-scatters stay matched across ranks (slime's
        ``loss += 0 * logits.sum()`` guard)."""
        with self._autocast():
            logits = self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device)).logits
        return 0.0 * logits.float().sum()

    def run_micro_batches(self, batch: dict, micro_batches: list[list[int]], fn: MicroBatchFn, *,
                          temperature: float, with_entropy: bool, train: bool) -> list:
        self.model.train(train)
        if train:
            self.optimizer.zero_grad(set_to_none=True)
        infos = []
        # R2: a no-grad pass of the policy (not the reference's) records its routing, which training replays
        record = not train and self.records and not self.router_replay.own
        with contextlib.nullcontext() if train else torch.no_grad():
            for k, mb in enumerate(micro_batches):
                if train and self.sharded:  # reduce-scatter once, after the last micro-batch
                    self.model.set_requires_gradient_sync(k == len(micro_batches) - 1)
                if not mb:
                    zero = self._empty_forward()
                    if train:
                        zero.backward()
                    continue
                with contextlib.nullcontext() if record else self._routing(batch, mb):
                    outputs = self._forward([batch["tokens"][i] for i in mb],
                                            [batch["response_lengths"][i] for i in mb], temperature, with_entropy)
                    if record:
                        lengths = [len(batch["tokens"][i]) for i in mb]
                        outputs["routed_experts"] = self.router_replay.recorded(
                            lengths, None if self.packed else max(lengths))
                    loss, info = fn(mb, outputs)
                    if train:
                        loss.backward()
                infos.append(info)
        return infos

    def _routing(self, batch: dict, mb: list[int]):
        """With routing replay, a block in which the MoE routers take the batch's experts (the rollout's, or R2's
        record) for micro-batch ``mb`` (laid out as ``_forward`` runs it: one stream, or one chunk right-padded to its
        longest sample)."""
        if self.router_replay is None:
            return contextlib.nullcontext()
        if batch.get("rollout_routed_experts") is None:
            raise ValueError(NO_ROUTING_COLUMN)
        lengths = [len(batch["tokens"][i]) for i in mb]
        return self.router_replay.replaying(self.router_replay.rows(
            [batch["rollout_routed_experts"][i] for i in mb], lengths, None if self.packed else max(lengths)))

    @contextlib.contextmanager
    def reference_weights(self, column: str = REFERENCE):
        """Swap the reference weights in (LoRA: disable the adapters), or ``column``'s (``other_weights``), restore
        the current ones after. Their MoE routers choose their own experts (no routing replay), as slime's
        reference does."""
        with self.router_replay.own_choice() if self.router_replay else contextlib.nullcontext():
            if self.config.use_lora and column == REFERENCE:
                with self.model.disable_adapter():
                    yield
                return
            with kept_copy(self._kept, column).swapped_in(self._live_weights):
                yield

    def _live_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's parameter tensors (its shards when sharded)."""
        self._reshard()
        return ((name, _local(p)) for name, p in self.model.named_parameters())

    def _reshard(self) -> None:
        """FSDP2 leaves the root's parameters gathered after a forward; shard them back so that
        ``named_parameters`` yields this rank's shards."""
        if self.sharded:
            from torch.distributed.fsdp import FSDPModule

            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def optimizer_step(self) -> tuple[float, float]:
        self._all_reduce_grads()
        grad_norm = self._clip_grad()
        lr = self.optimizer.param_groups[0]["lr"]
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:  # an update with NaN/inf gradients would corrupt the weights for good
            log.warning("gradient norm is %s; skipping this optimizer step", grad_norm)
        self.scheduler.step()
        return grad_norm, lr

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

    def sum_across_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Sum each key over the ranks; a rank that lacks a key (only empty micro-batches) adds 0."""
        if self.world_size == 1:
            return dict(values)
        gathered: list[dict | None] = [None] * self.world_size
        dist.all_gather_object(gathered, values, group=self.group)
        return add_up(gathered)

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
        """Parameters, their gradients and every optimizer state tensor to ``device``: the fused AdamW keeps
        its ``step`` counters on the parameters' device too (and checks that they are there), so they move."""
        self.model.to(device)  # moves each parameter's .grad with it
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
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
        save_rng(path, self.rank)

    def save_pretrained(self, path: Path) -> None:
        """The model via ``save_pretrained``: the whole model, or with LoRA the adapter only (peft's layout).
        Collective when sharded; rank 0 writes."""
        path.mkdir(parents=True, exist_ok=True)
        state = self._state_dict() if self.sharded else None  # gathering shards is a collective
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=state, safe_serialization=True)

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
            for group in saved["optimizer"]["param_groups"]:  # a checkpoint from before the fused kernel resumes
                group["fused"] = True  # with it: set before loading, so that torch puts its "step" on the device
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
        elif not self.config.no_save_optim:
            raise FileNotFoundError(f"{opt_file} is missing; the checkpoint was saved with --no-save-optim? "
                                    "Pass --no-save-optim to resume with a fresh optimizer")
        load_rng(path, self.rank)

    def _load_hf(self, checkpoint: str, where: str) -> None:
        """An HF directory's weights into the model (``--ref-load``, ``other_weights``)."""
        from transformers import AutoModelForCausalLM

        self._load_state(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict(), where)

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
