"""The ``megatron`` training backend (``--train-backend megatron``): megatron-core trains a GPT model that the
model bridge builds from the HF config (``slime_model_bridge``; ``--plugin models`` answers for Qwen2/2.5, Qwen3,
Qwen3-MoE, Llama 3, GLM-4.5 and DeepSeek V3, mbridge underneath), starting from the ``--hf-checkpoint`` weights.

What a bridge must provide (``bridge.megatron(hf_config, dtype=, overrides=)``, called after
``parallel_state`` is initialised, returns an object with): ``config`` (the ``TransformerConfig``), ``packing``
(``"thd"`` or ``"mask"``, below), ``build(ddp_config) -> [chunk]``, ``load_hf_weights(chunks, directory)`` and
``export_hf_weights(chunks) -> iter((hf_name, tensor))`` (collective over TP/PP/EP; every rank gets every tensor).

Parallelism follows Megatron's flags, as in slime: ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
``--expert-model-parallel-size``, ``--sequence-parallel``, ``--use-distributed-optimizer``, ``--recompute-*``,
``--bf16``. The data-parallel size is ``world / (TP x PP x CP)``; the ranks of one TP/PP group get the same
data (``data_parallel_rank``). ``--context-parallel-size`` > 1 is refused (see ``docs/megatron.md``).

Micro-batches. The rollout manager's schedule (``slimecore.trainers.schedule``: static ``--micro-batch-size`` or
dynamic ``--max-tokens-per-gpu``) gives each DP rank its micro-batches. Each one is a packed THD stream ``[1, T]``:
the samples concatenated, ``cu_seqlens`` at their boundaries, padded with id 0 to a multiple of the TP size
(sequence parallelism splits T). With Transformer Engine the attention reads ``cu_seqlens``
(``PackedSeqParams(qkv_format="thd")``). Without it (CPU, or a GPU without TE) megatron-core's local attention
gets the block-diagonal causal mask of the same boundaries; RoPE then rotates by stream positions instead of
per-sample positions, which gives the same attention scores because RoPE depends only on position differences
(the tests check 1e-5 against HF).

Log-probs. Logits (vocab-parallel with TP) are divided by ``--rollout-temperature``; log-softmax and entropy are
computed in fp32 across the TP shards (all-reduce of the max, of sum(exp), of the target logit and of
sum(p z); the backward is Megatron's identity for replicated losses). Sample i's response tokens ``[start, end)``
are scored by stream rows ``[start - 1, end - 1)``, as in the fsdp backend.

Loss. The same hooks as the fsdp backend (``slime_train_inputs``, ``slime_compute_advantages``,
``slime_rollout_data_postprocess``, ``slime_loss`` with a ``Reducer``); this class reuses ``FSDPTrainer.train``
for that orchestration and replaces the model-specific parts. A reducer's share ``J_mb`` adds up to the step
objective over micro-batches and DP ranks. Megatron's schedule divides a loss function's output by the rank's
micro-batch count K, and DDP averages gradients over DP x CP, so the loss function returns ``J_mb * K * DP``
(slime's ``loss_function`` scales the same way): the gradient is exactly ``sum grad J_mb``, as in fsdp.

Optimizer. Megatron's (torch ``AdamW`` without Apex/TE; fp32 main params with ``--bf16``; sharded over DP with
``--use-distributed-optimizer``); the global gradient norm is clipped to ``--clip-grad`` and a non-finite norm
skips the step, as in fsdp; the LR follows ``slimecore.trainers.fsdp.lr_lambda``. One difference from fsdp:
Megatron exempts biases and norm weights from weight decay (the default ``--weight-decay`` is 0).

Weights for the engines: the bridge's HF-named export, in buckets of ``WEIGHT_BUCKET_BYTES`` (slime's
``--update-weight-buffer-size`` default); ``named_weights`` joins them on rank 0. Checkpoints: megatron-core
``dist_checkpointing`` (``torch_dist``: model and optimizer, reshardable to other TP/PP/DP sizes), the step and
LR-schedule position, the bridge shape (``megatron_checkpoint.json``) and each rank's RNG.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from slimecore.checkpoint import atomic_write_text
from slimecore.config import ConfigError
from slimecore.megatron_args import megatron_overrides
from slimecore.trainers.fsdp import FSDPTrainer, lr_lambda

log = logging.getLogger("slimecore.megatron")

WEIGHT_BUCKET_BYTES = 512 << 20
CHECKPOINT_META = "megatron_checkpoint.json"
# The distributed optimizer's state as its own buffers: reshardable over DP only. In megatron-core 0.16.1 the
# default (fully_sharded_model_space) cannot be loaded and fully_reshardable fails on torch AdamW's "step" state.
OPTIMIZER_LAYOUT = {"distrib_optim_sharding_type": "dp_reshardable"}


class MegatronSetupError(ConfigError):
    """A configuration the megatron backend cannot run; the message names the flag and what to do."""


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


def check_startup(config, hooks) -> None:
    """Driver-side checks before Ray starts: options, and a bridge that can build this architecture."""
    from transformers import AutoConfig

    check_config(config, config.actor_num_nodes * config.actor_num_gpus_per_node)
    from slimecore.trainers.roles import ACTOR, declared_roles

    others = [role.name for role in declared_roles(config, hooks) if role.name != ACTOR]
    if others:
        raise MegatronSetupError(f"plugins ask for training role(s) {others} beside the actor (slime_train_roles); "
                                 "the megatron backend trains the actor only, and value models run on the fsdp "
                                 "backend only for now: use --train-backend fsdp")
    find_bridge(config, hooks, AutoConfig.from_pretrained(config.hf_checkpoint))


def find_bridge(config, hooks, hf_config):
    bridge = hooks.model_bridge(config=config, hf_config=hf_config)
    architectures = getattr(hf_config, "architectures", None)
    if bridge is None:
        raise MegatronSetupError(
            f"no active plugin answers slime_model_bridge for architectures {architectures} of "
            f"{config.hf_checkpoint}; add --plugin models (Qwen2/2.5, Qwen3, Qwen3-MoE, Llama, GLM-4.5, DeepSeek V3) "
            "or a plugin with a bridge for it")
    if not callable(getattr(bridge, "megatron", None)):
        raise MegatronSetupError(f"the bridge answered for {architectures} ({type(bridge).__name__}) has no "
                                 "megatron(hf_config, dtype=, overrides=) method, so it cannot build a Megatron model")
    return bridge


def init_parallel(config, rank: int = 0, world_size: int = 1) -> None:
    """torch.distributed (a one-rank gloo group when the caller has none) and Megatron's parallel state."""
    from megatron.core import parallel_state

    if not torch.cuda.is_available():
        try:
            torch.cuda.current_device()
        except (AssertionError, RuntimeError) as exc:
            raise MegatronSetupError(
                "--train-backend megatron needs CUDA: megatron-core calls CUDA APIs throughout. On a CPU-only "
                "machine it runs only under the test shim (tests/megatron/cpu_plugin.py); use --train-backend "
                f"fsdp here ({exc})") from None
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if world_size == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:  # launched by torchrun: MASTER_ADDR / MASTER_PORT in the environment
            dist.init_process_group(backend, rank=rank, world_size=world_size)
    sizes = dict(tensor_model_parallel_size=config.tensor_model_parallel_size,
                 pipeline_model_parallel_size=config.pipeline_model_parallel_size,
                 context_parallel_size=config.context_parallel_size,
                 expert_model_parallel_size=config.expert_model_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(**sizes)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(config.seed)


def transformer_overrides(config) -> dict:
    """``TransformerConfig`` fields from slime's Megatron flags."""
    bf16 = bool(config.bf16)
    overrides = {"sequence_parallel": bool(config.sequence_parallel), "bf16": bf16,
                 "params_dtype": torch.bfloat16 if bf16 else torch.float32,
                 "pipeline_dtype": torch.bfloat16 if bf16 else torch.float32}
    if config.recompute_granularity:
        overrides.update(recompute_granularity=config.recompute_granularity,
                         recompute_method=config.recompute_method, recompute_num_layers=config.recompute_num_layers)
    return {**megatron_overrides(config, "transformer"), **overrides}


def build_model(config, hooks, hf_dir: str, ddp_config: dict | None = None, load_weights: bool = True):
    """(bridge, megatron runtime, chunks) for the HF config in ``hf_dir``, its HF weights loaded unless
    ``load_weights`` is False, in the current parallel state."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(hf_dir)
    bridge = find_bridge(config, hooks, hf_config)
    tp = config.tensor_model_parallel_size
    if hf_config.vocab_size % tp:
        raise MegatronSetupError(f"vocab size {hf_config.vocab_size} of {hf_dir} is not divisible by "
                                 f"--tensor-model-parallel-size {tp}; padded vocabulary rows would change the "
                                 "softmax, so they are not added")
    runtime = bridge.megatron(hf_config, dtype=torch.bfloat16 if config.bf16 else torch.float32,
                              overrides=transformer_overrides(config))
    chunks = runtime.build(ddp_config)
    if load_weights:
        runtime.load_hf_weights(chunks, hf_dir)
    return bridge, runtime, chunks


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):  # DDP, Float16Module
        module = module.module
    return module


def shape_dict(bridge) -> dict:
    return dataclasses.asdict(bridge) if dataclasses.is_dataclass(bridge) else dict(vars(bridge))


def model_sharded_state_dict(chunks) -> dict:
    if len(chunks) != 1:
        raise MegatronSetupError("virtual pipeline stages are not supported")
    return {"model": unwrap(chunks[0]).sharded_state_dict()}


def write_checkpoint_meta(directory: Path, bridge, config, **extra) -> None:
    meta = {"format": "torch_dist", "architecture": getattr(bridge, "architecture", None), "shape": shape_dict(bridge),
            "tensor_model_parallel_size": config.tensor_model_parallel_size,
            "pipeline_model_parallel_size": config.pipeline_model_parallel_size,
            "expert_model_parallel_size": config.expert_model_parallel_size, **extra}
    atomic_write_text(directory / CHECKPOINT_META, json.dumps(meta, indent=1))  # other ranks may be reading it


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
# The trainer
# ---------------------------------------------------------------------------------------------------

class MegatronTrainer(FSDPTrainer):
    """One rank of the actor. Inherits ``train`` (hook orchestration), ``_micro_batch``, ``_reducer``,
    ``_logprob_abs_diff`` and ``compute_log_probs`` from ``FSDPTrainer``; replaces the model, the forward, the
    optimizer step, the weight export and the checkpoints. The caller has initialised torch.distributed when
    ``world_size`` > 1 (``process_group`` is ignored: Megatron makes its own groups from the world group)."""

    def __init__(self, config, hooks, rank: int = 0, world_size: int = 1, role: str = "actor", process_group=None):
        from megatron.core import parallel_state
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.utils import get_model_config
        from transformers import AutoConfig

        if role != "actor":
            raise MegatronSetupError(f"role {role!r}: the megatron backend trains the actor only; value models "
                                     "(critic) need --train-backend fsdp")
        check_config(config, world_size)
        self.config, self.hooks, self.rank, self.world_size, self.role = config, hooks, rank, world_size, role
        self.is_value, self.outputs = False, {}
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        init_parallel(config, rank, world_size)
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        ddp = {"use_distributed_optimizer": bool(config.use_distributed_optimizer), "grad_reduce_in_fp32": True,
               "overlap_grad_reduce": False, "overlap_param_gather": False, **megatron_overrides(config, "ddp")}
        self.bridge, self.runtime, self.chunks = build_model(config, hooks, config.hf_checkpoint, ddp)
        self.hf_config = AutoConfig.from_pretrained(config.hf_checkpoint)  # for the FLOPs figures
        self.model = torch.nn.ModuleList(self.chunks)  # .train() / .eval() for the inherited code
        # collective weight export: every TP/PP/EP rank must take part
        self.sharded = parallel_state.get_model_parallel_group().size() > 1 or config.expert_model_parallel_size > 1
        self._ref_params: dict[str, torch.Tensor] | None = None
        if "ref_log_probs" in set(hooks.train_inputs(config=config, role=role)):
            self._ref_params = {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}
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

    # -- forward ---------------------------------------------------------------------------------
    def _pack(self, tokens, response_lengths) -> Packed:
        return pack(tokens, response_lengths, self.runtime.packing, self.tp_size, self.device)

    def _response_outputs(self, logits: torch.Tensor, packed: Packed, temperature: float, with_entropy: bool):
        rows = logits[0, packed.rows]  # (N, V/tp)
        log_probs, entropy = vocab_parallel_log_probs(rows, packed.targets, temperature, with_entropy)
        sizes = packed.response_lengths
        return list(log_probs.split(sizes)), (list(entropy.split(sizes)) if with_entropy else None)

    def _run(self, items: list, loss_fn, forward_only: bool) -> list:
        """Megatron's schedule over ``items`` (``(Packed, context)`` pairs); ``loss_fn(logits, packed, context)``
        returns ``(loss, info)`` on the last pipeline stage. Returns the last stage's infos (other stages: [])."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            packed, context = next(data_iterator)
            logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                           attention_mask=packed.attention_mask, packed_seq_params=packed.packed_seq_params)
            return logits, lambda output: loss_fn(output, packed, context)

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

    @torch.no_grad()
    def _score(self, data: dict, temperature: float, with_entropy: bool):
        """No-grad per-sample log-probs (and entropies) of every local sample, micro-batched as the steps are."""
        n = len(data["tokens"])
        items = [(self._pack([data["tokens"][i] for i in mb], [data["response_lengths"][i] for i in mb]), mb)
                 for step in data["steps"] for mb in step["micro_batches"]]
        log_probs: list = [None] * n
        entropy: list = [None] * n

        def score(logits, packed, mb):
            if not mb:
                return logits.new_zeros(()), {"mb": [], "log_probs": [], "entropy": []}
            lps, ents = self._response_outputs(logits, packed, temperature, with_entropy)
            return logits.new_zeros(()), {"mb": mb, "log_probs": [x.cpu() for x in lps],
                                          "entropy": [x.cpu() for x in ents] if ents else None}

        self.model.eval()
        results = self._from_last_stage(self._run(items, score, forward_only=True) if items else [])
        for result in results:
            for k, i in enumerate(result["mb"]):
                log_probs[i] = result["log_probs"][k]
                if with_entropy:
                    entropy[i] = result["entropy"][k]
        return log_probs, (entropy if with_entropy else None)

    def compute_values(self, data: dict) -> dict:
        raise MegatronSetupError("the megatron backend has no value model; use --train-backend fsdp for a critic")

    @contextlib.contextmanager
    def _reference_weights(self):
        """The initial weights swapped in for one forward, the current ones restored after."""
        if self._ref_params is None:
            raise RuntimeError("ref_log_probs was not requested by slime_train_inputs when the trainer was built")
        current = {}
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                current[name] = p.detach().to("cpu", copy=True)
                p.copy_(self._ref_params[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(current[name])

    # -- one optimizer step ----------------------------------------------------------------------------
    def _optimizer_step(self, batch: dict, step: dict, measure_mismatch: bool = False) -> dict[str, float]:
        config = self.config
        micro_batches = step["micro_batches"]
        scale = len(micro_batches) * self.dp_size  # cancels Megatron's 1/K and DDP's 1/DP (module docstring)

        def loss_fn(logits, packed, mb):
            if mb is None:  # an empty micro-batch: same collectives, no loss
                return 0.0 * logits.float().sum(), {}
            mb_batch = self._micro_batch(batch, mb)
            log_probs, entropy = self._response_outputs(logits, packed, config.rollout_temperature, True)
            reducer = self._reducer(mb_batch, step)
            loss, metrics = self.hooks.loss(config=config, role=self.role, batch=mb_batch,
                                            outputs={"log_probs": log_probs, "entropy": entropy}, reducer=reducer)
            info = {k: float(v) for k, v in {"loss": loss.detach(), **metrics}.items()}
            if measure_mismatch:
                diffs = [(lp.detach() - roll).abs() for lp, roll in zip(log_probs, mb_batch["rollout_log_probs"])]
                info["train_rollout_logprob_abs_diff"] = float(reducer(diffs))
            return loss * scale, info

        items = [(self._pack([batch["tokens"][i] for i in mb], [batch["response_lengths"][i] for i in mb]), mb or None)
                 for mb in micro_batches]
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.config.lr * self.lr_factor(self.iteration)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        sums: dict[str, float] = {}
        for info in self._run(items, loss_fn, forward_only=False):
            for key, value in info.items():
                sums[key] = sums.get(key, 0.0) + value
        grad_norm = self._step()
        self.iteration += 1
        metrics = {f"train/{k}": v for k, v in self._sum_across_ranks(sums).items()}
        metrics.update({"train/grad_norm": grad_norm, "train/lr": lr})
        return metrics

    def _step(self) -> float:
        """Megatron's optimizer step, split so that a non-finite gradient norm skips the update (as fsdp does)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        found_inf = self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            log.warning("gradient norm is %s; skipping this optimizer step", grad_norm)
            return grad_norm
        if self.config.clip_grad > 0:  # as ChainedOptimizer.step clips each part by the global norm
            for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                parameters = optimizer.get_parameters()
                if parameters and not getattr(optimizer, "is_stub_optimizer", False):
                    clip_grad_by_total_norm_fp32(parameters, self.config.clip_grad, grad_norm,
                                                 optimizer.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        self.optimizer.step_with_ready_grads()
        return grad_norm

    def _sum_across_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Sum over the data-parallel replicas: one contribution per DP rank (TP rank 0 of the last stage)."""
        from megatron.core import parallel_state

        if dist.get_world_size() == 1:
            return dict(values)
        speaks = (parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_context_parallel_rank()
                  == 0 and parallel_state.is_pipeline_last_stage())
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, values if speaks else None)
        gathered = [g for g in gathered if g is not None]
        return {k: sum(g.get(k, 0.0) for g in gathered) for k in sorted({k for g in gathered for k in g})}

    # -- weights and checkpoints ---------------------------------------------------------------------
    def hf_weight_buckets(self, bucket_bytes: int = WEIGHT_BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """HF-named full tensors in buckets of at most ``bucket_bytes`` (one oversized tensor is a bucket of its
        own). Collective: every rank of the model-parallel group iterates it."""
        bucket, size = [], 0
        for name, tensor in self.runtime.export_hf_weights(self.chunks):
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor.detach().to("cpu", copy=True)))
            size += nbytes
        if bucket:
            yield bucket

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
        from megatron.core import dist_checkpointing

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        state = model_sharded_state_dict(self.chunks)
        if not self.config.no_save_optim:
            state["optimizer"] = self.optimizer.sharded_state_dict(state["model"], metadata=OPTIMIZER_LAYOUT)
        (path / "torch_dist").mkdir(exist_ok=True)
        dist_checkpointing.save(state, str(path / "torch_dist"))
        if self.rank == 0:
            write_checkpoint_meta(path, self.bridge, self.config, iteration=self.iteration,
                                  optimizer=not self.config.no_save_optim, hf_checkpoint=self.config.hf_checkpoint,
                                  use_distributed_optimizer=bool(self.config.use_distributed_optimizer),
                                  bf16=bool(self.config.bf16))
        self._save_rng(path)
        dist.barrier()

    def load(self, directory: str) -> None:
        """Restore what ``save`` wrote (any TP/PP/DP layout: torch_dist reshards). The reference policy stays the
        initial checkpoint."""
        from megatron.core import dist_checkpointing

        path = Path(directory)
        meta = read_checkpoint_meta(path)
        check_shape(meta, self.bridge, str(path))
        state = model_sharded_state_dict(self.chunks)
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
        loaded = dist_checkpointing.load(state, str(path / "torch_dist"))
        unwrap(self.chunks[0]).load_state_dict(loaded["model"])
        if with_optimizer:
            with torch.no_grad():  # megatron copies into fp32 main params that require grad
                self.optimizer.load_state_dict(loaded["optimizer"])
        else:
            self.optimizer.reload_model_params()
        self.iteration = int(meta.get("iteration", 0))
        self._load_rng(path)

    def _rng_state(self) -> dict:
        rng = super()._rng_state()
        if torch.cuda.is_available():  # Megatron's model-parallel RNG streams (dropout in TP regions)
            from megatron.core import tensor_parallel

            rng["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
        return rng

    def _set_rng_state(self, rng: dict) -> None:
        super()._set_rng_state(rng)
        if "tracker" in rng and torch.cuda.is_available():
            from megatron.core import tensor_parallel

            tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])

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


def read_checkpoint_meta(path: Path) -> dict:
    file = path / CHECKPOINT_META
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no {CHECKPOINT_META}; it is not a checkpoint written by the megatron "
                                "backend or `slime-core convert hf-to-megatron` (an fsdp checkpoint holds "
                                "model.safetensors instead: resume it with --train-backend fsdp)")
    return json.loads(file.read_text())


def check_shape(meta: dict, bridge, where: str) -> None:
    """The checkpoint's recorded model shape must equal the bridge's; every differing field is named."""
    current = json.loads(json.dumps(shape_dict(bridge)))  # as stored: tuples become lists
    saved = meta.get("shape", {})
    diffs = [f"--{k.replace('_', '-')}: checkpoint {saved.get(k)!r}, HF config {current.get(k)!r}"
             for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    if diffs:
        raise ValueError(f"checkpoint {where} was saved for a different model than the HF config: " + "; ".join(diffs))
