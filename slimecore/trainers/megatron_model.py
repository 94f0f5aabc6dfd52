"""A megatron-core model built from an HF checkpoint through the model bridge, and its ``torch_dist`` checkpoints:
what the megatron training backend (``slimecore.trainers.megatron``) and ``slime-core convert``
(``slimecore.convert``) share.

What a bridge must provide (``slime_model_bridge`` answers with it; ``--plugin models`` for Qwen2/2.5, Qwen3,
Qwen3-MoE, Llama 3, GLM-4.5 and DeepSeek V3, mbridge underneath): a shape (a dataclass recorded in checkpoints)
with a method ``megatron(hf_config, dtype=, overrides=)``, called after ``parallel_state`` is initialised, that
returns a runtime with ``config`` (the ``TransformerConfig``), ``packing`` (``"thd"`` or ``"mask"``: how a packed
micro-batch's sample boundaries reach the attention), ``build(ddp_config) -> [chunk]``,
``load_hf_weights(chunks, directory)`` and ``export_hf_weights(chunks) -> iter((hf_name, tensor))`` (collective
over TP/PP/EP; every rank gets every tensor).

A checkpoint directory holds ``torch_dist/`` (megatron-core ``dist_checkpointing``: reshardable to other
TP/PP/DP layouts) and ``megatron_checkpoint.json`` (the bridge shape, the parallel sizes and what else the writer
records), which is checked against the HF config before anything is loaded.

Megatron-core is imported only inside the functions that need it: the checks run without it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slimecore.checkpoint import atomic_write_text
from slimecore.config import ConfigError
from slimecore.routing_replay import replays
from slimecore.trainers.megatron_args import megatron_overrides

CHECKPOINT_META = "megatron_checkpoint.json"


class MegatronSetupError(ConfigError):
    """A configuration the megatron backend cannot run; the message names the flag and what to do."""


def find_bridge(config, hooks, hf_config):
    """The shape the active plugins' ``slime_model_bridge`` answers for ``hf_config``; an error naming the
    architecture when none answers or the answer cannot build a Megatron model."""
    bridge = hooks.slime_model_bridge(config=config, hf_config=hf_config)
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
    if replays(config):  # megatron-core's RouterReplay in every router (slimecore.routers)
        overrides["moe_enable_routing_replay"] = True
    return {**megatron_overrides(config, "transformer"), **overrides}


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module"):  # DDP, Float16Module
        module = module.module
    return module


@dataclass
class BridgedModel:
    """This rank's part of a Megatron model that a bridge built: ``bridge`` (the shape it answered with),
    ``runtime`` (what ``bridge.megatron(...)`` returned) and the model ``chunks``."""

    bridge: Any
    runtime: Any
    chunks: list

    @classmethod
    def build(cls, config, hooks, hf_dir: str, ddp_config: dict | None = None,
              load_weights: bool = True) -> BridgedModel:
        """The model of the HF config in ``hf_dir``, its HF weights loaded unless ``load_weights`` is False, in
        the current parallel state (``init_parallel``); with ``ddp_config``, wrapped for training."""
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
        return cls(bridge, runtime, chunks)

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF-named full tensor, copied to CPU. Collective: every rank of the model-parallel group
        iterates it (and gets every tensor)."""
        for name, tensor in self.runtime.export_hf_weights(self.chunks):
            yield name, tensor.detach().to("cpu", copy=True)

    def torch_dist_state(self) -> dict:
        """The sharded state dict ``torch_dist`` saves and loads: ``{"model": ...}`` (a trainer adds its optimizer)."""
        if len(self.chunks) != 1:
            raise MegatronSetupError("virtual pipeline stages are not supported")
        return {"model": unwrap(self.chunks[0]).sharded_state_dict()}

    def save_torch_dist(self, directory: Path, state: dict | None = None) -> None:
        """``state`` (default: ``torch_dist_state()``) in ``directory/torch_dist``. Collective."""
        from megatron.core import dist_checkpointing

        (directory / "torch_dist").mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(self.torch_dist_state() if state is None else state, str(directory / "torch_dist"))

    def load_torch_dist(self, directory: Path, state: dict | None = None) -> dict:
        """Load ``directory/torch_dist`` into ``state`` (default: ``torch_dist_state()``, which reshards to this
        layout), set the model's weights from it and return what was loaded. Collective."""
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(self.torch_dist_state() if state is None else state,
                                         str(directory / "torch_dist"))
        unwrap(self.chunks[0]).load_state_dict(loaded["model"])
        return loaded

    def load_megatron_lm(self, folder: Path, where: str) -> None:
        """The model's weights from a Megatron-LM checkpoint folder (``slimecore.checkpoint_layout.megatron_lm_checkpoint``):
        its sharded model tensors, resharded to this layout as ``load_torch_dist`` does, the sharded state dict built
        with the content metadata the checkpoint was saved with (Megatron-LM's ``sharded_state_dict`` options). The
        optimizer, RNG state and args in it are not read. A key or shape mismatch with this model is one
        ``MegatronSetupError`` naming ``where`` (``check_sharded_keys``). Collective."""
        from megatron.core import dist_checkpointing

        if len(self.chunks) != 1:
            raise MegatronSetupError("virtual pipeline stages are not supported")
        gpt = unwrap(self.chunks[0])
        metadata = dist_checkpointing.load_content_metadata(str(folder))
        check_sharded_keys({"model": gpt.sharded_state_dict(metadata=metadata)}, folder, where)
        loaded = dist_checkpointing.load({"model": gpt.sharded_state_dict(metadata=metadata)}, str(folder))
        gpt.load_state_dict(loaded["model"])


