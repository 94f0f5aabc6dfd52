"""``slime-core train --help``: the options a person starts with, grouped, each with its type and default;
``--help-all``: every option, Megatron's and SGLang's pass-through flags included.

Written from the option tables (``slimecore.config.CORE_OPTIONS``, the active plugins' ``slime_options``,
``slimecore.trainers.megatron_flags``, SGLang's ``ServerArgs`` read from its source), not from argparse, so that a
default shows as its value and a placeholder says what to type (``--eps-clip FLOAT``, ``--save DIR``).
"""

from __future__ import annotations

import shutil
import textwrap

from slimecore.config import CORE_OPTIONS, Option, json_value
from slimecore.plugins import DEFAULT_PLUGINS

SECTIONS = ("core", "data", "rollout", "algorithm plugin", "backend", "engine", "advanced")
CORE = ("hf_checkpoint", "prompt_data", "task", "rollout_batch_size", "n_samples_per_prompt", "num_rollout",
        "num_epoch", "lr", "seed", "save", "save_interval", "load", "log_dir", "log_level")
BACKEND = ("train_backend", "actor_num_nodes", "actor_num_gpus_per_node", "colocate", "offload", "offload_train",
           "cpu_threads_per_actor")
ENGINE = ("rollout_engine", "rollout_num_gpus", "rollout_num_gpus_per_engine", "offload_rollout", "engines",
          "rollout_host", "use_fault_tolerance", "max_staleness", "update_weights_interval")
BY_GROUP = {"data": "data", "rollout": "rollout", "agent": "rollout", "eval": "rollout", "train": "backend",
            "megatron": "backend", "checkpoint": "backend", "cluster": "advanced"}
# what `--help` shows of each section (the rest is under --help-all); plugin options are always shown
SHORT = set(CORE) | {
    "input_key", "label_key", "apply_chat_template", "rollout_shuffle", "global_batch_size", "micro_batch_size",
    "rollout_temperature", "rollout_top_p", "rollout_max_response_len", "rm_type", "eval_prompt_data",
    "eval_interval", "dynamic_sampling_filter", "max_turns", "train_backend", "actor_num_gpus_per_node", "colocate",
    "bf16", "use_lora", "train_async", "fully_async", "tensor_model_parallel_size", "rollout_engine",
    "rollout_num_gpus", "rollout_num_gpus_per_engine", "update_weight_transport", "ray_address", "use_wandb",
    "log_samples"}
PATHS = {"hf_checkpoint": "DIR", "prompt_data": "FILE", "save": "DIR", "load": "DIR", "log_dir": "DIR",
         "eval_config": "FILE", "sglang_config": "FILE", "save_debug_rollout_data": "TEMPLATE",
         "load_debug_rollout_data": "TEMPLATE", "eval_prompt_data": "NAME FILE", "rm_url": "URL",
         "ray_address": "ADDRESS", "sglang_launch_command": "COMMAND"}


def section(option: Option) -> str:
    """The ``--help`` section of a core option."""
    if option.name in CORE:
        return "core"
    if option.name in BACKEND:
        return "backend"
    if option.name in ENGINE or option.name.startswith(("sglang_", "update_weight")):
        return "engine"
    return BY_GROUP.get(option.group, "advanced")


def metavar(option: Option) -> str:
    """What to type after the flag: its type, or a word saying what it names."""
    if option.type is bool:
        return ""
    if option.choices:
        return "{" + ",".join(map(str, option.choices)) + "}"
    word = PATHS.get(option.name) or {int: "INT", float: "FLOAT", json_value: "JSON"}.get(option.type, "TEXT")
    return {"+": f"{word} [{word} ...]", "*": f"[{word} ...]", "?": f"[{word}]"}.get(option.nargs, word)


def flag_column(option: Option) -> str:
    if option.type is bool:  # a switch named no_* has no negative form
        return option.flag if option.name.startswith("no_") else f"{option.flag}, --no-{option.flag[2:]}"
    return f"{option.flag} {metavar(option)}"


