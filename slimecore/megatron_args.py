"""Megatron arguments on slime-core's command line, as slime passes them to Megatron.

The arguments megatron-core knows are the fields of its three configs: ``TransformerConfig`` (model,
parallelism, recompute, fusions, MoE ...), ``OptimizerConfig`` and ``DistributedDataParallelConfig``; the flag
is the field name with dashes (``--attention-dropout``, ``--moe-router-topk``, ``--optimizer``,
``--overlap-grad-reduce``), a bool field a switch (``--X`` / ``--no-X``). Besides these, the model-description
flags of Megatron-LM's own parser that slime's model scripts use (``--swiglu``, ``--norm-epsilon``,
``--rotary-base``, ``--vocab-size``, ``--untie-embeddings-and-output-weights`` ...) are accepted. Each one is:

- **checked against the HF config** when the checkpoint's ``config.json`` says the same thing (``--num-layers``
  vs ``num_hidden_layers``, ``--num-query-groups`` vs ``num_key_value_heads`` ...): the model is always built
  from the HF checkpoint, so a flag that disagrees is a start-up error naming both;
- **passed through** to megatron-core's config (``--train-backend megatron``) when it is a plain value (bool,
  int, float, string, a choice, a list of ints);
- **taken as a description** of the model the checkpoint already fixes, for the other model-script flags
  (``--group-query-attention``, ``--disable-bias-linear``, ``--position-embedding-type`` ...);
- **refused**, naming it, when its value is not something a flag can carry (a callable, a dtype, ...) or
  slime-core sets it itself (the dtypes from ``--bf16``).

With ``--train-backend fsdp`` only HF-checked flags are accepted (they describe the model); the others name the
megatron backend. Core options (``--tensor-model-parallel-size``, ``--lr``, ``--clip-grad`` ...) keep their own
meaning and are never read from here.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from typing import Any

from slimecore.errors import ConfigError

# megatron flag -> HF config attributes that say the same (first present wins) and how to compare
HF_CHECKED: dict[str, tuple[tuple[str, ...], Any]] = {
    "num_layers": (("num_hidden_layers",), None),
    "hidden_size": (("hidden_size",), None),
    "ffn_hidden_size": (("intermediate_size",), None),
    "num_attention_heads": (("num_attention_heads",), None),
    "num_query_groups": (("num_key_value_heads",), None),
    "kv_channels": (("head_dim",), None),
    "layernorm_epsilon": (("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"), None),
    "norm_epsilon": (("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"), None),
    "num_moe_experts": (("num_experts", "n_routed_experts", "num_local_experts"), None),
    "num_experts": (("num_experts", "n_routed_experts", "num_local_experts"), None),
    "moe_router_topk": (("num_experts_per_tok",), None),
    "moe_ffn_hidden_size": (("moe_intermediate_size",), None),
    "vocab_size": (("vocab_size",), None),
    "rotary_base": (("rope_theta",), None),
    "max_position_embeddings": (("max_position_embeddings",), None),
    "untie_embeddings_and_output_weights": (("tie_word_embeddings",), lambda hf: not hf),
    "swiglu": (("hidden_act",), lambda act: act in ("silu", "swiglu")),
}
# Megatron-LM parser flags of slime's model scripts that are no config field: the type of their value
MODEL_SCRIPT_FLAGS: dict[str, type] = {
    "norm_epsilon": float, "num_experts": int, "vocab_size": int, "rotary_base": float,
    "max_position_embeddings": int, "untie_embeddings_and_output_weights": bool, "swiglu": bool,
    "group_query_attention": bool, "use_rotary_position_embeddings": bool, "disable_bias_linear": bool,
    "position_embedding_type": str, "seq_length": int, "make_vocab_size_divisible_by": int,
    "accumulate_allreduce_grads_in_fp32": bool,
}
# fields that describe the model: never passed through (the bridge builds the model from config.json); checked
# against the bridge's shape (megatron backend) or HF_CHECKED where config.json says the same
MODEL_FIELDS = set(HF_CHECKED) | {"add_qkv_bias", "qk_layernorm", "rotary_percent", "moe_layer_freq",
                                  "moe_shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank",
                                  "qk_pos_emb_head_dim", "v_head_dim", "gated_linear_unit", "add_bias_linear",
                                  "normalization", "multi_latent_attention"}
SET_BY_SLIMECORE = {"params_dtype": "--bf16", "pipeline_dtype": "--bf16", "main_grads_dtype": "--bf16",
                    "main_params_dtype": "--bf16", "exp_avg_dtype": "--bf16", "exp_avg_sq_dtype": "--bf16",
                    "fp16": "--bf16 (fp16 is not supported)", "bf16": "--bf16"}
TARGETS = ("transformer", "optimizer", "ddp")


@dataclasses.dataclass(frozen=True)
class MegatronField:
    name: str
    target: str | None  # "transformer" | "optimizer" | "ddp"; None: a model-script flag (checked, not passed)
    kind: type | None  # bool, int, float, str, list (of int); None: no flag can carry it
    choices: tuple | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _kind(hint) -> tuple[type | None, tuple | None]:
    """(bool | int | float | str | list, choices) for a field's annotation, or (None, None) if no flag fits."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        if all(typing.get_origin(a) in (list, typing.List) or a is int for a in args) and len(args) > 1:
            return list, None
        return _kind(args[0]) if len(args) == 1 else (None, None)
    if origin is typing.Literal:
        return str, tuple(str(a) for a in typing.get_args(hint))
    if origin in (list, typing.List) and args == [int]:
        return list, None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return str, tuple(member.name for member in hint)
    if hint in (bool, int, float, str):
        return hint, None
    return None, None


