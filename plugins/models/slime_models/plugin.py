"""``slime_model_bridge`` for the architectures slime supports, chosen by ``hf_config.architectures``.

A bridge here carries the Megatron-style shape of the model (what slime's ``scripts/models/*.sh`` spell
out as MODEL_ARGS), read from the HF config. The megatron training backend that builds models and maps
weights from these bridges is its own issue; this plugin answers the hook and is used by
``slime-core`` to describe models today.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slimecore import hookimpl

SUPPORTED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM", "Glm4ForCausalLM",
             "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class Bridge:
    architecture: str
    shape: dict = field(default_factory=dict)


def _rope_theta(c) -> float | None:
    theta = getattr(c, "rope_theta", None)
    if theta is None and isinstance(getattr(c, "rope_parameters", None), dict):
        theta = c.rope_parameters.get("rope_theta")  # transformers 5 keeps it here
    return theta


def megatron_shape(c) -> dict:
    heads = c.num_attention_heads
    shape = {
        "num_layers": c.num_hidden_layers, "hidden_size": c.hidden_size, "ffn_hidden_size": c.intermediate_size,
        "num_attention_heads": heads, "num_query_groups": getattr(c, "num_key_value_heads", None) or heads,
        "kv_channels": getattr(c, "head_dim", None) or c.hidden_size // heads, "vocab_size": c.vocab_size,
        "rotary_base": _rope_theta(c), "norm_epsilon": getattr(c, "rms_norm_eps", None),
        "untie_embeddings_and_output_weights": not getattr(c, "tie_word_embeddings", False),
        "add_qkv_bias": bool(getattr(c, "attention_bias", False)) or c.model_type == "qwen2",
    }
    experts = getattr(c, "num_experts", None) or getattr(c, "n_routed_experts", None)
    if experts:
        shape.update({"num_experts": experts, "moe_router_topk": getattr(c, "num_experts_per_tok", None),
                      "moe_ffn_hidden_size": getattr(c, "moe_intermediate_size", None)})
    return shape


@hookimpl
def slime_model_bridge(config, hf_config):
    architecture = next((a for a in getattr(hf_config, "architectures", None) or [] if a in SUPPORTED), None)
    return Bridge(architecture, megatron_shape(hf_config)) if architecture else None
