"""Megatron arguments on slime-core's command line, as slime passes them to Megatron.

slime-core's parser knows every flag Megatron-LM's own parser defines for the model (its network-size, MoE and
multi-latent-attention groups, ``--spec`` ...), every field of megatron-core's ``TransformerConfig``,
``MLATransformerConfig``, ``OptimizerConfig`` and ``DistributedDataParallelConfig`` under Megatron-LM's spelling
(``--norm-epsilon``, ``--disable-bias-linear``, ``--no-rope-fusion``) and under the field's own name (``--X`` /
``--no-X`` for a switch), and the flags slime's Megatron patch adds (``--use-gated-attention``, GLM-4's
``--post-self-attn-layernorm`` / ``--post-mlp-layernorm``). Values are read as Megatron-LM reads them: a list for
``nargs`` flags (``--moe-aux-loss-coeff 0`` is one number, as Megatron unwraps it), a Python list expression for
layer patterns (``--moe-layer-freq "[0]*3+[1]*58"`` or ``"[0, 0, 0, 1, ...]"``). The table is
``slimecore.trainers.megatron_flags`` (generated, see the end of this module), so parsing never imports megatron-core.
Each argument is:

- **checked against the model** when it describes it: against the bridge's Megatron values
  (``shape.megatron_values()``; the ``models`` plugin reads them from ``config.json``) where a plugin answers
  ``slime_model_bridge``, else against ``config.json`` directly (``HF_CHECKED``). The model is always built from
  the HF checkpoint, so a flag that disagrees is a start-up error naming both values;
- **passed through** to megatron-core's config (``--train-backend megatron``) when it is a plain setting of
  ``TransformerConfig`` / ``OptimizerConfig`` / ``DistributedDataParallelConfig`` (``--moe-aux-loss-coeff``,
  ``--moe-token-dispatcher-type``, ``--optimizer``, ``--overlap-grad-reduce``);
- **taken as a description** of the model the checkpoint fixes, for Megatron-LM parser flags that set no config
  field and that no bridge value states (``--make-vocab-size-divisible-by``, ``--enable-experimental``);
- **refused**, naming it, when its value is not something a flag can carry (a callable, a dtype, ...) or
  slime-core sets it itself (the dtypes from ``--bf16``).

With ``--train-backend fsdp`` pass-through flags are refused (they name the megatron backend); model-describing
ones are accepted and checked. Core options (``--tensor-model-parallel-size``, ``--lr``, ``--clip-grad`` ...) keep
their own meaning and are never read from here.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from pathlib import Path
from typing import Any, NamedTuple

from slimecore.errors import ConfigError

# megatron dest -> HF config attributes that say the same (first present wins) and how to compare; used when no
# plugin's bridge answers for the checkpoint (a bridge's ``megatron_values()`` knows the architecture's rules)
HF_CHECKED: dict[str, tuple[tuple[str, ...], Any]] = {
    "num_layers": (("num_hidden_layers",), None),
    "hidden_size": (("hidden_size",), None),
    "ffn_hidden_size": (("intermediate_size",), None),
    "num_attention_heads": (("num_attention_heads",), None),
    "num_query_groups": (("num_key_value_heads",), None),
    "kv_channels": (("head_dim",), None),
    "layernorm_epsilon": (("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"), None),
    "num_experts": (("num_experts", "n_routed_experts", "num_local_experts"), None),
    "num_moe_experts": (("num_experts", "n_routed_experts", "num_local_experts"), None),
    "moe_router_topk": (("num_experts_per_tok",), None),
    "moe_ffn_hidden_size": (("moe_intermediate_size",), None),
    "vocab_size": (("vocab_size",), None),
    "max_position_embeddings": (("max_position_embeddings",), None),
    "untie_embeddings_and_output_weights": (("tie_word_embeddings",), lambda hf: not hf),
    "swiglu": (("hidden_act",), lambda act: act in ("silu", "swiglu")),
    "q_lora_rank": (("q_lora_rank",), None),
    "kv_lora_rank": (("kv_lora_rank",), None),
    "qk_head_dim": (("qk_nope_head_dim",), None),
    "qk_pos_emb_head_dim": (("qk_rope_head_dim",), None),
    "v_head_dim": (("v_head_dim",), None),
}
# dests that describe the model: never passed through (the bridge builds the model from config.json), checked
# against the bridge's values or HF_CHECKED; the MLA config's fields (``target == "mla"``) are all of this kind
MODEL_FIELDS = set(HF_CHECKED) | {
    "add_qkv_bias", "qk_layernorm", "rotary_percent", "rotary_base", "rotary_interleaved", "moe_layer_freq",
    "moe_shared_expert_intermediate_size", "gated_linear_unit", "add_bias_linear", "normalization",
    "multi_latent_attention", "layernorm_zero_centered_gamma", "attention_output_gate", "moe_shared_expert_gate",
    "moe_router_score_function", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk", "mtp_num_layers",
    "post_self_attn_layernorm", "post_mlp_layernorm", "linear_attention_freq", "experimental_attention_variant"}
SET_BY_SLIMECORE = {"params_dtype": "--bf16", "pipeline_dtype": "--bf16", "main_grads_dtype": "--bf16",
                    "main_params_dtype": "--bf16", "exp_avg_dtype": "--bf16", "exp_avg_sq_dtype": "--bf16",
                    "fp16": "--bf16 (fp16 is not supported)", "bf16": "--bf16"}
TARGETS = ("transformer", "optimizer", "ddp")
# Megatron-LM's validate_args unwraps a one-element list of these (the config field takes a value or a list)
_ONE_AS_SCALAR = {"moe_router_load_balancing_type", "moe_aux_loss_coeff"}
_PATTERN = re.compile(r"[\d,\[\]()+*\s]+")


class Flag(NamedTuple):
    """One flag of the table: ``--flag`` sets ``dest``; ``store`` is a switch's value."""

    dest: str
    kind: str  # bool | int | float | str | enum | freq (an int or a Python list expression) | tuple | none
    nargs: str | None = None
    choices: tuple | None = None
    store: bool | None = None
    target: str | None = None  # transformer | mla | optimizer | ddp: the megatron-core config; None: parser only


