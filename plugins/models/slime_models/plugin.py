"""``slime_model_bridge`` for the architectures slime ships scripts for, chosen by ``hf_config.architectures``.

A bridge here is the model's Megatron-style shape (what slime's ``scripts/models/*.sh`` spell out as
``MODEL_ARGS``), read from the HF config, plus ``Bridge.megatron(hf_config)``: the megatron-core model and the
HF<->Megatron weight mapping the ``megatron`` training backend and ``slime-core convert`` use
(``slime_models.megatron``, mbridge underneath). ``PRESETS`` are the named shapes ``slime-core models`` lists.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from slimecore import hookimpl

SUPPORTED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM", "Glm4ForCausalLM",
             "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM")
# Structural facts the HF config does not state as a field: the modelling code hard-wires them.
_ALWAYS_QKV_BIAS = {"Qwen2ForCausalLM"}
_ALWAYS_QK_NORM = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"}
_MLA = {"DeepseekV3ForCausalLM"}
# routers scoring experts with a sigmoid plus a learnt correction bias, group-limited (HF: e_score_correction_bias)
_SIGMOID_ROUTER = {"Glm4MoeForCausalLM", "DeepseekV3ForCausalLM"}


@dataclass(frozen=True)
class Bridge:
    """Megatron-style shape of one model; field names follow Megatron's flags (``--num-query-groups``...)."""

    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int  # dense MLP width (the dense layers of a MoE model)
    num_attention_heads: int
    num_query_groups: int  # key/value heads (== num_attention_heads without GQA)
    kv_channels: int  # head dim (MLA: the no-position part of the query/key head)
    vocab_size: int
    rotary_base: float
    norm_epsilon: float
    untie_embeddings_and_output_weights: bool
    add_qkv_bias: bool
    qk_layernorm: bool = False
    rotary_percent: float = 1.0  # share of the head dim that is rotated (GLM: 0.5)
    rotary_scaling_factor: float | None = None  # llama3 / yarn context extension factor
    # -- MoE (None for dense models)
    num_experts: int | None = None
    moe_router_topk: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: tuple[int, ...] | None = None  # per layer: 1 = MoE, 0 = dense MLP
    # -- multi-latent attention (DeepSeek V3; None otherwise)
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    # -- MoE routing (None for dense models): score function, expert bias, scaling and group-limited top-k
    moe_router_score_function: str | None = None
    moe_router_enable_expert_bias: bool | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    # -- YaRN attention scaling (multi-latent attention with YaRN RoPE; None otherwise)
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def megatron(self, hf_config: Any, *, dtype=None, overrides: dict | None = None):
        """The megatron-core model factory and weight mapper for ``hf_config`` (``slime_models.megatron``), in the
        current ``parallel_state``. ``hf_config`` must have this shape; a difference is an error naming each field.
        ``overrides`` are ``TransformerConfig`` fields (parallelism, recompute, precision)."""
        import torch

        from slime_models.megatron import MegatronModel

        actual = bridge_for(hf_config)
        if actual is None:
            raise ValueError(f"HF config with architectures {getattr(hf_config, 'architectures', None)} is not one "
                             f"of {', '.join(SUPPORTED)}")
        mismatch = differences(self, actual)
        if mismatch:
            raise ValueError("the HF config does not have this bridge's shape: " + "; ".join(mismatch))
        return MegatronModel(self, hf_config, dtype=dtype or torch.float32, overrides=overrides)

    @property
    def multi_latent_attention(self) -> bool:
        return self.q_lora_rank is not None or self.kv_lora_rank is not None

    def megatron_values(self) -> dict[str, Any]:
        """What this shape fixes, as Megatron-LM's parser names it (dest -> value): the values slime's
        ``scripts/models/*.sh`` must give for this checkpoint. slime-core checks each given flag against them."""
        mla, moe = self.multi_latent_attention, self.num_experts is not None
        values: dict[str, Any] = {
            "num_layers": self.num_layers, "hidden_size": self.hidden_size, "ffn_hidden_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_attention_heads, "vocab_size": self.vocab_size,
            "rotary_base": self.rotary_base, "layernorm_epsilon": self.norm_epsilon,
            "untie_embeddings_and_output_weights": self.untie_embeddings_and_output_weights,
            "add_qkv_bias": self.add_qkv_bias, "qk_layernorm": self.qk_layernorm, "rotary_percent": self.rotary_percent,
            "normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False,
            "position_embedding_type": "rope", "use_rotary_position_embeddings": True,
            "multi_latent_attention": mla, "layernorm_zero_centered_gamma": False, "attention_output_gate": False,
            "use_gated_attention": False, "spec": _SPECS.get(self.architecture),
            # GLM-4 dense: a norm after attention and after the MLP, rotary on interleaved pairs (HF's Glm4 code)
            "post_self_attn_layernorm": self.architecture == "Glm4ForCausalLM",
            "post_mlp_layernorm": self.architecture == "Glm4ForCausalLM",
            "rotary_interleaved": self.architecture == "Glm4ForCausalLM",
            "use_rope_scaling": self.architecture == "LlamaForCausalLM" and self.rotary_scaling_factor is not None,
            "num_experts": self.num_experts, "moe_router_topk": self.moe_router_topk,
            "moe_ffn_hidden_size": self.moe_ffn_hidden_size,
            "moe_shared_expert_intermediate_size": self.moe_shared_expert_intermediate_size,
            "moe_layer_freq": list(self.moe_layer_freq) if self.moe_layer_freq else None,
            "moe_router_score_function": self.moe_router_score_function,
            "moe_router_enable_expert_bias": self.moe_router_enable_expert_bias,
            "moe_router_topk_scaling_factor": self.moe_router_topk_scaling_factor,
            "moe_router_num_groups": self.moe_router_num_groups, "moe_router_group_topk": self.moe_router_group_topk,
            "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
            "qk_pos_emb_head_dim": self.qk_pos_emb_head_dim, "v_head_dim": self.v_head_dim,
            # YaRN's attention scaling: without YaRN RoPE megatron-core does not read them
            "mscale": ... if self.mscale is None else self.mscale,
            "mscale_all_dim": ... if self.mscale_all_dim is None else self.mscale_all_dim,
        }
        if mla:  # Megatron's MLA reads qk_head_dim and never kv_channels (slime's files give 64, 128 or 192)
            values.update(qk_head_dim=self.kv_channels, kv_channels=..., num_query_groups=...)
        else:
            values.update(kv_channels=self.kv_channels, num_query_groups=self.num_query_groups,
                          group_query_attention=self.num_query_groups != self.num_attention_heads)
        factor = self.rotary_scaling_factor
        if values["use_rope_scaling"]:
            values["rope_scaling_factor"] = factor
        values["rotary_scaling_factor"] = 1.0 if factor is None else factor
        if not moe:
            for name in [name for name in values if name.startswith("moe_") and values[name] is None]:
                del values[name]  # a dense model: nothing to compare a MoE flag with but "no MoE" (num_experts)
        return values

    def megatron_args(self) -> list[str]:
        """The shape as Megatron command-line flags, like slime's ``MODEL_ARGS`` (``--num-layers 28 ...``)."""
        args: list[str] = []
        for dest, value in self.megatron_values().items():
            flag = _FLAGS.get(dest, "--" + dest.replace("_", "-"))
            skip = value is None or value is ... or value is False and dest != "add_bias_linear"
            if skip or dest == "rotary_scaling_factor" and not self.multi_latent_attention:
                continue
            if isinstance(value, bool):
                args.append(flag)
            elif dest == "moe_layer_freq":
                args += [flag, _runs(tuple(value))]
            elif isinstance(value, (list, tuple)):
                args += [flag, *map(str, value)]
            else:  # Megatron-LM reads --rotary-base as an int
                args += [flag, str(int(value)) if isinstance(value, float) and value.is_integer() and dest in
                         ("rotary_base",) else str(value)]
        return args