# sharded entries of a Megatron-LM checkpoint that are not the model's
NOT_MODEL = ("optimizer.", "chained_", "rng_state")


def check_sharded_keys(state: dict, folder: Path, where: str) -> None:
    """Every sharded tensor of ``state`` is in the checkpoint ``folder`` with the same global shape, and the
    checkpoint holds no model tensor ``state`` lacks; else one ``MegatronSetupError``: ``where``, the first missing
    and unexpected keys or differing shapes, and the likely cause, before ``dist_checkpointing.load`` meets them.
    Layer names need no mapping here: megatron-core's local layer spec already saves and loads its layer norms under
    Transformer Engine's names (``sharded_state_dict_keys_map``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    # a ShardedObject (e.g. a layer's _extra_state) is stored per shard: "KEY/shard_<offsets>_<shape>"
    saved = {k.split("/shard_")[0] if not isinstance(v, ShardedTensor) else k: v
             for k, v in load_sharded_metadata(str(folder)).items()}
    wanted, _, _ = load_preprocess(state)
    ours = {sh.key: tuple(sh.global_shape) if isinstance(sh, ShardedTensor) else None for sh in nested_values(wanted)}
    missing = sorted(k for k in ours if k not in saved)
    unexpected = sorted(k for k in saved if k not in ours and not k.startswith(NOT_MODEL))
    shapes = [f"{k} {tuple(saved[k].global_shape)} in the checkpoint, {ours[k]} in the model" for k in sorted(ours)
              if k in saved and ours[k] is not None and isinstance(saved[k], ShardedTensor)
              and tuple(saved[k].global_shape) != ours[k]]
    if not (missing or unexpected or shapes):
        return

    def first(keys: list[str]) -> str:
        return ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")

    parts = ([f"missing from it: {first(missing)}"] if missing else []) + (
        [f"not in the model: {first(unexpected)}"] if unexpected else []) + (
        [f"shapes differ: {first(shapes)}"] if shapes else [])
    if shapes:
        cause = ("it was saved for another model size than --hf-checkpoint's config.json describes (hidden size, "
                 "layers, heads, vocabulary)")
    elif all("_extra_state" in k for k in missing + unexpected):
        cause = "only the layers' extra state differs: it was saved by another layer implementation or megatron-core"
    else:
        cause = ("it was saved for another architecture or layer spec than this run builds from --hf-checkpoint's "
                 "config.json (qk-norm, biases, tied embeddings, the MoE expert layout)")
    raise MegatronSetupError(f"{where}: the checkpoint {folder} does not match the model: {'; '.join(parts)}. "
                             f"Likely cause: {cause}. Pass the --hf-checkpoint of the model it holds, or write it "
                             "from that model's HF weights with `slime-core convert hf-to-megatron`")


def per_segment_attention(chunks: list) -> bool:
    """Without Transformer Engine: let the local attention of every layer take packed streams (``thd``, the
    sample boundaries in ``cu_seqlens``) through ``segment_attention`` instead of the block-diagonal (T, T) mask.
    Each ``DotProductAttention`` becomes its subclass ``SegmentAttention`` (same state, a ``forward`` that
    takes ``packed_seq_params``); False, and nothing changed, when a layer's attention is not a plain causal
    ``DotProductAttention`` (a learnable softmax offset, a sliding window)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    cores = [m for chunk in chunks for m in chunk.modules() if type(m) is DotProductAttention]
    plain = [m for m in cores if m.softmax_offset is None and getattr(m.config, "window_size", None) is None]
    if not cores or len(plain) != len(cores):
        return False
    cls = _segment_attention_class()
    for module in cores:
        module.__class__ = cls
    return True


@functools.lru_cache(maxsize=None)
def _segment_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SegmentAttention(DotProductAttention):
        """megatron-core's local attention for packed streams: query, key and value (T, heads, head_dim) with
        ``packed_seq_params.cu_seqlens_q`` at the sample boundaries go through ``segment_attention``; without
        ``packed_seq_params`` the parent's masked attention runs."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
            dropout = self.attention_dropout.p if self.training else 0.0
            out = segment_attention(query, key, value, packed_seq_params.cu_seqlens_q, self.softmax_scale, dropout)
            return out.reshape(out.shape[0], self.hidden_size_per_partition)

    return SegmentAttention


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                      scale: float, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention within each segment ``[cu_seqlens[i], cu_seqlens[i + 1])`` of a packed stream, by torch's
    ``scaled_dot_product_attention`` per segment (flash or memory-efficient kernels on CUDA): memory grows with
    the longest segment, never with the (T, T) mask of the stream. query (T, heads, d); key and value (T, groups,
    d) with heads a multiple of groups (grouped-query attention) -> (T, heads, d)."""
    heads, groups = query.shape[1], key.shape[1]
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(query)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b <= a:
            continue
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))  # (heads or groups, n, d)
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], dropout_p=dropout, is_causal=True, scale=scale,
            enable_gqa=heads != groups)[0].transpose(0, 1)
    return out


def shape_dict(bridge) -> dict:
    return dataclasses.asdict(bridge) if dataclasses.is_dataclass(bridge) else dict(vars(bridge))


def write_checkpoint_meta(directory: Path, bridge, config, **extra) -> None:
    meta = {"format": "torch_dist", "architecture": getattr(bridge, "architecture", None), "shape": shape_dict(bridge),
            "tensor_model_parallel_size": config.tensor_model_parallel_size,
            "pipeline_model_parallel_size": config.pipeline_model_parallel_size,
            "expert_model_parallel_size": config.expert_model_parallel_size, **extra}
    atomic_write_text(directory / CHECKPOINT_META, json.dumps(meta, indent=1))  # other ranks may be reading it


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