@dataclasses.dataclass(frozen=True)
class MegatronField:
    name: str
    target: str | None
    kind: str
    choices: tuple | None = None
    flag: str = ""


def flag_table() -> dict[str, Flag]:
    """Every Megatron flag slime-core knows (``slimecore.trainers.megatron_flags``, generated; no megatron-core
    import)."""
    global _TABLE
    if _TABLE is None:
        from slimecore.trainers.megatron_flags import FLAGS

        _TABLE = {flag: Flag(*entry) for flag, entry in FLAGS.items()}
    return _TABLE


_TABLE: dict[str, Flag] | None = None
_FIELDS: dict[str, MegatronField] | None = None


def known_fields() -> dict[str, MegatronField]:
    """The Megatron arguments by dest (the field or Megatron-LM namespace name), each with one flag that sets it
    (its own name where there is one)."""
    global _FIELDS
    if _FIELDS is None:
        fields: dict[str, MegatronField] = {}
        for flag, entry in flag_table().items():
            own = flag == "--" + entry.dest.replace("_", "-")
            if entry.dest not in fields or own:
                fields[entry.dest] = MegatronField(entry.dest, entry.target, entry.kind, entry.choices, flag)
        _FIELDS = fields
    return _FIELDS


def flag_for(dest: str, value: Any = None) -> str:
    """The flag a user would have typed for ``dest`` (Megatron-LM's spelling first: ``--norm-epsilon``,
    ``--no-rope-fusion`` for apply_rope_fusion False)."""
    own = "--" + dest.replace("_", "-")
    flags = [flag for flag, entry in flag_table().items() if entry.dest == dest
             and (entry.kind != "bool" or not isinstance(value, bool) or entry.store == value)]
    return min(flags, key=lambda flag: (flag in (own, "--no-" + own[2:]), len(flag)), default=own)