# Megatron-LM's spelling where it is not the dest's own name (``--disable-bias-linear`` sets add_bias_linear False)
_FLAGS = {"layernorm_epsilon": "--norm-epsilon", "add_bias_linear": "--disable-bias-linear",
          "layernorm_zero_centered_gamma": "--apply-layernorm-1p"}
# slime's Megatron layer specs (``--spec MODULE FUNCTION`` in its model files), by the architecture they build; the
# bridge builds that architecture's layers itself, so the flag is checked to name the checkpoint's architecture
_SPECS = {"Glm4ForCausalLM": ["slime_plugins.models.glm4", "get_glm_spec"]}


def _runs(values: tuple[int, ...]) -> str:
    """``(0, 0, 0, 1, 1)`` -> ``[0]*3+[1]*2``, the Python expression slime's scripts pass to ``--moe-layer-freq``."""
    parts: list[str] = []
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            parts.append(f"[{values[start]}]*{i - start}")
            start = i
    return "+".join(parts)


def differences(expected: Bridge, actual: Bridge, expected_name: str = "given", actual_name: str = "HF config"
                ) -> list[str]:
    """``field: given X, HF config Y`` for every field (Megatron flag name) that differs."""
    out = []
    for f in fields(expected):
        a, b = getattr(expected, f.name), getattr(actual, f.name)
        if a != b:
            out.append(f"--{f.name.replace('_', '-')}: {expected_name} {a!r}, {actual_name} {b!r}")
    return out