def _value(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def default_text(option: Option, quickstart: dict, implied: dict) -> str:
    """``default 0.2``, with the quick start's value (no --prompt-data) and what an active plugin sets."""
    parts = []
    if option.default is not None and option.default != {}:
        parts.append(f"default {_value(option.default)}")
    if option.name in quickstart:
        value, who = quickstart[option.name]
        parts.append(f"{who}: {_value(value)} without --prompt-data")
    if option.name in implied:
        value, who = implied[option.name]
        parts.append(f"plugin {who!r} sets {_value(value)}")
    return "; ".join(parts)


def _lines(flag: str, text: str, width: int) -> list[str]:
    indent = 34
    body = textwrap.wrap(text, max(30, width - indent)) or [""]
    if len(flag) + 2 >= indent:
        return [f"  {flag}"] + [" " * indent + line for line in body]
    return [f"  {flag:<{indent - 2}}{body[0]}"] + [" " * indent + line for line in body[1:]]


def _option_rows(hooks, declared: dict[str, list[Option]], every: bool):
    """What ``--help`` (``every``: ``--help-all``) lists: by section, each option with its text and the plugins
    declaring it; how many options each section hides; the quick start's and the plugins' values."""
    from slimecore.config import collect_plugin_options
    from slimecore.data.tasks import TASKS

    quickstart = {name: (value, "quick start") for name, value in TASKS[_default_task()].recommended.items()}
    for plugin, values in hooks.slime_quickstart_options().items():
        quickstart.update({name: (value, f"plugin {plugin!r}") for name, value in values.items()})
    implied = {name: (value, plugin) for plugin, values in hooks.slime_implied_options().items()
               for name, value in values.items()}
    rows: dict[str, list[tuple[Option, str, list[str]]]] = {name: [] for name in SECTIONS}
    hidden = dict.fromkeys(SECTIONS, 0)
    for option in CORE_OPTIONS:
        where = section(option)
        if every or option.name in SHORT:
            rows[where].append((option, option.help, []))
        else:
            hidden[where] += 1
    for name, (option, owners) in collect_plugin_options(declared).items():
        if all(owner in DEFAULT_PLUGINS for owner in owners):  # the built-in defaults' (slime's --*-path ...)
            if every:
                rows["advanced"].append((option, option.help, list(owners)))
            else:
                hidden["advanced"] += 1
        else:
            rows["algorithm plugin"].append((option, f"{option.help} ({', '.join(owners)})", list(owners)))
    return rows, hidden, quickstart, implied


def train_help(hooks, declared: dict[str, list[Option]], every: bool = False, width: int | None = None) -> str:
    """The text of ``slime-core train --help`` (``every``: ``--help-all``) for the active plugins ``hooks``."""
    width = width or min(120, max(60, shutil.get_terminal_size((100, 24)).columns))
    rows, hidden, quickstart, implied = _option_rows(hooks, declared, every)
    out = ["usage: slime-core train [--plugin NAME ...] [--config FILE] [options]", ""]
    out += _lines("--plugin NAME", "An installed plugin (`slime-core plugins`), a module or a .py file; repeat it "
                  "for several. Its options are listed under 'algorithm plugin'.", width)
    out += _lines("--config FILE", "A YAML file of options (a run folder's config.yaml replays that run); the "
                  "command line overrides it.", width)
    out += _lines("--help-all", "Every option, Megatron's and SGLang's pass-through flags included.", width)
    for name in SECTIONS:
        if not rows[name] and not hidden[name]:
            continue
        more = f" ({hidden[name]} more under --help-all)" if hidden[name] else ""
        out += ["", f"{name}{more}:"]
        if name == "algorithm plugin" and not rows[name]:
            out.append("  (none: `slime-core train --plugin grpo --help` shows that plugin's options)")
        for option, text, _ in rows[name]:
            default = default_text(option, quickstart, implied)
            out += _lines(flag_column(option), text + (f" [{default}]" if default else ""), width)
    if every:
        out += passthrough(width)
    else:
        out += [""] + textwrap.wrap("Megatron's flags (--num-layers ...) and SGLang's server arguments "
                                    "(--sglang-<field>) pass through too; --help-all lists them.", width)
    return "\n".join(out) + "\n"


TYPES = {bool: "bool", int: "int", float: "float", str: "str", json_value: "json"}


def train_help_json(hooks, declared: dict[str, list[Option]], every: bool = False) -> list[dict]:
    """``train --help --json`` (``every``: ``--help-all --json``): the options the text lists, one object each with
    the keys ``flag, name, section, type, choices, nargs, default, quickstart, implied, plugins, target, help``
    (``quickstart``: the quick start's value, ``implied``: what an active plugin sets, ``plugins``: the plugins
    declaring it). With ``every`` also Megatron's pass-through flags (section ``megatron``, ``target`` the config
    field they set) and SGLang's ``--sglang-<field>`` (section ``sglang``); null where a key does not apply."""
    rows, _, quickstart, implied = _option_rows(hooks, declared, every)
    out = [{"flag": option.flag, "name": option.name, "section": name,
            "type": TYPES.get(option.type, getattr(option.type, "__name__", "str")),
            "choices": list(option.choices) if option.choices else None, "nargs": option.nargs,
            "default": option.default, "quickstart": quickstart.get(option.name, (None,))[0],
            "implied": implied.get(option.name, (None,))[0], "plugins": owners, "target": None, "help": option.help}
           for name in SECTIONS for option, _, owners in rows[name]]
    if every:
        megatron, sglang = _passthrough_fields()
        blank = {"choices": None, "nargs": None, "default": None, "quickstart": None, "implied": None, "plugins": []}
        out += [{**blank, "flag": flag, "name": field.name, "section": "megatron", "type": field.kind,
                 "choices": list(field.choices) if getattr(field, "choices", None) else None,
                 "target": f"{field.target or 'Megatron-LM'}.{field.name}", "help": ""} for flag, field in megatron]
        out += [{**blank, "flag": flag, "name": flag[2:].replace("-", "_"), "section": "sglang", "type": None,
                 "target": f"ServerArgs.{flag.removeprefix('--sglang-').replace('-', '_')}", "help": ""}
                for flag in sglang or []]
    return out


def _default_task() -> str:
    return next(o.default for o in CORE_OPTIONS if o.name == "task")


def _passthrough_fields() -> tuple[list | None, list[str] | None]:
    """Megatron's pass-through flags as (flag, field) pairs and SGLang's ``--sglang-<field>`` flags (each None
    when that package is not installed here)."""
    from slimecore.trainers.megatron_args import known_fields
    from slimecore.sglang_schema import OWNED, server_args_fields

    core = {o.flag for o in CORE_OPTIONS}
    try:
        fields = known_fields()
        megatron = sorted((getattr(f, "flag", "") or "--" + name.replace("_", "-"), f) for name, f in fields.items())
        megatron = [(flag, field) for flag, field in megatron if flag not in core]
    except ImportError:
        megatron = None
    fields = server_args_fields()
    sglang = None if fields is None else ["--sglang-" + n.replace("_", "-") for n in sorted(fields) if n not in OWNED]
    return megatron, sglang


def passthrough(width: int) -> list[str]:
    """The Megatron flags slime-core passes to megatron-core (``--train-backend megatron``) and SGLang's
    ``ServerArgs`` fields (``--sglang-<field>``, ``--rollout-engine sglang``)."""
    kinds = {"int": "INT", "float": "FLOAT", "str": "TEXT", "freq": "PATTERN", "tuple": "VALUES", "none": "VALUE"}
    megatron, sglang = _passthrough_fields()
    out = ["", "megatron (--train-backend megatron; each sets its megatron-core config field):"]
    if megatron is None:
        out.append("  (megatron-core is not installed here)")
    for flag, field in megatron or []:
        choices = getattr(field, "choices", None)
        word = "" if field.kind == "bool" else "{" + ",".join(map(str, choices)) + "}" if choices \
            else kinds.get(field.kind, str(field.kind).upper())
        out += _lines(f"{flag} {word}".rstrip(), f"-> {field.target or 'Megatron-LM'}.{field.name}", width)
    out += ["", "sglang (--rollout-engine sglang; --sglang-<field> VALUE sets ServerArgs.<field> of every engine):"]
    if sglang is None:
        return out + ["  (sglang is not installed here: its fields are checked where it is)"]
    out += textwrap.wrap(", ".join(sglang), width - 2, initial_indent="  ", subsequent_indent="  ",
                         break_on_hyphens=False)
    return out