def split_megatron_args(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Pull the Megatron arguments out of ``argv`` (what the core parser did not know); return the rest and
    ``{dest: value}``. A known argument whose value no flag can carry is refused here."""
    table = flag_table()
    rest, values, i = [], {}, 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, inline = arg.partition("=") if arg.startswith("--") else ("", "", "")
        entry = table.get(flag)
        if entry is None:
            rest.append(arg)
            i += 1
            continue
        if entry.dest in SET_BY_SLIMECORE or entry.kind == "none":
            why = (f"slime-core sets it from {SET_BY_SLIMECORE[entry.dest]}" if entry.dest in SET_BY_SLIMECORE
                   else f"its value ({entry.target or 'Megatron-LM'} {entry.dest}) is not something slime-core "
                        "can carry from a flag")
            raise ConfigError(f"Megatron argument {flag} is not accepted: {why}")
        i += 1
        if entry.kind == "bool":
            values[entry.dest] = entry.store if not eq else (inline.lower() in ("1", "true", "yes")) == entry.store
            continue
        taken = [inline] if eq else []
        while not eq and i < len(argv) and not argv[i].startswith("--") and (entry.nargs or not taken):
            taken.append(argv[i])
            i += 1
        if not taken and entry.nargs != "*":
            raise ConfigError(f"Megatron argument {flag} needs a value")
        value = [_convert(flag, entry, text) for text in taken]
        if not entry.nargs:
            value = value[0]
        elif entry.dest in _ONE_AS_SCALAR and len(value) == 1:
            value = value[0]
        values[entry.dest] = value
    return rest, values


def _convert(flag: str, entry: Flag, text: str) -> Any:
    kind = entry.kind
    try:
        if kind == "freq":
            value = int(text) if "[" not in text else _pattern(text)
        elif kind == "tuple":
            value = [int(part) for part in text.strip("()").split(",")]
        else:
            value = {"int": int, "float": float}.get(kind, str)(text)
    except ValueError:
        wanted = {"freq": "an integer or a Python list of integers (\"[0]*3+[1]*58\")",
                  "tuple": "integers separated by commas"}.get(kind, f"of type {kind}")
        raise ConfigError(f"Megatron argument {flag}: {text!r} is not {wanted}") from None
    if entry.choices and value not in entry.choices:
        raise ConfigError(f"Megatron argument {flag}: {value!r} is not one of {', '.join(map(str, entry.choices))}")
    return value


def _pattern(text: str) -> list[int]:
    """Megatron-LM's layer pattern (``"[0]*3+[1]*58"``, ``"([1]*3+[0])*2"``, ``"[0, 0, 1]"``): only digits, commas,
    brackets, ``+`` and ``*``, as its ``_eval_pattern`` allows; evaluated without names."""
    if not _PATTERN.fullmatch(text):
        raise ValueError(text)
    try:
        value = eval(compile(text, "<pattern>", "eval"), {"__builtins__": {}}, {})  # noqa: S307 - digits only
    except (SyntaxError, TypeError):
        raise ValueError(text) from None
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise ValueError(text)
    return value


def source_model_args(path: str | Path, env: dict[str, str] | None = None) -> list[str]:
    """The ``MODEL_ARGS`` array a slime model file (``scripts/models/*.sh``) defines, as bash sources it (with
    ``env`` added to the environment: some read ``MODEL_ARGS_NUM_LAYERS`` ...)."""
    import os
    import subprocess

    script = 'source "$1" >/dev/null && printf "%s\\0" "${MODEL_ARGS[@]}"'
    done = subprocess.run(["bash", "-c", script, "bash", str(path)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if done.returncode:
        raise ConfigError(f"{path}: bash could not source it: {done.stderr.strip()[-300:]}")
    return done.stdout.split("\0")[:-1]


def layer_pattern(value: int | list[int], num_layers: int) -> list[int]:
    """``--moe-layer-freq`` as one 0/1 per layer: an int N is one MoE layer every N (Megatron's rule)."""
    if isinstance(value, int):
        return [int(i % value == 0) for i in range(num_layers)]
    return list(value)


def check_against_hf(config, hf_config, shape: Any = None) -> None:
    """Start-up: a flag describing the model must agree with the checkpoint: with ``shape.megatron_values()`` (a
    bridge's Megatron values for this ``config.json``) where it states the dest, else with ``config.json``
    (``HF_CHECKED``). With fsdp, pass-through flags are refused."""
    stated = shape.megatron_values() if callable(getattr(shape, "megatron_values", None)) else {}
    for name, value in config.megatron_args.items():
        found = checkpoint_value(name, stated, hf_config, shape)
        if found is None:
            field = known_fields()[name]
            if field.target in TARGETS and name not in MODEL_FIELDS and config.train_backend != "megatron":
                raise ConfigError(f"{flag_for(name, value)} is a Megatron argument: it applies with --train-backend "
                                  f"megatron (this run uses {config.train_backend})")
            continue
        expected, key = found
        if not agrees(name, value, expected):
            shown = "" if isinstance(value, bool) else " " + _text(value)
            raise ConfigError(f"Megatron argument {flag_for(name, value)}{shown} disagrees with "
                              f"{config.hf_checkpoint}: {key} {_text(expected)}; the model is built from the "
                              "checkpoint, so drop the flag or fix it")


def checkpoint_value(name: str, stated: dict[str, Any], hf_config, shape: Any = None) -> tuple[Any, str] | None:
    """What the checkpoint says for the Megatron dest ``name``, and in whose words: ``stated`` (a bridge's
    ``megatron_values()``) first, else ``config.json`` (``HF_CHECKED``); ``(..., why)`` when megatron-core does
    not read it for this model (anything agrees); None when neither states it."""
    if name in stated:
        return stated[name], f"the {getattr(shape, 'architecture', type(shape).__name__)} bridge's {name} from " \
                             "config.json is"
    if name not in HF_CHECKED:
        return None
    keys, transform = HF_CHECKED[name]
    attr = next((k for k in keys if getattr(hf_config, k, None) is not None), None)
    if attr is None:
        return None
    expected = transform(getattr(hf_config, attr)) if transform else getattr(hf_config, attr)
    return expected, f"config.json's {attr} " + (f"({getattr(hf_config, attr)}) gives" if transform else "is")


def agrees(name: str, value: Any, expected: Any) -> bool:
    """A parsed Megatron value against the checkpoint's (``...``: not read for this model, so any value)."""
    if expected is ...:
        return True
    if name == "moe_layer_freq" and isinstance(expected, (list, tuple)):
        value, expected = layer_pattern(value, len(expected)), list(expected)
    return _same(value, expected)


def _text(value) -> str:
    if isinstance(value, list) and len(value) > 8:
        return f"[{', '.join(map(str, value[:8]))}, ... ({len(value)} values)]"
    return str(value)


def _same(value, expected) -> bool:
    if isinstance(value, list) or isinstance(expected, (list, tuple)):
        return isinstance(value, list) and isinstance(expected, (list, tuple)) and len(value) == len(expected) and \
            all(_same(a, b) for a, b in zip(value, expected))
    if isinstance(value, float) or isinstance(expected, float):
        return expected is not None and not isinstance(expected, (bool, str)) and \
            abs(float(value) - float(expected)) <= 1e-9 * max(1.0, abs(float(expected)))
    return value == expected


def megatron_overrides(config, target: str) -> dict[str, Any]:
    """The passed-through Megatron arguments for one of megatron-core's configs (``transformer``, ``optimizer``,
    ``ddp``), values converted to the field's type (enum members by name)."""
    out = {}
    for name, value in config.megatron_args.items():
        field = known_fields()[name]
        if field.target != target or name in MODEL_FIELDS:
            continue
        if field.kind == "enum":
            value = _enum_value(target, name, value)
        out[name] = value
    return out


def _enum_value(target: str, name: str, value: str) -> Any:
    from megatron.core.transformer import TransformerConfig

    hint = typing.get_type_hints(TransformerConfig).get(name) if target == "transformer" else None
    return hint[value] if isinstance(hint, type) and issubclass(hint, enum.Enum) else value

# ---------------------------------------------------------------------------------------------------------------
# The flag table (slimecore/trainers/megatron_flags.py) is generated, so the parser knows Megatron's flags without
# importing megatron-core (8 s and a screen of "Transformer Engine and Apex are not installed" warnings on a CPU
# machine). `python -m slimecore.trainers.megatron_args MEGATRON_LM_ARGUMENTS_PY` regenerates it from the installed
# megatron-core and Megatron-LM's parser source of the same release; tests/test_megatron_args.py does so and compares.

# Megatron-LM parser groups whose every flag describes the model (the rest of its parser is its own training loop,
# data and logging, which slime-core does itself); outside them, a flag is in the table when it sets a field of one
# of megatron-core's configs, or is named here.
_MODEL_GROUPS = ("_add_network_size_args", "_add_moe_args", "_add_mla_args", "_add_experimental_attention_variant_args")
_NAMED_FLAGS = ("--spec", "--enable-experimental", "--vocab-size", "--seq-length",
                "--accumulate-allreduce-grads-in-fp32")
# Flags slime's Megatron patch (docker/patch/latest/megatron.patch and the earlier ones its model files are written
# for) adds: Qwen3-Next's gated attention, GLM-4's extra norms (TransformerConfig fields in the patched version).
SLIME_PATCH_FLAGS = {"--use-gated-attention": ("use_gated_attention", "bool", None, None, True, None),
                     "--post-self-attn-layernorm": ("post_self_attn_layernorm", "bool", None, None, True, None),
                     "--post-mlp-layernorm": ("post_mlp_layernorm", "bool", None, None, True, None)}
_TYPE_KINDS = {"int": "int", "float": "float", "str": "str", "moe_freq_type": "freq", "no_rope_freq_type": "freq",
               "la_freq_type": "freq", "tuple_type": "tuple"}


def _config_classes():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return {"transformer": TransformerConfig, "mla": MLATransformerConfig, "optimizer": OptimizerConfig,
            "ddp": DistributedDataParallelConfig}


def _hint_kind(hint) -> tuple[str, str | None, tuple | None]:
    """(kind, nargs, choices) of a config field's annotation, as a flag carries it; kind "none" if none can."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if len(args) == 1:
            return _hint_kind(args[0])
        if set(args) == {int} | {a for a in args if typing.get_origin(a) in (list, typing.List)} and \
                all(typing.get_args(a) == (int,) for a in args if a is not int):
            return "freq", None, None  # int | list[int]: an int or a Python list expression, as Megatron-LM's
        return "none", None, None
    if origin is typing.Literal:
        return type(args[0]).__name__, None, tuple(args)
    if origin in (list, typing.List) and len(args) == 1:
        kind, _, choices = _hint_kind(args[0])
        return (kind, "+", choices) if kind in ("int", "float", "str") else ("none", None, None)
    if origin in (tuple, typing.Tuple) and args and all(a is int for a in args):
        return "tuple", None, None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "enum", None, tuple(member.name for member in hint)
    if hint in (bool, int, float, str):
        return hint.__name__, None, None
    return "none", None, None


def _megatron_lm_parser(source: str) -> tuple[list[str], list[tuple[str, dict]], dict[str, str]]:
    """From Megatron-LM's ``arguments.py``: the TransformerConfig fields its parser leaves out (``exclude``),
    ``(function, add_argument keywords + flags)`` for every literal ``add_argument`` call, and the renames of
    ``core_transformer_config_from_args`` (``kw_args['num_layers_in_first_pipeline_stage'] =
    args.decoder_first_pipeline_num_layers``: namespace dest -> config field)."""
    import ast

    tree = ast.parse(source)
    exclude: list[str] = []
    calls: list[tuple[str, dict]] = []
    renames: dict[str, str] = {}
    for function in (node for node in tree.body if isinstance(node, ast.FunctionDef)):
        for node in ast.walk(function):
            if (function.name == "core_transformer_config_from_args" and isinstance(node, ast.Assign)
                    and isinstance(node.targets[0], ast.Subscript) and getattr(node.targets[0].value, "id", "") ==
                    "kw_args" and isinstance(node.targets[0].slice, ast.Constant) and isinstance(node.value,
                    ast.Attribute) and getattr(node.value.value, "id", "") == "args"
                    and node.value.attr != node.targets[0].slice.value):
                renames[node.value.attr] = node.targets[0].slice.value
            if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "exclude" for t in node.targets)
                    and function.name == "_add_network_size_args"):
                exclude = ast.literal_eval(node.value)
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
                continue
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            keywords = {}
            for keyword in node.keywords:
                value = keyword.value
                if isinstance(value, ast.Name):
                    keywords[keyword.arg] = value.id
                else:
                    try:
                        keywords[keyword.arg] = ast.literal_eval(value)
                    except ValueError:
                        keywords[keyword.arg] = None
            if flags:
                calls.append((function.name, {"flags": flags, **keywords}))
    return exclude, calls, renames


def generate_flag_table(arguments_source: str) -> dict[str, tuple]:
    """``{flag: (dest, kind, nargs, choices, store, target)}`` from the installed megatron-core's configs and
    Megatron-LM's parser source: every config field under its own name (a bool as ``--X`` / ``--no-X``), then
    Megatron-LM's spelling of it (``ArgumentGroupFactory`` for TransformerConfig, its hand-written flags), then
    slime's patch flags; a later source wins for the same flag."""
    classes = _config_classes()
    owner: dict[str, str] = {}
    hints: dict[str, Any] = {}
    for target, cls in classes.items():
        class_hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if field.name.startswith("_"):
                continue
            owner.setdefault(field.name, target)
            hints.setdefault(field.name, class_hints[field.name])
    table: dict[str, tuple] = {}
    for name, target in owner.items():
        kind, nargs, choices = _hint_kind(hints[name])
        flag = "--" + name.replace("_", "-")
        if kind == "bool":
            table[flag] = (name, kind, None, None, True, target)
            table["--no-" + flag[2:]] = (name, kind, None, None, False, target)
        else:
            table[flag] = (name, kind, nargs, choices, None, target)
    exclude, calls, renames = _megatron_lm_parser(arguments_source)
    transformer = classes["transformer"]
    for field in dataclasses.fields(transformer):  # ArgumentGroupFactory(TransformerConfig, exclude=...)
        if field.name in exclude or not field.init or field.name.startswith("_"):
            continue
        meta = dict(field.metadata.get("argparse_meta", {}))
        kind, nargs, choices = _hint_kind(hints[field.name])
        if "type" in meta:
            kind = meta["type"].__name__
        nargs = meta.get("nargs", nargs)
        if kind == "bool":
            store = field.default is not True
            names = meta.get("arg_names") or (["--" + field.name.replace("_", "-")] if store else
                                              ["--no-" + field.name.replace("_", "-"),
                                               "--disable-" + field.name.replace("_", "-")])
            for flag in names:
                table[flag] = (field.name, "bool", None, None, store, "transformer")
        else:
            for flag in meta.get("arg_names") or ["--" + field.name.replace("_", "-")]:
                table[flag] = (field.name, kind, nargs, choices, None, "transformer")
    for function, call in calls:
        flags = [f for f in call["flags"] if f.startswith("--")]
        dest = call.get("dest") or flags[0][2:].replace("-", "_")
        if function not in _MODEL_GROUPS and dest not in owner and renames.get(dest) in owner:
            dest = renames[dest]  # a flag Megatron-LM hands to a config field of another name, and only there
        if function not in _MODEL_GROUPS and dest not in owner and not set(flags) & set(_NAMED_FLAGS):
            continue
        action = call.get("action")
        if action in ("store_true", "store_false"):
            entry = (dest, "bool", None, None, action == "store_true", owner.get(dest))
        else:
            kind = _TYPE_KINDS.get(call.get("type") or "str", "none") if action in (None, "store") else "none"
            choices = tuple(call["choices"]) if isinstance(call.get("choices"), (list, tuple)) else None
            entry = (dest, kind, call.get("nargs"), choices, None, owner.get(dest))
        for flag in flags:
            table[flag] = entry
    table.update(SLIME_PATCH_FLAGS)
    return dict(sorted(table.items()))


def write_flag_table(arguments_path: str, out: Path = Path(__file__).with_name("megatron_flags.py")) -> None:
    import importlib.metadata

    table = generate_flag_table(Path(arguments_path).read_text())
    lines = ['"""Megatron\'s flags as its parser defines them, for slime-core\'s parser without importing',
             "megatron-core.",
             "", "GENERATED by `python -m slimecore.trainers.megatron_args MEGATRON_LM_ARGUMENTS_PY` from the",
             "installed megatron-core's configs and Megatron-LM's megatron/training/arguments.py of the same",
             "release (kept in tests/megatron_lm/); tests/test_megatron_args.py regenerates it and compares. Do not",
             "edit by hand.",
             "", "flag: (dest, kind, nargs, choices, store (a switch's value), megatron-core config it sets)", '"""',
             "", f"MEGATRON_CORE = {importlib.metadata.version('megatron-core')!r}", "FLAGS = {"]
    lines += [f"    {flag!r}: {entry!r}," for flag, entry in table.items()]
    lines.append("}")
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    import sys

    write_flag_table(sys.argv[1])