def _rope(c: Any) -> dict:
    """Rotary settings: transformers 5 keeps them in ``rope_parameters``; 4.x in attributes and ``rope_scaling``."""
    rope = dict(getattr(c, "rope_scaling", None) or {})
    rope.update(getattr(c, "rope_parameters", None) or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in rope and getattr(c, key, None) is not None:
            rope[key] = getattr(c, key)
    return rope


def _moe_layer_freq(c: Any, architecture: str) -> tuple[int, ...]:
    layers = range(c.num_hidden_layers)
    if architecture == "Qwen3MoeForCausalLM":  # MoE every ``decoder_sparse_step`` layers, except ``mlp_only_layers``
        step, dense = getattr(c, "decoder_sparse_step", 1) or 1, set(getattr(c, "mlp_only_layers", None) or ())
        return tuple(int(i not in dense and (i + 1) % step == 0) for i in layers)
    first_dense = getattr(c, "first_k_dense_replace", 0) or 0  # GLM-4.5, DeepSeek V3: the first k layers are dense
    return tuple(int(i >= first_dense) for i in layers)


def bridge_for(hf_config: Any) -> Bridge | None:
    """The bridge of the first supported entry of ``hf_config.architectures``; None if there is none."""
    architecture = next((a for a in getattr(hf_config, "architectures", None) or () if a in SUPPORTED), None)
    if architecture is None:
        return None
    c, rope = hf_config, _rope(hf_config)
    heads = c.num_attention_heads
    fields: dict[str, Any] = dict(
        architecture=architecture, num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
        ffn_hidden_size=c.intermediate_size, num_attention_heads=heads,
        num_query_groups=getattr(c, "num_key_value_heads", None) or heads,
        kv_channels=getattr(c, "head_dim", None) or c.hidden_size // heads, vocab_size=c.vocab_size,
        rotary_base=float(rope["rope_theta"]), norm_epsilon=c.rms_norm_eps,
        untie_embeddings_and_output_weights=not c.tie_word_embeddings,
        add_qkv_bias=architecture in _ALWAYS_QKV_BIAS or bool(getattr(c, "attention_bias", False)),
        qk_layernorm=architecture in _ALWAYS_QK_NORM or bool(getattr(c, "use_qk_norm", False)),
        rotary_percent=float(rope.get("partial_rotary_factor", 1.0)),
        rotary_scaling_factor=rope.get("factor"),
    )
    experts = getattr(c, "num_experts", None) or getattr(c, "n_routed_experts", None)
    if experts:
        shared = getattr(c, "n_shared_experts", None)
        sigmoid = architecture in _SIGMOID_ROUTER
        fields.update(num_experts=experts, moe_router_topk=c.num_experts_per_tok,
                      moe_ffn_hidden_size=c.moe_intermediate_size,
                      moe_shared_expert_intermediate_size=shared * c.moe_intermediate_size if shared else None,
                      moe_layer_freq=_moe_layer_freq(c, architecture),
                      moe_router_score_function="sigmoid" if sigmoid else "softmax",
                      moe_router_enable_expert_bias=sigmoid,  # e_score_correction_bias
                      moe_router_topk_scaling_factor=float(getattr(c, "routed_scaling_factor", None) or 1.0),
                      moe_router_num_groups=getattr(c, "n_group", None) if sigmoid else None,
                      moe_router_group_topk=getattr(c, "topk_group", None) if sigmoid else None)
    if architecture in _MLA:  # HF's ``head_dim`` is the rotary part here; Megatron's kv_channels is the rest
        fields.update(kv_channels=c.qk_nope_head_dim, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                      qk_pos_emb_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim)
        if rope.get("rope_type", rope.get("type")) == "yarn":
            fields.update(mscale=float(rope.get("mscale", 1.0)), mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)))
    return Bridge(**fields)


