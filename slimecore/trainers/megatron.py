"""The ``megatron`` training backend (``--train-backend megatron``): megatron-core trains a GPT model that the
model bridge builds from the HF config (``slimecore.trainers.megatron_model``), starting from the
``--hf-checkpoint`` weights. It implements ``slimecore.trainers.backend.TrainBackend``; the training step around
it (hooks, reducer, metrics) is ``slimecore.trainers.trainer``, the same as for fsdp.

Parallelism follows Megatron's flags, as in slime: ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
``--expert-model-parallel-size``, ``--sequence-parallel``, ``--use-distributed-optimizer``, ``--recompute-*``,
``--bf16``. The data-parallel size is ``world / (TP x PP x CP)``; the ranks of one TP/PP group get the same
data (``data_parallel_rank``). ``--context-parallel-size`` > 1 is refused (see ``docs/megatron.md``).

Micro-batches. The rollout manager's schedule (``slimecore.rollout.schedule``: static ``--micro-batch-size`` or
dynamic ``--max-tokens-per-gpu``) gives each DP rank its micro-batches. Each one is a packed THD stream ``[1, T]``:
the samples concatenated, ``cu_seqlens`` at their boundaries, padded with id 0 to a multiple of the TP size
(sequence parallelism splits T). With Transformer Engine the attention reads ``cu_seqlens``
(``PackedSeqParams(qkv_format="thd")``). On a GPU without TE megatron-core's local attention takes the same
``thd`` stream through ``megatron_model.per_segment_attention``: torch's scaled-dot-product attention per sample
(flash kernels), so no (T, T) mask is built (at 16k tokens it was 12 GiB in ``fused_softmax``). On the CPU, and
for attention variants that path does not cover, the local attention gets the block-diagonal causal mask
(``packing = "mask"``); the tests check the two paths against each other. RoPE rotates by per-sample positions on the ``thd`` path, by stream positions on the mask path, which
gives the same attention scores because RoPE depends only on position differences (tests: 1e-5 against HF).

Log-probs. Logits (vocab-parallel with TP) are divided by ``--rollout-temperature``; log-softmax and entropy are
computed in fp32 across the TP shards (all-reduce of the max, of sum(exp), of the target logit and of
sum(p z); the backward is Megatron's identity for replicated losses). Sample i's response tokens ``[start, end)``
are scored by stream rows ``[start - 1, end - 1)``, as in the fsdp backend. On CUDA the last stage's model
returns its hidden states instead of logits (``post_process`` off for that forward), and the response rows go
through the output layer's (vocab-parallel) weight in chunks of ``CHUNK_TOKENS`` rows, their logits recomputed
in backward (``slimecore.ops.linear_logprobs``): no (T, V/tp) fp32 logits of the whole stream (not with
``--sequence-parallel`` or multi-token prediction, whose output layers do more).

Loss. A reducer's share ``J_mb`` adds up to the step objective over micro-batches and DP ranks. Megatron's
schedule divides a loss function's output by the rank's micro-batch count K, and DDP averages gradients over
DP x CP, so the loss function returns ``J_mb * K * DP`` (slime's ``loss_function`` scales the same way): the
gradient is exactly ``sum grad J_mb``, as in fsdp.

Optimizer. Megatron's (torch ``AdamW`` without Apex/TE; fp32 main params with ``--bf16``; sharded over DP with
``--use-distributed-optimizer``); the global gradient norm is clipped to ``--clip-grad`` and a non-finite norm
skips the step, as in fsdp; the LR follows ``slimecore.trainers.backend.lr_lambda``. One difference from fsdp:
Megatron exempts biases and norm weights from weight decay (the default ``--weight-decay`` is 0).

Weights for the engines: the bridge's HF-named export, in buckets of ``WEIGHT_BUCKET_BYTES`` (slime's
``--update-weight-buffer-size`` default); ``named_weights`` joins them on rank 0. Checkpoints: megatron-core
``dist_checkpointing`` (``torch_dist``: model and optimizer, reshardable to other TP/PP/DP sizes), the step and
LR-schedule position, the bridge shape (``megatron_checkpoint.json``) and each rank's RNG. The reference policy and
other weights a plugin scores with (``slime_scoring_weights``): CPU copies of each rank's parameters, the initial ones
or a checkpoint's read as ``--ref-load`` is, swapped into the live parameters for a no-grad pass.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from slimecore.checkpoint_layout import megatron_lm_checkpoint
from slimecore.trainers.megatron_args import megatron_overrides
from slimecore.ops.linear_logprobs import CHUNK_TOKENS, linear_log_probs_and_entropy
from slimecore.routers import MegatronRouterReplay
from slimecore.routing_replay import FLAG, NO_ROUTING_COLUMN, R2_FLAG, records, replays
from slimecore.trainers.backend import (REFERENCE, MicroBatchFn, ReferenceCopy, add_up, kept_copy, load_rng, lr_lambda,
                                        save_rng, training_device)
from slimecore.trainers.megatron_model import (CHECKPOINT_META, BridgedModel, MegatronSetupError, check_shape,
                                               find_bridge, init_parallel, per_segment_attention, read_checkpoint_meta,
                                               shape_dict, unwrap, write_checkpoint_meta)

log = logging.getLogger("slimecore.megatron")

WEIGHT_BUCKET_BYTES = 512 << 20
# The distributed optimizer's state as its own buffers: reshardable over DP only. In megatron-core 0.16.1 the
# default (fully_sharded_model_space) cannot be loaded and fully_reshardable fails on torch AdamW's "step" state.
OPTIMIZER_LAYOUT = {"distrib_optim_sharding_type": "dp_reshardable"}


# ---------------------------------------------------------------------------------------------------
# Start-up checks (driver, before Ray) and the parallel layout
# ---------------------------------------------------------------------------------------------------

def model_parallel_size(config) -> int:
    return config.tensor_model_parallel_size * config.pipeline_model_parallel_size * config.context_parallel_size


def data_parallel_rank(config, rank: int, world_size: int) -> int:
    """The DP rank of global ``rank`` in Megatron's default order ``tp-cp-ep-dp-pp`` (TP fastest)."""
    inner = config.tensor_model_parallel_size * config.context_parallel_size
    return (rank // inner) % (world_size // model_parallel_size(config))


def check_config(config, world_size: int) -> None:
    """Options this backend cannot run with, as errors naming the flag (called by the CLI and by each rank)."""
    c = config
    if world_size % model_parallel_size(c):
        raise MegatronSetupError(
            f"{world_size} training ranks (--actor-num-nodes x --actor-num-gpus-per-node) are not divisible by "
            f"--tensor-model-parallel-size x --pipeline-model-parallel-size x --context-parallel-size = "
            f"{c.tensor_model_parallel_size} x {c.pipeline_model_parallel_size} x {c.context_parallel_size}")
    experts_over = world_size // (c.tensor_model_parallel_size * c.pipeline_model_parallel_size)
    if experts_over % c.expert_model_parallel_size:
        raise MegatronSetupError(f"--expert-model-parallel-size {c.expert_model_parallel_size} must divide the "
                                 f"{experts_over} ranks of one pipeline stage's tensor-parallel replicas "
                                 "(training ranks / (TP x PP))")
    if c.context_parallel_size > 1:
        raise MegatronSetupError("--context-parallel-size > 1 is not supported by the megatron backend yet (the "
                                 "zig-zag split of packed samples and of their per-token loss terms is not written)")
    if c.sequence_parallel and c.tensor_model_parallel_size == 1:
        raise MegatronSetupError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if c.use_lora:
        raise MegatronSetupError("--use-lora is an fsdp-backend feature; use --train-backend fsdp")
    if c.gradient_checkpointing:
        raise MegatronSetupError("--gradient-checkpointing is the fsdp backend's flag; with megatron use "
                                 "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    if c.recompute_granularity == "full" and not c.recompute_method:
        raise MegatronSetupError("--recompute-granularity full needs --recompute-method uniform|block")
    if replays(c) and c.pipeline_model_parallel_size > 1:
        raise MegatronSetupError(f"{FLAG if c.use_rollout_routing_replay else R2_FLAG} with "
                                 "--pipeline-model-parallel-size > 1 is not supported (a stage's routers would hold "
                                 "a later micro-batch's experts during an earlier one's recompute); use pipeline size "
                                 "1 or --train-backend fsdp")


def check_startup(config, hooks):
    """Driver-side checks before Ray starts (``slimecore.trainers.backend.DRIVER_SIDE``): options, the roles, and
    a bridge that can build this architecture, which it returns."""
    from transformers import AutoConfig

    check_config(config, config.actor_num_nodes * config.actor_num_gpus_per_node)
    from slimecore.trainers.roles import ACTOR, declared_roles

    others = [role.name for role in declared_roles(config, hooks) if role.name != ACTOR]
    if others:
        raise MegatronSetupError(f"plugins ask for training role(s) {others} beside the actor (slime_train_roles); "
                                 "the megatron backend trains the actor only, and value models run on the fsdp "
                                 "backend only for now: use --train-backend fsdp")
    return find_bridge(config, hooks, AutoConfig.from_pretrained(config.hf_checkpoint))


# ---------------------------------------------------------------------------------------------------
# Packed micro-batches and vocab-parallel log-probs
# ---------------------------------------------------------------------------------------------------

@dataclass
class Packed:
    """One micro-batch as a packed stream; ``rows``/``targets`` locate the response tokens in it."""

    input_ids: torch.Tensor  # (1, T)
    position_ids: torch.Tensor  # (1, T), restarting at 0 per sample
    attention_mask: torch.Tensor | None  # (1, 1, T, T) bool, True = masked ("mask" packing)
    packed_seq_params: Any  # PackedSeqParams ("thd" packing)
    rows: torch.Tensor  # (N,) stream rows whose logits score the response tokens
    targets: torch.Tensor  # (N,) those tokens
    response_lengths: list[int]
    routed_experts: torch.Tensor | None = None  # routing replay: (T, MoE layers, topk) to replay
    record: bool = False  # R2: the routers choose, and their choice is kept (MegatronRouterReplay.recorded)


def pack(tokens: list[list[int]], response_lengths: list[int], packing: str, multiple: int,
         device: torch.device) -> Packed:
    """Concatenate ``tokens`` into one stream padded with id 0 to a multiple of ``multiple`` (an empty list gives
    one padding segment: the zero-loss forward of an empty micro-batch)."""
    lengths = [len(t) for t in tokens]
    total = sum(lengths)
    pad = (-total) % multiple if total else multiple
    segments = lengths + ([pad] if pad else [])
    stream = [tok for seq in tokens for tok in seq] + [0] * pad
    cu = torch.tensor([0] + list(np.cumsum(segments)), dtype=torch.int32)  # (n + 1,)
    positions = torch.cat([torch.arange(n) for n in segments])
    rows, targets, start = [], [], 0
    for seq, r in zip(tokens, response_lengths):
        rows.append(torch.arange(start + len(seq) - r - 1, start + len(seq) - 1))
        targets.append(torch.as_tensor(seq[len(seq) - r:], dtype=torch.long))
        start += len(seq)
    mask, params = None, None
    t = total + pad
    if packing == "mask":
        mask = torch.ones(t, t, dtype=torch.bool)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            mask[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril().logical_not()
        mask = mask[None, None].to(device)
    else:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu_dev, longest = cu.to(device), max(segments)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_dev, cu_seqlens_kv=cu_dev, max_seqlen_q=longest,
                                 max_seqlen_kv=longest)
    empty = torch.zeros(0, dtype=torch.long)
    return Packed(torch.tensor([stream], device=device), positions[None].to(device), mask, params,
                  torch.cat(rows).to(device) if rows else empty.to(device),
                  torch.cat(targets).to(device) if targets else empty.to(device), list(response_lengths))


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                             with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(z)[target]`` and ``H = logsumexp(z) - sum softmax(z) z`` of ``z = logits / T`` split over the
    vocabulary across the TP group; logits (N, V/tp), targets (N,) global ids -> (N,), (N,). fp32."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    z = logits.float() / temperature  # (N, V/tp)
    local = z.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * local
    peak = z.detach().max(dim=-1).values  # (N,); the result does not depend on it, so no gradient
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    exp = torch.exp(z - peak[:, None])
    total = tp_sum(exp.sum(dim=-1))  # (N,)
    lse = peak + torch.log(total)
    here = (targets >= first) & (targets < first + local)
    picked = z.gather(-1, (targets - first).clamp(0, local - 1)[:, None]).squeeze(-1)
    log_probs = tp_sum(torch.where(here, picked, torch.zeros_like(picked))) - lse
    if not with_entropy:
        return log_probs, None
    return log_probs, lse - tp_sum((exp * z).sum(dim=-1)) / total


# ---------------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------------

class MegatronBackend:
    """The megatron ``TrainBackend`` of one rank (see ``slimecore.trainers.backend``): a policy only (no value
    model, no LoRA). The caller has initialised torch.distributed when ``world_size`` > 1; Megatron makes its
    own groups from the world group."""

    def __init__(self, config, hooks, *, rank: int = 0, world_size: int = 1, value_model: bool = False,
                 keep_reference: bool = False, other_weights: dict[str, str] | None = None):
        from megatron.core import parallel_state
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.utils import get_model_config
        from transformers import AutoConfig

        if value_model:
            raise MegatronSetupError("the megatron backend has no value model (a critic); use --train-backend fsdp")
        check_config(config, world_size)
        self.config, self.rank, self.world_size = config, rank, world_size
        self.device = training_device()
        init_parallel(config, rank, world_size)
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        ddp = {"use_distributed_optimizer": bool(config.use_distributed_optimizer), "grad_reduce_in_fp32": True,
               "overlap_grad_reduce": False, "overlap_param_gather": False, **megatron_overrides(config, "ddp")}
        self.model = BridgedModel.build(config, hooks, config.hf_checkpoint, ddp)
        self.chunks = self.model.chunks
        # how a packed micro-batch's sample boundaries reach the attention: "thd" (cu_seqlens) or "mask"
        self.packing = self.model.runtime.packing
        if self.packing == "mask" and per_segment_attention(self.chunks) and self.device.type == "cuda":
            self.packing = "thd"  # the CPU keeps the mask path its tests were measured on (both are tested there)
        self.hf_config = AutoConfig.from_pretrained(config.hf_checkpoint)  # for the FLOPs figures
        self.modules = torch.nn.ModuleList(self.chunks)  # .train() / .eval() and named_parameters of every chunk
        # the weight export gathers over TP/PP/EP: every rank of those groups must take part
        self.collective_export = (parallel_state.get_model_parallel_group().size() > 1
                                  or config.expert_model_parallel_size > 1)
        if config.ref_load:  # slime's --ref-load: the reference policy, and the starting weights unless --load resumes
            self._load_reference_checkpoint(hooks, Path(config.ref_load), step=config.ref_ckpt_step)
        # column -> the weights it is scored under (reference_weights): the reference, other checkpoints read as
        # --ref-load is (the starting weights put back after each)
        self._kept = {REFERENCE: ReferenceCopy(self.modules.named_parameters())} if keep_reference else {}
        for column, checkpoint in (other_weights or {}).items():
            self._kept[column] = ReferenceCopy.of_loaded(self.modules.named_parameters, functools.partial(
                self._load_reference_checkpoint, hooks, Path(checkpoint), f"the {column} checkpoint"))
        passed = {"optimizer": "adam", **megatron_overrides(config, "optimizer")}  # e.g. --optimizer sgd
        optimizer_config = OptimizerConfig(
            **passed, lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
            adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
            clip_grad=config.clip_grad, bf16=bool(config.bf16),
            params_dtype=torch.bfloat16 if config.bf16 else torch.float32,
            use_distributed_optimizer=bool(config.use_distributed_optimizer))
        self.optimizer = get_megatron_optimizer(optimizer_config, self.chunks)
        model_config = get_model_config(self.chunks[0])
        model_config.finalize_model_grads_func = finalize_model_grads  # the DP gradient all-reduce
        model_config.grad_scale_func = self.optimizer.scale_loss
        self.lr_factor = lr_lambda(config)
        self.iteration = 0  # optimizer steps taken (the LR schedule's position)
        # response rows per chunk of the fused output layer (0: the model's own; see the module docstring)
        mtp = getattr(model_config, "mtp_num_layers", None)
        self.head_chunk = CHUNK_TOKENS if self.device.type == "cuda" and not config.sequence_parallel and not mtp else 0
        # routing replay: the MoE routers take the rollout's experts (R3) or those the old-policy log-prob pass
        # recorded (R2: self.records), through megatron-core's RouterReplay
        self.router_replay = MegatronRouterReplay(self.chunks, config) if replays(config) else None
        self.records = self.router_replay is not None and records(config)

    def _load_reference_checkpoint(self, hooks, path: Path, what: str = "--ref-load", step: int | None = None) -> None:
        """``--ref-load`` (or ``what``): a torch_dist checkpoint of this model (``megatron_checkpoint.json``: a megatron
        save's role folder, or ``slime-core convert hf-to-megatron``), a Megatron-LM one (a root with
        ``latest_checkpointed_iteration.txt``, or its ``iter_N`` / ``release`` folder: slime's
        tools/convert_hf_to_torch_dist.py; ``step``, slime's --ref-ckpt-step, picks its iter_N), or an HF directory of
        the same shape."""
        if step is not None:
            self.model.load_megatron_lm(megatron_lm_checkpoint(path, step),
                                        f"{what} {path} with --ref-ckpt-step {step}")
            return
        if (path / CHECKPOINT_META).is_file():
            check_shape(read_checkpoint_meta(path), self.model.bridge, f"{what} {path}")
            self.model.load_torch_dist(path)
            return
        folder = None if (path / "config.json").is_file() else megatron_lm_checkpoint(path)
        if folder is not None:
            self.model.load_megatron_lm(folder, f"{what} {path}")
            return
        from transformers import AutoConfig

        check_shape({"shape": shape_dict(find_bridge(self.config, hooks, AutoConfig.from_pretrained(path)))},
                    self.model.bridge, f"{what} {path}")
        self.model.runtime.load_hf_weights(self.chunks, str(path))

    # -- forward and backward --------------------------------------------------------------------
    def _pack(self, tokens, response_lengths) -> Packed:
        return pack(tokens, response_lengths, self.packing, self.tp_size, self.device)

    def _response_outputs(self, output: torch.Tensor, packed: Packed, temperature: float, with_entropy: bool,
                          gpt=None) -> dict:
        """The micro-batch's outputs from the last stage's ``output``: logits (1, T, V/tp), or with ``gpt`` (the
        unwrapped model whose forward returned them) hidden states (T, 1, H) for the chunked output layer."""
        if gpt is None:
            rows = output[0, packed.rows]  # (N, V/tp)
            log_probs, entropy = vocab_parallel_log_probs(rows, packed.targets, temperature, with_entropy)
        else:
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            weight = (gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights
                      else gpt.output_layer.weight)  # (V/tp, H)
            tp = self.tp_size > 1
            hidden = output[packed.rows, 0]  # (N, H)
            log_probs, entropy = linear_log_probs_and_entropy(
                copy_to_tensor_model_parallel_region(hidden) if tp else hidden, weight, packed.targets, temperature,
                with_entropy, bias=getattr(gpt.output_layer, "bias", None), chunk_size=self.head_chunk,
                compute_dtype=weight.dtype, vocab_start=parallel_state.get_tensor_model_parallel_rank() * weight.shape[0],
                group=parallel_state.get_tensor_model_parallel_group() if tp else None)
        sizes = packed.response_lengths
        return {"log_probs": list(log_probs.split(sizes)),
                "entropy": list(entropy.split(sizes)) if with_entropy else None}

    def run_micro_batches(self, batch: dict, micro_batches: list[list[int]], fn: MicroBatchFn, *,
                          temperature: float, with_entropy: bool, train: bool) -> list:
        scale = len(micro_batches) * self.dp_size  # cancels Megatron's 1/K and DDP's 1/DP (module docstring)

        def loss_fn(logits, packed, mb, gpt=None):
            info = None
            if mb:
                outputs = self._response_outputs(logits, packed, temperature, with_entropy, gpt)
                if packed.record:  # called right after the micro-batch's forward
                    outputs["routed_experts"] = self.router_replay.recorded([len(batch["tokens"][i]) for i in mb])
                loss, info = fn(mb, outputs)
            if not train:
                return logits.new_zeros(()), info
            return (loss * scale if mb else 0.0 * logits.float().sum()), info  # empty: same collectives, no loss

        items = [(self._pack([batch["tokens"][i] for i in mb], [batch["response_lengths"][i] for i in mb]), mb)
                 for mb in micro_batches]
        # R2: a no-grad pass of the policy (not the reference's) records its routing, which training replays
        record = not train and self.records and not self.router_replay.own
        if record:
            for packed, _ in items:
                packed.record = True
        elif self.router_replay is not None:
            if batch.get("rollout_routed_experts") is None:
                raise ValueError(NO_ROUTING_COLUMN)
            for packed, mb in items:
                packed.routed_experts = self.router_replay.indices(
                    [batch["rollout_routed_experts"][i] for i in mb], [len(batch["tokens"][i]) for i in mb],
                    packed.input_ids.shape[1])
        self.modules.train(train)
        if train:
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
        with contextlib.nullcontext() if train else torch.no_grad():
            infos = [info for info in (self._schedule(items, loss_fn, forward_only=not train) if items else [])
                     if info is not None]
        return infos if train else self._from_last_stage(infos)

    def _schedule(self, items: list, loss_fn, forward_only: bool) -> list:
        """Megatron's schedule over ``items`` (``(Packed, micro-batch)`` pairs); ``loss_fn(logits, packed, mb)``
        returns ``(loss, info)`` on the last pipeline stage. Returns the last stage's infos (other stages: [])."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            packed, mb = next(data_iterator)
            gpt = unwrap(model)
            last_stage = gpt.post_process
            hidden_out = last_stage and bool(self.head_chunk)  # the last stage returns hidden states, not logits
            gpt.post_process = last_stage and not hidden_out
            if self.router_replay is not None:
                self.router_replay.set(packed.routed_experts, record=packed.record)
            try:
                output = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                               attention_mask=packed.attention_mask, packed_seq_params=packed.packed_seq_params)
            finally:
                gpt.post_process = last_stage
            return output, lambda out: loss_fn(out, packed, mb, gpt if hidden_out else None)

        longest = max(item[0].input_ids.shape[1] for item in items)
        return get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(items),
                                           model=self.chunks, num_microbatches=len(items), seq_length=longest,
                                           micro_batch_size=1, forward_only=forward_only)

    def _from_last_stage(self, value):
        """``value`` of the last pipeline stage, on every stage."""
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        return box[0]

    @contextlib.contextmanager
    def reference_weights(self, column: str = REFERENCE):
        """The initial weights (or ``column``'s, ``other_weights``) swapped in for one forward, the current ones
        restored after; their MoE routers choose their own experts (no routing replay), as slime's reference does."""
        copy = kept_copy(self._kept, column)
        with self.router_replay.own_choice() if self.router_replay else contextlib.nullcontext():
            with copy.swapped_in(self.modules.named_parameters):
                yield

    # -- the optimizer -------------------------------------------------------------------------------
    def optimizer_step(self) -> tuple[float, float]:
        """Megatron's optimizer step, split so that a non-finite gradient norm skips the update (as fsdp does)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        lr = self.config.lr * self.lr_factor(self.iteration)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.iteration += 1
        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            log.warning("gradient norm is %s; skipping this optimizer step", grad_norm)
            return grad_norm, lr
        if self.config.clip_grad > 0:  # as ChainedOptimizer.step clips each part by the global norm
            for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                parameters = optimizer.get_parameters()
                if parameters and not getattr(optimizer, "is_stub_optimizer", False):
                    clip_grad_by_total_norm_fp32(parameters, self.config.clip_grad, grad_norm,
                                                 optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        self.optimizer.step_with_ready_grads()
        return grad_norm, lr

    def sum_across_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Sum over the data-parallel replicas: one contribution per DP rank (TP rank 0 of the last stage)."""
        from megatron.core import parallel_state

        if dist.get_world_size() == 1:
            return dict(values)
        speaks = (parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_context_parallel_rank()
                  == 0 and parallel_state.is_pipeline_last_stage())
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, values if speaks else None)
        return add_up(g for g in gathered if g is not None)

    # -- weights and checkpoints ---------------------------------------------------------------------
    def hf_weight_buckets(self, bucket_bytes: int = WEIGHT_BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full tensors on CPU in buckets of at most ``bucket_bytes`` (one oversized tensor is a bucket
        of its own). Collective: every rank of the model-parallel group iterates it (and gets every bucket)."""
        from slimecore.engines.weight_sync import bucketize

        return bucketize(self.model.hf_weights(), bucket_bytes)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Every HF-named weight on CPU (rank 0; other ranks take part in the gathers and get an empty dict)."""
        weights = {}
        for bucket in self.hf_weight_buckets():
            if self.rank == 0:
                weights.update(bucket)
        return weights

    def save(self, directory: str) -> None:
        """``directory``: torch_dist model (+ optimizer unless ``--no-save-optim``), ``megatron_checkpoint.json``
        (bridge shape, parallel sizes, step) and ``rng_rank{r}.pt``. Collective."""
        path = Path(directory)
        state = self.model.torch_dist_state()
        if not self.config.no_save_optim:
            state["optimizer"] = self.optimizer.sharded_state_dict(state["model"], metadata=OPTIMIZER_LAYOUT)
        self.model.save_torch_dist(path, state)
        if self.rank == 0:
            write_checkpoint_meta(path, self.model.bridge, self.config, iteration=self.iteration,
                                  optimizer=not self.config.no_save_optim, hf_checkpoint=self.config.hf_checkpoint,
                                  use_distributed_optimizer=bool(self.config.use_distributed_optimizer),
                                  bf16=bool(self.config.bf16))
        save_rng(path, self.rank, **self._tracker_rng())
        dist.barrier()

    def load(self, directory: str) -> None:
        """Restore what ``save`` wrote (any TP/PP/DP layout: torch_dist reshards). The reference policy stays the
        initial checkpoint."""
        path = Path(directory)
        meta = read_checkpoint_meta(path)
        check_shape(meta, self.model.bridge, str(path))
        state = self.model.torch_dist_state()
        with_optimizer = meta.get("optimizer", False) and not self.config.no_save_optim
        if not meta.get("optimizer", False) and not self.config.no_save_optim:
            raise FileNotFoundError(f"{path} was saved with --no-save-optim (no optimizer state); pass --no-save-optim "
                                    "to resume with a fresh optimizer")
        if with_optimizer:
            for flag in ("use_distributed_optimizer", "bf16", "tensor_model_parallel_size",
                         "pipeline_model_parallel_size", "expert_model_parallel_size"):
                if meta.get(flag) != getattr(self.config, flag):
                    raise ValueError(
                        f"{path}: its optimizer state was saved with --{flag.replace('_', '-')} {meta.get(flag)}, this "
                        f"run has {getattr(self.config, flag)}; the optimizer state reshards over data-parallel ranks "
                        "only. Resume with the same setting, or pass --no-save-optim to load the weights alone "
                        "(they reshard to any layout) with a fresh optimizer")
            self._materialize_optimizer_state()
            state["optimizer"] = self.optimizer.sharded_state_dict(state["model"], is_loading=True,
                                                                   metadata=OPTIMIZER_LAYOUT)
        loaded = self.model.load_torch_dist(path, state)
        if with_optimizer:
            with torch.no_grad():  # megatron copies into fp32 main params that require grad
                self.optimizer.load_state_dict(loaded["optimizer"])
        else:
            self.optimizer.reload_model_params()
        self.iteration = int(meta.get("iteration", 0))
        rng = load_rng(path, self.rank)
        if "tracker" in rng and torch.cuda.is_available():
            from megatron.core import tensor_parallel

            tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])

    def _tracker_rng(self) -> dict:
        """Megatron's model-parallel RNG streams (dropout in TP regions), on CUDA."""
        if not torch.cuda.is_available():
            return {}
        from megatron.core import tensor_parallel

        return {"tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}

    # -- colocate offload ----------------------------------------------------------------------------
    def offload(self) -> None:
        """Not written yet: ``--offload-train`` with this backend is refused at start-up (``slimecore.config``)."""
        raise MegatronSetupError("--offload-train is not implemented for --train-backend megatron yet")

    onload = offload

    def _materialize_optimizer_state(self) -> None:
        """Before any step torch's AdamW has no state (no ``step``, no moments), and Megatron cannot describe a
        state dict to load into. A zero-gradient step creates it, as Megatron's own
        ``_init_optimizer_states_with_dummy_values`` does; the load then overwrites parameters and state."""
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(optimizer, "optimizer", None)
            if inner is None or inner.state:
                continue
            for group in inner.param_groups:
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            inner.step()
            inner.zero_grad()
