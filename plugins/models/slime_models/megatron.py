"""The Megatron side of a bridge: build a megatron-core ``GPTModel`` for an HF architecture and move weights
between HF safetensors and Megatron (TP/PP/EP aware), with mbridge 0.15 underneath.

``Bridge.megatron(hf_config, ...)`` returns a ``MegatronModel``; the ``megatron`` training backend and the
``slime-core convert`` commands use only its members ``config``, ``packing``, ``build``, ``load_hf_weights`` and
``export_hf_weights``, so another plugin's bridge can answer with its own object.

What this adds to mbridge (as a subclass of its bridge per model), and why:
- Without Transformer Engine (CPU, or a GPU without TE) the layers come from megatron-core's local spec
  (``use_transformer_engine=False``): mbridge hard-codes TE's spec (``NameError: TENorm``). The local spec keeps
  the two RMSNorms as modules of their own (``input_layernorm``, ``pre_mlp_layernorm``) and the MoE experts as
  ``SequentialMLP`` (``local_experts.N.linear_fcK``), so their names are mapped here to mbridge's TE names.
- transformers 5 keeps ``rope_theta`` in ``rope_parameters``; mbridge reads the attribute.
- Qwen3-MoE: ``norm_topk_prob`` decides whether the top-k router weights are renormalised; mbridge always
  renormalises (``moe_router_pre_softmax=False``). Here ``pre_softmax = not norm_topk_prob``, as HF computes.
- mbridge's Qwen2 bridge writes the tied-embedding name into its class-level mapping, which leaks into every
  later bridge of the process; each ``MegatronModel`` has a subclass, and so a mapping, of its own.
- Dropout is 0 (slime's scripts pass ``--attention-dropout 0 --hidden-dropout 0``): the training forward must
  equal the old-policy forward.
- GLM-4.5: transformers 5 keeps ``partial_rotary_factor`` in ``rope_parameters`` too; without TE its name router
  never reaches the input-norm mapping. Llama 3: mbridge maps every RoPE scaling to linear interpolation; the
  ``llama3`` type is Megatron's ``rope_scaling`` (its fixed constants are checked). DeepSeek V3: mbridge's config
  does not construct under megatron-core 0.16 (``max_position_embeddings`` became
  ``original_max_position_embeddings``; YaRN settings are read from ``rope_parameters`` here); its
  multi-token-prediction layers are not built (not trained in RL).
- MoE: no auxiliary load-balancing loss (``moe_router_load_balancing_type="none"``), the RL loss alone, as mbridge
  already sets for Qwen-MoE and DeepSeek; expert-bias updates stay as mbridge sets them.
- Group-limited routing (HF ``n_group`` / ``topk_group``: DeepSeek V3 / R1, any GLM-4.5-kind config with groups):
  mbridge 0.15.1 passes neither to megatron-core for GLM-4.5 or DeepSeek V3, so every expert stayed eligible and
  tokens went to experts HF never picks (a tiny GLM-4.6-kind config with 2 groups, 1 kept: logits 0.056 off HF's).
  Here they are ``moe_router_num_groups`` / ``moe_router_group_topk``. HF ranks a group by the sum of its top-2
  scores, megatron-core by its top-(topk / group_topk): a config where those differ is refused.

Verified on CPU in fp32 against HF (logits within 1e-6, export exact): Qwen2 (tied and untied), Qwen3, Qwen3-MoE (both
router variants, EP = 2), Llama (with llama3 RoPE scaling), GLM-4.5 MoE, and the GLM-4.5-355B / 4.6 / 4.7 kind (q/k
norms, routed scaling 2.5, group-limited routing). DeepSeek V3 builds only with Transformer
Engine (megatron-core 0.16.1's local MLA spec is broken) and has not been run. GLM-4 dense (``Glm4ForCausalLM``: extra
post-attention / post-MLP norms) has no mapping in mbridge 0.15.1 and raises a clear error.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from typing import Any, Iterator

import torch

MBRIDGE_MODEL_TYPES = {  # HF architecture -> the mbridge registry key that maps it
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
_LOCAL_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.local_experts\.(?P<id>\d+)\.(?P<fc>linear_fc[12])\.weight$")


_ROPE_FROM_HF = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM")
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_args(architecture: str, rope: dict) -> dict:
    """GPTModel's RoPE-scaling arguments for the HF ``rope_parameters``. mbridge maps every scaling to linear
    interpolation by ``factor``, which is wrong for Llama 3.1's ``llama3`` type; Megatron implements that one with
    ``rope_scaling=True`` but hard-codes its other three constants, so they are checked."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {}
    if kind == "linear":
        return {"seq_len_interpolation_factor": float(rope["factor"])}
    if kind == "llama3":
        differ = {k: rope.get(k) for k, v in _MEGATRON_LLAMA3_ROPE.items() if float(rope.get(k, v)) != v}
        if differ:
            raise NotImplementedError(f"{architecture}: llama3 RoPE scaling with {differ}; megatron-core's GPTModel "
                                      f"implements only {_MEGATRON_LLAMA3_ROPE}")
        return {"rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}
    raise NotImplementedError(f"{architecture}: RoPE type {kind!r} (rope_parameters {rope}) has no megatron-core "
                              "GPTModel equivalent here; supported: default, linear, llama3")


def _adapted(base: type, architecture: str, hf: Any, rope: dict, local_spec: bool) -> type:
    """A subclass of mbridge's bridge for ``architecture`` with the fixes in the module docstring (a class per
    model, so nothing leaks between models of one process)."""
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    attrs: dict[str, Any] = {"_DIRECT_MAPPING": {**base._DIRECT_MAPPING, "output_layer.weight":
                                                 "model.embed_tokens.weight" if tied else "lm_head.weight"}}
    if architecture in _ROPE_FROM_HF:
        rope_args = _rope_args(architecture, rope)

        def gptmodel_args(self):
            args = base._get_gptmodel_args(self)
            args.pop("seq_len_interpolation_factor", None)
            return {**args, **rope_args}

        attrs["_get_gptmodel_args"] = gptmodel_args
    if architecture == "DeepseekV3ForCausalLM":
        attrs["TransformerConfigClass"] = staticmethod(_mla_config(base.TransformerConfigClass, rope))
    if local_spec:
        attrs.update(_local_spec_members(base, architecture))
    return type(f"SlimeCore{base.__name__}", (base,), attrs)


def _mla_config(make, rope: dict):
    """DeepSeek V3's rotary settings for megatron-core 0.16's ``MLATransformerConfig``: mbridge 0.15.1 reads them
    from ``rope_scaling`` (absent in transformers 5, so YaRN would be dropped silently) and passes
    ``max_position_embeddings``, which that config calls ``original_max_position_embeddings``."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise NotImplementedError(f"DeepseekV3ForCausalLM: RoPE type {kind!r}; supported: default, yarn")

    def config(**kwargs):
        kwargs.pop("max_position_embeddings", None)
        if kind == "default":
            kwargs.update(rope_type="rope", rotary_scaling_factor=1.0)
        else:
            kwargs.update(rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                          original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                          beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)),
                          mscale=float(rope.get("mscale", 1.0)), mscale_all_dim=float(rope.get("mscale_all_dim", 0)))
        return make(**kwargs)

    return config


def _local_spec_members(base: type, architecture: str) -> dict[str, Any]:
    """Without Transformer Engine: megatron-core's local spec, and its module names mapped onto mbridge's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    def layer_spec(self, vp_stage=None):
        self.has_vp_stage = True
        return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, normalization="RMSNorm",
                                          vp_stage=vp_stage)

    def local_to_global(self, model, consider_ep: bool = True) -> dict[str, str]:
        """SequentialMLP names -> the TEGroupedMLP names mbridge maps (``linear_fc1.weight{expert}``); the expert id
        is global when ``consider_ep``, local otherwise (mbridge's export adds the EP offset itself)."""
        names = base._weight_name_mapping_mcore_local_to_global(self, model, consider_ep)
        per_rank = (self.config.num_moe_experts or 0) // max(self.mpu.ep_size, 1)
        offset = per_rank * self.mpu.ep_rank if consider_ep else 0
        for local, name in names.items():
            match = _LOCAL_EXPERT.match(name)
            if match:
                names[local] = f"{match['prefix']}.{match['fc']}.weight{int(match['id']) + offset}"
        return names

    members = {
        "_get_transformer_layer_spec": layer_spec,
        "_weight_name_mapping_mcore_local_to_global": local_to_global,
        # the local spec's own norm modules (TE fuses them into linear_qkv / linear_fc1)
        "_OTHER_MAPPING": {**base._OTHER_MAPPING,
                           "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]},
        "_MLP_MAPPING": {**base._MLP_MAPPING,
                         "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]},
    }
    if architecture == "Glm4MoeForCausalLM":  # its name router never reaches the "other" mapping
        def to_hf(self, name: str) -> list[str]:
            if ".input_layernorm." in name:
                return self._weight_name_mapping_other(name)
            return base._weight_name_mapping_mcore_to_hf(self, name)

        members["_weight_name_mapping_mcore_to_hf"] = to_hf
    return members


def _group_routing(shape: Any) -> dict:
    """megatron-core's group-limited routing for the shape's ``moe_router_num_groups`` / ``moe_router_group_topk``
    (HF ``n_group`` / ``topk_group``); nothing with one group, where every expert is eligible anyway."""
    groups, keep = getattr(shape, "moe_router_num_groups", None) or 1, getattr(shape, "moe_router_group_topk", None)
    if groups <= 1:
        return {}
    if shape.moe_router_topk != 2 * keep:
        raise NotImplementedError(
            f"{shape.architecture}: group-limited routing with {shape.moe_router_topk} experts per token from "
            f"{keep} of {groups} groups: HF ranks a group by the sum of its top-2 expert scores, megatron-core by its "
            f"top-{shape.moe_router_topk // keep}, so they would route differently; train it with --train-backend "
            "fsdp")
    return {"moe_router_num_groups": groups, "moe_router_group_topk": keep}


def has_transformer_engine() -> bool:
    """TE's layers need CUDA; without either, the local (pure megatron-core) spec is used."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


class MegatronModel:
    """Megatron model factory and weight mapper for one HF config, in the current ``parallel_state``.

    - ``config``: the megatron-core ``TransformerConfig``;
    - ``packing``: ``"thd"`` (TE attention reads ``PackedSeqParams`` with ``cu_seqlens``) or ``"mask"`` (the
      local attention takes a block-diagonal causal mask over the same packed stream);
    - ``build(ddp_config)``: the model chunks (one per virtual pipeline stage), DDP-wrapped when ``ddp_config``
      is given, weights random until ``load_hf_weights``;
    - ``load_hf_weights(models, directory)``: HF safetensors -> every rank's shards (TP scatter, PP/EP slicing);
    - ``export_hf_weights(models)``: yields ``(hf_name, full tensor)``; collective over the TP, PP and EP groups,
      every rank receives every tensor.
    """

    def __init__(self, shape: Any, hf_config: Any, *, dtype: torch.dtype = torch.float32,
                 overrides: dict | None = None):
        architecture = shape.architecture
        if architecture not in MBRIDGE_MODEL_TYPES:
            raise NotImplementedError(
                f"{architecture}: no HF<->Megatron weight mapping exists for it in mbridge 0.15.1 (GLM-4 dense has "
                "post-attention and post-MLP norms that Megatron's GPT layer lacks); train it with "
                "--train-backend fsdp, or answer slime_model_bridge for it from a plugin with its own mapping")
        overrides = dict(overrides or {})
        self.uses_transformer_engine = has_transformer_engine()
        if architecture == "DeepseekV3ForCausalLM" and not self.uses_transformer_engine:
            raise NotImplementedError(
                "DeepseekV3ForCausalLM (multi-latent attention) needs Transformer Engine and CUDA: megatron-core "
                "0.16.1's local MLA layer spec does not build (DotProductAttention takes no k_channels)")
        if overrides.get("sequence_parallel") and not self.uses_transformer_engine:
            raise ValueError("--sequence-parallel needs Transformer Engine (and CUDA): megatron-core's local layer "
                             "spec uses torch norms, which do not support it; drop --sequence-parallel")
        from mbridge.core.bridge import _MODEL_REGISTRY

        hf = copy.deepcopy(hf_config)
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        for key in ("rope_theta", "partial_rotary_factor"):  # transformers 5 keeps them in rope_parameters
            if getattr(hf, key, None) is None and key in rope:
                setattr(hf, key, rope[key])
        self.hf_config, self.shape = hf, shape
        self.packing = "thd" if self.uses_transformer_engine else "mask"
        base = _MODEL_REGISTRY[MBRIDGE_MODEL_TYPES[architecture]]
        bridge_class = _adapted(base, architecture, hf, rope, local_spec=not self.uses_transformer_engine)
        self.mbridge = bridge_class(hf, dtype=dtype)
        extra: dict[str, Any] = {"attention_dropout": 0.0, "hidden_dropout": 0.0,
                                 "use_cpu_initialization": not torch.cuda.is_available()}
        if shape.num_experts:  # the RL loss alone: no auxiliary load-balancing loss (GLM-4.5's mbridge default has one)
            extra["moe_router_load_balancing_type"] = "none"
        if architecture == "Qwen3MoeForCausalLM":
            extra["moe_router_pre_softmax"] = not bool(getattr(hf, "norm_topk_prob", False))
        extra.update(_group_routing(shape))
        if architecture == "DeepseekV3ForCausalLM":  # the multi-token-prediction layers are not trained
            extra["mtp_num_layers"] = None
        if not self.uses_transformer_engine:  # no TE/Apex kernels: torch norms, softmax and per-expert MLPs
            extra.update(persist_layer_norm=False, moe_grouped_gemm=False, masked_softmax_fusion=False)
        self.mbridge.set_extra_args(**{**extra, **overrides})  # the run's Megatron arguments win
        self.config = self.mbridge.config

    # -- what the backend uses ------------------------------------------------------------
    def build(self, ddp_config: dict | None = None) -> list[torch.nn.Module]:
        """Model chunks in ``config.params_dtype`` (fp32 unless ``--bf16``), DDP-wrapped when ``ddp_config`` is a
        dict of ``DistributedDataParallelConfig`` fields. Weights are random until ``load_hf_weights``."""
        bf16 = self.config.params_dtype == torch.bfloat16
        return self.mbridge.get_model(wrap_with_ddp=ddp_config is not None, ddp_config=ddp_config, bf16=bf16,
                                      fp16=False, use_cpu_initialization=not torch.cuda.is_available(),
                                      data_parallel_random_init=False)

    def load_hf_weights(self, models: list[torch.nn.Module], directory: str) -> None:
        self.mbridge.load_weights(models, str(directory))

    def export_hf_weights(self, models: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.mbridge.export_weights(models)