def _moe_freq(num_layers: int, first_dense: int) -> tuple[int, ...]:
    return (0,) * first_dense + (1,) * (num_layers - first_dense)


def _sigmoid_router(scaling: float, groups: int, group_topk: int) -> dict:
    return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=scaling, moe_router_num_groups=groups, moe_router_group_topk=group_topk)


_SOFTMAX_ROUTER = dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
                       moe_router_topk_scaling_factor=1.0)
_QWEN = dict(vocab_size=151936, rotary_base=1e6, norm_epsilon=1e-6)
# Named shapes, as in slime's scripts/models/<name>.sh (values those scripts leave to Megatron's defaults, such
# as kv_channels = hidden / heads, are filled in from the models' HF configs).
PRESETS: dict[str, Bridge] = {
    "qwen2.5-0.5B": Bridge("Qwen2ForCausalLM", 24, 896, 4864, 14, 2, 64, **_QWEN,
                           untie_embeddings_and_output_weights=False, add_qkv_bias=True),
    "qwen2.5-7B": Bridge("Qwen2ForCausalLM", 28, 3584, 18944, 28, 4, 128, vocab_size=152064, rotary_base=1e6,
                         norm_epsilon=1e-6, untie_embeddings_and_output_weights=True, add_qkv_bias=True),
    "qwen3-4B": Bridge("Qwen3ForCausalLM", 36, 2560, 9728, 32, 8, 128, **_QWEN,
                       untie_embeddings_and_output_weights=False, add_qkv_bias=False, qk_layernorm=True),
    "qwen3-8B": Bridge("Qwen3ForCausalLM", 36, 4096, 12288, 32, 8, 128, **_QWEN,
                       untie_embeddings_and_output_weights=True, add_qkv_bias=False, qk_layernorm=True),
    "qwen3-30B-A3B": Bridge("Qwen3MoeForCausalLM", 48, 2048, 6144, 32, 4, 128, **_QWEN,
                            untie_embeddings_and_output_weights=True, add_qkv_bias=False, qk_layernorm=True,
                            num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                            moe_layer_freq=_moe_freq(48, 0), **_SOFTMAX_ROUTER),
    "llama3.1-8B": Bridge("LlamaForCausalLM", 32, 4096, 14336, 32, 8, 128, vocab_size=128256, rotary_base=5e5,
                          norm_epsilon=1e-5, untie_embeddings_and_output_weights=True, add_qkv_bias=False,
                          rotary_scaling_factor=8.0),
    "glm4-9B": Bridge("Glm4ForCausalLM", 40, 4096, 13696, 32, 2, 128, vocab_size=151552, rotary_base=1e4,
                      norm_epsilon=1e-5, untie_embeddings_and_output_weights=True, add_qkv_bias=True,
                      rotary_percent=0.5),
    "glm4.5-106B-A12B": Bridge("Glm4MoeForCausalLM", 46, 4096, 10944, 96, 8, 128, vocab_size=151552,
                               rotary_base=1e6, norm_epsilon=1e-5, untie_embeddings_and_output_weights=True,
                               add_qkv_bias=True, rotary_percent=0.5, num_experts=128, moe_router_topk=8,
                               moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=1408,
                               moe_layer_freq=_moe_freq(46, 1), **_sigmoid_router(1.0, 1, 1)),
    "deepseek-v3": Bridge("DeepseekV3ForCausalLM", 61, 7168, 18432, 128, 128, 128, vocab_size=129280,
                          rotary_base=1e4, norm_epsilon=1e-6, untie_embeddings_and_output_weights=True,
                          add_qkv_bias=False, qk_layernorm=True, rotary_scaling_factor=40.0, num_experts=256,
                          moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
                          moe_layer_freq=_moe_freq(61, 3), q_lora_rank=1536, kv_lora_rank=512,
                          qk_pos_emb_head_dim=64, v_head_dim=128, **_sigmoid_router(2.5, 8, 4), mscale=1.0,
                          mscale_all_dim=1.0),
    "glm4.5-355B-A32B": Bridge("Glm4MoeForCausalLM", 92, 5120, 12288, 96, 8, 128, vocab_size=151552,
                               rotary_base=1e6, norm_epsilon=1e-5, untie_embeddings_and_output_weights=True,
                               add_qkv_bias=True, qk_layernorm=True, rotary_percent=0.5, num_experts=160,
                               moe_router_topk=8, moe_ffn_hidden_size=1536, moe_shared_expert_intermediate_size=1536,
                               moe_layer_freq=_moe_freq(92, 3), **_sigmoid_router(2.5, 1, 1)),
    "kimi-k2": Bridge("DeepseekV3ForCausalLM", 61, 7168, 18432, 64, 64, 128, vocab_size=163840, rotary_base=5e4,
                      norm_epsilon=1e-6, untie_embeddings_and_output_weights=True, add_qkv_bias=False,
                      qk_layernorm=True, rotary_scaling_factor=32.0, num_experts=384, moe_router_topk=8,
                      moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
                      moe_layer_freq=_moe_freq(61, 1), q_lora_rank=1536, kv_lora_rank=512, qk_pos_emb_head_dim=64,
                      v_head_dim=128, **_sigmoid_router(2.827, 1, 1), mscale=1.0, mscale_all_dim=1.0),
    "moonlight-16B-A3B": Bridge("DeepseekV3ForCausalLM", 27, 2048, 11264, 16, 16, 128, vocab_size=163840,
                                rotary_base=5e4, norm_epsilon=1e-5, untie_embeddings_and_output_weights=True,
                                add_qkv_bias=False, qk_layernorm=True, num_experts=64, moe_router_topk=6,
                                moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2816,
                                moe_layer_freq=_moe_freq(27, 1), kv_lora_rank=512, qk_pos_emb_head_dim=64,
                                v_head_dim=128, **_sigmoid_router(2.446, 1, 1)),
    "llama3.1-70B": Bridge("LlamaForCausalLM", 80, 8192, 28672, 64, 8, 128, vocab_size=128256, rotary_base=5e5,
                           norm_epsilon=1e-5, untie_embeddings_and_output_weights=True, add_qkv_bias=False,
                           rotary_scaling_factor=8.0),
}
# Models of one shape: the same preset under each name (GLM-4.6 / 4.7 are GLM-4.5's architecture and size;
# DeepSeek V3.1 and R1 are V3's; GLM-Z1-9B-0414 is GLM-4-9B-0414's)
PRESETS.update({"glm4.6-355B-A32B": PRESETS["glm4.5-355B-A32B"], "glm4.7-355B-A32B": PRESETS["glm4.5-355B-A32B"],
                "deepseek-v3.1": PRESETS["deepseek-v3"], "deepseek-r1": PRESETS["deepseek-v3"],
                "glm-z1-9B": PRESETS["glm4-9B"]})