_FIELDS: dict[str, MegatronField] | None = None


def known_fields() -> dict[str, MegatronField]:
    """Every Megatron argument slime-core knows, by name (imports megatron-core once)."""
    global _FIELDS
    if _FIELDS is None:
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer import TransformerConfig

        fields = {name: MegatronField(name, None, kind) for name, kind in MODEL_SCRIPT_FLAGS.items()}
        for target, cls in zip(TARGETS, (TransformerConfig, OptimizerConfig, DistributedDataParallelConfig)):
            hints = typing.get_type_hints(cls)
            for field in dataclasses.fields(cls):
                if field.name not in fields:
                    fields[field.name] = MegatronField(field.name, target, *_kind(hints[field.name]))
        _FIELDS = fields
    return _FIELDS


def split_megatron_args(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Pull the Megatron arguments out of ``argv`` (what the core parser did not know); return the rest and
    ``{name: value}``. A known argument whose value no flag can carry is refused here."""
    if not any(arg.startswith("--") for arg in argv):
        return argv, {}
    try:
        fields = known_fields()
    except ImportError:
        return argv, {}  # megatron-core is not installed: the caller reports the unknown flags
    rest, values, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg[2:].replace("-", "_").partition("=") if arg.startswith("--") else ("", "", "")
        negated = name.startswith("no_") and name[3:] in fields and fields[name[3:]].kind is bool
        field = fields.get(name[3:] if negated else name)
        if field is None:
            rest.append(arg)
            i += 1
            continue
        if field.name in SET_BY_SLIMECORE or field.kind is None:
            why = (f"slime-core sets it from {SET_BY_SLIMECORE[field.name]}" if field.name in SET_BY_SLIMECORE
                   else f"its value ({field.target} config field {field.name}) is not something a flag can carry")
            raise ConfigError(f"Megatron argument {field.flag} is not accepted: {why}")
        if field.kind is bool:
            values[field.name] = not negated if not eq else inline.lower() in ("1", "true", "yes")
            i += 1
            continue
        taken = [inline] if eq else []
        while not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--") and (field.kind is list or not taken):
            taken.append(argv[i + 1])
            i += 1
        i += 1
        if not taken:
            raise ConfigError(f"Megatron argument {field.flag} needs a value")
        values[field.name] = _convert(field, taken)
    return rest, values


def _convert(field: MegatronField, texts: list[str]) -> Any:
    try:
        if field.kind is list:
            return [int(t) for t in texts]
        value = field.kind(texts[0])
    except ValueError:
        raise ConfigError(f"Megatron argument {field.flag}: {' '.join(texts)!r} is not "
                          f"{'a list of integers' if field.kind is list else 'of type ' + field.kind.__name__}") from None
    if field.choices and value not in field.choices:
        raise ConfigError(f"Megatron argument {field.flag}: {value!r} is not one of {', '.join(field.choices)}")
    return value


def check_against_hf(config, hf_config, shape: Any = None) -> None:
    """Start-up: a flag describing the model must agree with the checkpoint: with the bridge's ``shape`` (the
    megatron backend; its fields are Megatron's names) where it records the field, else with ``config.json``
    (``HF_CHECKED``). With fsdp, pass-through flags are refused."""
    recorded = {f.name for f in dataclasses.fields(shape)} if dataclasses.is_dataclass(shape) else set()
    for name, value in config.megatron_args.items():
        field = known_fields()[name]
        if name in recorded:
            key, expected = f"the {type(shape).__name__} shape's {name}", getattr(shape, name)
        elif name in HF_CHECKED:
            keys, transform = HF_CHECKED[name]
            key = next((k for k in keys if getattr(hf_config, k, None) is not None), None)
            if key is None:
                continue
            expected = transform(getattr(hf_config, key)) if transform else getattr(hf_config, key)
            key = f"config.json's {key} ({getattr(hf_config, key)})"
        else:
            if field.target is not None and name not in MODEL_FIELDS and config.train_backend != "megatron":
                raise ConfigError(f"{field.flag} is a Megatron argument: it applies with --train-backend megatron "
                                  f"(this run uses {config.train_backend})")
            continue
        if not _same(value, expected):
            raise ConfigError(f"Megatron argument {field.flag} {value} disagrees with {config.hf_checkpoint}: "
                              f"{key} is {expected}; the model is built from the checkpoint, so drop the flag or fix it")


def _same(value, expected) -> bool:
    if isinstance(value, float) or isinstance(expected, float):
        return expected is not None and abs(float(value) - float(expected)) <= 1e-9 * max(1.0, abs(float(expected)))
    return value == expected


def megatron_overrides(config, target: str) -> dict[str, Any]:
    """The passed-through Megatron arguments for one of megatron-core's configs (``transformer``, ``optimizer``,
    ``ddp``), values converted to the field's type (enum members by name)."""
    out = {}
    for name, value in config.megatron_args.items():
        field = known_fields()[name]
        if field.target != target or name in MODEL_FIELDS:
            continue
        if field.choices and field.kind is str:
            value = _enum_value(target, name, value)
        out[name] = value
    return out


def _enum_value(target: str, name: str, value: str) -> Any:
    from megatron.core.transformer import TransformerConfig

    hint = typing.get_type_hints(TransformerConfig).get(name) if target == "transformer" else None
    return hint[value] if isinstance(hint, type) and issubclass(hint, enum.Enum) else value