# The slime model file (THUDM/slime scripts/models/) whose MODEL_ARGS each preset's shape matches; checked by the
# plugin's tests. llama3.1-70B has none: `slime-core models --show llama3.1-70B` prints its MODEL_ARGS.
SLIME_MODEL_FILES = {
    "qwen2.5-0.5B": "qwen2.5-0.5B.sh", "qwen2.5-7B": "qwen2.5-7B.sh", "qwen3-4B": "qwen3-4B.sh",
    "qwen3-8B": "qwen3-8B.sh", "qwen3-30B-A3B": "qwen3-30B-A3B.sh", "llama3.1-8B": "llama3.1-8B-Instruct.sh",
    "glm4-9B": "glm4-9B.sh", "glm-z1-9B": "glm4-9B.sh", "glm4.5-106B-A12B": "glm4.5-106B-A12B.sh",
    "glm4.5-355B-A32B": "glm4.5-355B-A32B.sh", "glm4.6-355B-A32B": "glm4.5-355B-A32B.sh",
    "glm4.7-355B-A32B": "glm4.5-355B-A32B.sh", "deepseek-v3": "deepseek-v3.sh", "deepseek-v3.1": "deepseek-v3.sh",
    "deepseek-r1": "deepseek-v3.sh", "kimi-k2": "kimi-k2.sh", "moonlight-16B-A3B": "moonlight.sh",
}


@hookimpl
def slime_model_bridge(config, hf_config):
    return bridge_for(hf_config)
