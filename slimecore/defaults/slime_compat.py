"""Built-in slime adapter: slime's ``--*-path`` flags, calling slime users' functions unchanged.

Each flag names a function (dotted path, as slime's ``load_function`` resolves it) with slime's signature; this
plugin's hookimpl for the matching hook is switched on by the flag (``slimecore.plugins.active_when``) and then
answers over any plugin's (a custom loss replaces ``--plugin grpo``'s loss, as in slime). The functions get:

- ``args``: an ``argparse.Namespace`` with slime's attribute names: every core option, every active plugin's
  options (``eps_clip``, ``kl_loss_coef`` ...), ``--sglang-*`` as ``sglang_*``, the router as
  ``sglang_router_ip`` / ``sglang_router_port`` (rollout side), slime's constants that have one meaning here
  (``rollout_global_dataset``, ``loss_type`` ...) and ``--custom-config-path`` YAML entries. Reading an
  attribute slime-core does not have raises AttributeError naming it (``getattr(args, x, default)`` works);
- samples of ``slimecore.types.Sample``: slime's fields, statuses and methods (``from slime.utils.types import
  Sample`` resolves to it through the shim in ``slimecore/compat`` unless THUDM/slime is installed).

Flags with no counterpart here are refused at start-up with what to use instead. ``docs/hooks.md`` has the
table: each flag, its hook, what of slime's semantics it keeps and where it differs. Every other flag of slime's
parser has its fate in ``slimecore.defaults.slime_flags`` (``docs/slime-flags.md``): the refused ones are declared
here, so they parse as in slime and stop the run before Ray with one line; ``--advantage-estimator`` selects the
algorithm plugin and ``--use-opd`` the opd plugin (``algorithm_plugin``), the ``--wandb-*`` ones become W&B's
environment variables, and slime's server-group ``--sglang-config`` form is read by ``slimecore.sglang_schema.server_group_overrides``.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import weakref
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from slimecore import hookimpl
from slimecore.config import FALLBACK_GROUP, ConfigError, Option
from slimecore.defaults.slime_flags import SLIME_FLAGS, Fate, refused_message
from slimecore.plugins import active_when
from slimecore.types import DataSource, FilterResult, RolloutOutput, Sample

if TYPE_CHECKING:  # torch is imported where tensors are made: this plugin loads in the driver, which needs none
    import torch

NAME = "slimecore.defaults.slime_compat"

# flag -> how slime calls it (the help text); all are dotted paths to a function (a class for the data source)
WIRED = {
    "rollout_function_path": "generate_rollout(args, rollout_id, data_source, evaluation=False) -> "
                             "RolloutFnTrainOutput | list[list[Sample]]; replaces the whole rollout.",
    "eval_function_path": "As --rollout-function-path, called with evaluation=True for eval (default: the rollout "
                          "function when that is set).",
    "custom_generate_function_path": "async generate(args, sample, sampling_params[, evaluation]) -> Sample | "
                                     "list[Sample]; replaces the built-in generate.",
    "rollout_sample_hook_path": "hook(args, sample, *, rollout_id, evaluation) -> Sample | None, sync or async; "
                                "after generate, before the reward. Repeatable.",
    "custom_rm_path": "async reward_func(args, sample, **kwargs) -> float | dict (with --group-rm: "
                      "async fn(args, samples) -> list).",
    "dynamic_sampling_filter_path": "filter(args, samples, **kwargs) -> DynamicFilterOutput | bool, per finished "
                                    "group.",
    "rollout_sample_filter_path": "filter(args, groups) -> None, setting sample.remove_sample, once the step's "
                                  "groups are complete.",
    "rollout_all_samples_process_path": "process(args, all_groups, data_source) -> None, over every finished "
                                        "group of the step, filtered ones included.",
    "buffer_filter_path": "buffer_filter(args, rollout_id, buffer, num_samples) -> list[list[Sample]].",
    "data_source_path": "A DataSource class: cls(args) with get_samples, add_samples, save, load, __len__.",
    "custom_reward_post_process_path": "post_process(args, samples) -> (raw_rewards, rewards).",
    "custom_rollout_log_function_path": "log(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> "
                                        "bool (True: drop the default rollout/* metrics).",
    "rollout_data_postprocess_path": "postprocess(args, rollout_id, rollout_data) -> None, on the train side "
                                     "after advantages.",
    "custom_advantage_function_path": "advantages(args, rollout_data) -> None, setting rollout_data['advantages'] "
                                      "and ['returns'].",
    "custom_loss_function_path": "loss(args, batch, logits, sum_of_sample_mean) -> (loss, metrics); replaces the "
                                 "algorithm plugin's policy loss.",
    "custom_megatron_init_path": "init(args) -> None, once in each train process.",
    "custom_config_path": "YAML file whose entries become attributes of args.",
}
# flag -> why it is refused and what to use instead
REFUSED = {
    "custom_convert_samples_to_train_data_path": "slime-core builds the training columns itself (rollout mask sums "
        "and the data-parallel schedule need them); use --custom-reward-post-process-path for the rewards and "
        "--rollout-data-postprocess-path to edit the batch (loss masks, advantages)",
    "custom_eval_rollout_log_function_path": "eval metrics are computed per set and logged as eval/<name>; read "
        "them in a plugin's slime_step_end (driver), or compute your own in --eval-function-path",
    "custom_tis_function_path": "the importance-sampling correction lives in the algorithm plugin; use its options "
        "(--use-tis --tis-mode tis|icepop --tis-clip --tis-clip-low) or write the corrected loss with "
        "--custom-loss-function-path",
    "custom_pg_loss_reducer_function_path": "the loss gets one reducer for every term; for Dr.GRPO use "
        "--disable-grpo-std-normalization, for another divisor write the loss with --custom-loss-function-path",
    "custom_model_provider_path": "models are built from the HF checkpoint through a slime_model_bridge plugin "
        "(--plugin models); add a bridge there for a new architecture",
    "custom_megatron_before_log_prob_hook_path": "the trainers have no hook before each log-prob pass; edit the "
        "batch after log-probs with --rollout-data-postprocess-path",
    "custom_megatron_before_train_step_hook_path": "the trainers have no hook before each optimizer step; use "
        "--rollout-data-postprocess-path (once per rollout, before the optimizer steps)",
    "custom_update_weight_post_write_path": "the disk weight transport writes to a local directory the engines "
        "read directly; there is no post-write hook (use --update-weight-transport object-store on one machine)",
    "megatron_config_path": "per-role Megatron YAML is not read; give Megatron arguments as flags "
        "(--tensor-model-parallel-size ...) and the critic's with the --critic-* options",
}
LOSS_TYPES = ("policy_loss", "custom_loss", "value_loss", "sft_loss")
for _name, _why in REFUSED.items():
    _reason, _, _instead = _why.partition("; ")
    SLIME_FLAGS["--" + _name.replace("_", "-")] = Fate("refused", _reason, _instead)
# slime's other flags with no counterpart: declared so they parse as slime's do (any values), refused when given
REFUSED_FLAGS = {flag[2:].replace("-", "_"): flag for flag, fate in SLIME_FLAGS.items()
                 if fate.kind == "refused" and flag[2:].replace("-", "_") not in REFUSED}
# --advantage-estimator NAME -> the plugin implementing it (slime's names)
ESTIMATOR_PLUGINS = {"grpo": "grpo", "gspo": "gspo", "ppo": "ppo", "reinforce_plus_plus": "ppo",
                     "reinforce_plus_plus_baseline": "ppo"}
WANDB_ENV = {"wandb_key": "WANDB_API_KEY", "wandb_host": "WANDB_BASE_URL", "wandb_team": "WANDB_ENTITY",
             "wandb_run_id": "WANDB_RUN_ID"}


@hookimpl
def slime_options():
    options = [Option(flag, str, None, f"slime: {how}", group="slime")
               for flag, how in WIRED.items() if flag != "rollout_sample_hook_path"]
    options.append(Option("rollout_sample_hook_path", str, None, f"slime: {WIRED['rollout_sample_hook_path']}",
                          nargs="+", action="extend", group="slime"))
    options += [Option(flag, str, None, f"slime: refused here ({why.split(';')[0]}).", group="slime")
                for flag, why in REFUSED.items()]
    options += [Option("loss_type", str, None, "slime's --loss-type: custom_loss with --custom-loss-function-path; "
                       "the others are the algorithm plugin's loss.", choices=LOSS_TYPES, group="slime"),
                Option("slime_sys_path", str, None, "Directories put on sys.path in every process before the "
                       "--*-path functions are imported (default: the directory slime-core was started in).",
                       nargs="+", group="slime")]
    options += [Option(name, str, None, f"slime: refused here ({SLIME_FLAGS[flag].text}).", nargs="*",
                       group=FALLBACK_GROUP) for name, flag in REFUSED_FLAGS.items()]  # a plugin may declare it
    options += [Option(name, str, None, f"slime: sets {env} for W&B.", group="slime") for name, env in WANDB_ENV.items()]
    return options


def _opt(config, flag: str):
    return getattr(config.plugin(NAME), flag, None)


def _when(*flags: str):
    """``active_when`` on any of ``flags`` being set."""
    return active_when(lambda config: any(_opt(config, flag) for flag in flags))


# ---------------------------------------------------------------------------------------------
# slime's flags that choose plugins or engine settings (called by the CLI and sglang_schema)
# ---------------------------------------------------------------------------------------------


def algorithm_plugin(argv: list[str], specs: list[str]) -> tuple[list[str], list[str], str | None]:
    """slime's ``--advantage-estimator NAME``: the plugin implementing NAME joins ``specs`` (before plugins load);
    slime's ``--use-opd`` (with ``--opd-type``, as slime asks) brings the opd plugin. Returns argv without those flags,
    the specs, and NAME (``estimator_argv`` gives the flag back to a plugin that declares it, as ppo does for its
    three estimators)."""
    rest, name, use_opd, i = [], None, False, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--advantage-estimator" and i + 1 < len(argv):
            name, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--advantage-estimator="):
            name = arg.partition("=")[2]
        elif arg == "--use-opd":
            use_opd = True
        else:
            rest.append(arg)
        i += 1
    if use_opd:
        opd_type = _flag_value(rest, "--opd-type")
        if opd_type is None:
            raise ConfigError("--use-opd needs --opd-type, as in slime: --opd-type megatron with --opd-teacher-load "
                              "CKPT (the teacher in the trainer)")
        if opd_type not in SLIME_FLAGS["--opd-type"].accepted:  # before the opd plugin asks for a teacher
            raise ConfigError(refused_message("--opd-type", opd_type))
        specs = _with_plugin(specs, "opd", "--use-opd")
    if name is None:
        return rest, specs, None
    plugin = ESTIMATOR_PLUGINS.get(name)
    if plugin is None:
        raise ConfigError(f"--advantage-estimator {name}: no slime-core algorithm plugin implements it; instead: one of "
                          f"{', '.join(ESTIMATOR_PLUGINS)} (each selects its plugin), or --plugin NAME")
    others = [s for s in specs if s in set(ESTIMATOR_PLUGINS.values()) - {plugin}]
    if others:
        raise ConfigError(f"--advantage-estimator {name} selects plugin {plugin!r}, but --plugin {others[0]} is given "
                          "too; keep one of them")
    return rest, _with_plugin(specs, plugin, f"--advantage-estimator {name}"), name


def _flag_value(argv: list[str], flag: str) -> str | None:
    """``flag``'s value in ``argv`` (``--flag V`` or ``--flag=V``; "" when nothing follows), None when absent."""
    for k, arg in enumerate(argv):
        if arg == flag:
            return argv[k + 1] if k + 1 < len(argv) else ""
        if arg.startswith(flag + "="):
            return arg.partition("=")[2]
    return None


def _with_plugin(specs: list[str], plugin: str, flag: str) -> list[str]:
    """``specs`` with ``plugin``, which slime's ``flag`` selects; a ConfigError if it is not installed."""
    from slimecore.plugins import installed_entry_points

    if plugin in specs:
        return specs
    if plugin not in installed_entry_points():
        raise ConfigError(f"{flag} needs the {'algorithm ' if plugin != 'opd' else ''}plugin {plugin!r}, which is not "
                          f"installed: pip install plugins/{plugin} (distribution slime-core-{plugin})")
    return [*specs, plugin]


def estimator_argv(argv: list[str], declared: dict[str, list[Option]], name: str | None) -> list[str]:
    """``argv`` with ``--advantage-estimator NAME`` again when an active plugin declares that option."""
    if name is not None and any(o.name == "advantage_estimator" for options in declared.values() for o in options):
        return [*argv, "--advantage-estimator", name]
    return argv


# ---------------------------------------------------------------------------------------------
# Loading functions, and slime's args
# ---------------------------------------------------------------------------------------------


SHIM_ROOT = str(Path(__file__).resolve().parents[1] / "compat")  # holds slimecore/compat/slime, the `slime` shim


def install_shim() -> bool:
    """Make ``import slime`` resolve to the shim unless a real slime is installed; True if the shim is used."""
    if SHIM_ROOT in sys.path:
        return True
    if importlib.util.find_spec("slime") is not None:
        return False
    sys.path.append(SHIM_ROOT)
    return True


def _prepare_imports(config) -> None:
    install_shim()
    for directory in _opt(config, "slime_sys_path") or ():
        if directory not in sys.path:
            sys.path.insert(0, directory)


@functools.cache
def load_function(path: str):
    """slime's ``load_function``: ``pkg.module.attr`` imported and looked up (cached)."""
    module, _, attr = path.rpartition(".")
    if not module:
        raise ImportError(f"{path!r} is not a dotted path; write module.function, e.g. my_reward.reward_func "
                          "(the module on sys.path or in the directory you run slime-core from)")
    return getattr(importlib.import_module(module), attr)


def _function(config, flag: str, path: str | None = None):
    _prepare_imports(config)
    return load_function(path or _opt(config, flag))


class SlimeArgs(Namespace):
    """slime's ``args``; a missing attribute is an AttributeError that says so."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"args.{name}: slime's argument {name!r} has no value in slime-core (args holds "
                             "slime-core's options under slime's names, see docs/hooks.md); give it in a "
                             "--custom-config-path YAML file if your function needs it")


_ARGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def make_args(config, client=None) -> SlimeArgs:
    """The ``args`` every function of this run gets (one object per config in a process, so state a function
    keeps on it persists across calls, as in slime)."""
    args = _ARGS.get(config)
    if args is None:
        args = _ARGS[config] = _build_args(config)
    if client is not None:  # the router in use: the run's own, or the external one of --sglang-router-ip/port
        url = urlparse(client.url)
        args.sglang_router_ip, args.sglang_router_port = url.hostname, url.port
    return args


def _build_args(config) -> SlimeArgs:
    state = config.to_dict()
    values = dict(state["values"])
    for plugin_values in state["plugin_values"].values():
        values.update(plugin_values)
    values.update({f"sglang_{key}": value for key, value in state["sglang_args"].items()})
    values.update(
        rollout_global_dataset=True, ci_test=False, sglang_dp_size=None,
        multimodal_keys=None, eval_reward_key=None, allgather_cp=False, log_probs_chunk_size=-1,
        loss_type=values.get("loss_type") or ("custom_loss" if values.get("custom_loss_function_path")
                                              else "policy_loss"),
        rewards_normalization=not values.get("disable_rewards_normalization", False),
        grpo_std_normalization=not values.get("disable_grpo_std_normalization", False),
        rollout_sample_hook_path=values.get("rollout_sample_hook_path") or [],
    )
    if values.get("custom_config_path"):
        from slimecore.config import _load_yaml

        values.update(_load_yaml(values["custom_config_path"]))
    return SlimeArgs(**values)


# ---------------------------------------------------------------------------------------------
# Start-up
# ---------------------------------------------------------------------------------------------


@hookimpl
def slime_validate_config(config):
    """Refused flags, --loss-type, and every given path imported now (before Ray starts)."""
    for flag in REFUSED:
        if _opt(config, flag):
            raise ConfigError(refused_message("--" + flag.replace("_", "-"), _opt(config, flag)))
    for name, flag in REFUSED_FLAGS.items():
        value = _opt(config, name)
        if value is not None and (" ".join(value) not in SLIME_FLAGS[flag].accepted
                                  or (name == "allgather_cp" and config.context_parallel_size > 1)):
            raise ConfigError(refused_message(flag, value))
    loss_type, loss_path = _opt(config, "loss_type"), _opt(config, "custom_loss_function_path")
    if loss_type == "custom_loss" and not loss_path:
        raise ConfigError("--loss-type custom_loss needs --custom-loss-function-path, the loss function to use")
    if loss_path and loss_type not in (None, "custom_loss"):
        raise ConfigError(f"--custom-loss-function-path is given but --loss-type is {loss_type}; use --loss-type "
                          "custom_loss (or leave it out) to train with that function")
    if loss_type in ("sft_loss", "value_loss"):
        raise ConfigError(f"--loss-type {loss_type}: in slime-core that loss is a plugin's; instead: "
                          + ("--plugin sft" if loss_type == "sft_loss" else "--plugin ppo (its critic)"))
    if _opt(config, "slime_sys_path") is None:
        config.__dict__["_plugin_values"].setdefault(NAME, {})["slime_sys_path"] = [os.getcwd()]
    for flag in WIRED:
        paths = _opt(config, flag)
        if not paths or flag == "custom_config_path":
            continue
        for path in paths if isinstance(paths, list) else [paths]:
            _check_function(config, flag, path)
    if _opt(config, "custom_config_path"):
        make_args(config)  # a bad YAML file fails here


def _check_function(config, flag: str, path: str) -> None:
    option = f"--{flag.replace('_', '-')} {path}"
    try:
        fn = _function(config, flag, path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{option}: cannot import it ({type(exc).__name__}: {exc}); slime resolves a dotted path "
                          f"module.function from sys.path (here also {', '.join(_opt(config, 'slime_sys_path'))})") \
            from None
    if flag in ("custom_rm_path", "custom_generate_function_path") and not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{option}: slime awaits this function, so it must be declared `async def`")
    if flag == "data_source_path" and not inspect.isclass(fn):
        raise ConfigError(f"{option}: slime instantiates this path as cls(args); it must name a class")


@hookimpl
def slime_startup(config, process):
    if process == "driver" and config.sglang_router_ip:  # before Ray: the external router must answer
        from slimecore.http_client import http_request

        url = f"http://{config.sglang_router_ip}:{config.sglang_router_port}"
        try:
            http_request("GET", url + "/health", timeout=5)
        except OSError as exc:
            raise ConfigError(f"--sglang-router-ip/--sglang-router-port: no sglang-router answers at {url} ({exc}); "
                              "start it first, or drop both flags and slime-core starts its own") from None
    if process == "driver":  # slime's --wandb-* flags, as the environment wandb.init reads
        for name, env in WANDB_ENV.items():
            if _opt(config, name):
                os.environ[env] = str(_opt(config, name))
        if _opt(config, "wandb_run_id"):
            os.environ.setdefault("WANDB_RESUME", "allow")
    if process == "train" and _opt(config, "custom_megatron_init_path"):
        _function(config, "custom_megatron_init_path")(make_args(config))


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


class SlimeDataSource(DataSource):
    """A ``--data-source-path`` object behind slime-core's DataSource contract. Its ``save(rollout_id)`` runs on
    the steps slime-core checkpoints, its ``load(rollout_id)`` when a run resumes from one."""

    def __init__(self, config, source):
        self.config, self.source, self.rollout_id = config, source, None

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        return self.source.get_samples(num_groups)

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.source.add_samples(groups)

    def __len__(self) -> int:
        return len(self.source)

    def state_dict(self) -> dict:
        c, step = self.config, self.rollout_id
        if c.save and step is not None and ((c.save_interval and (step + 1) % c.save_interval == 0)
                                            or step + 1 == c.num_rollout):
            self.source.save(step)
        return {"slime_data_source": _opt(c, "data_source_path"), "rollout_id": step, "buffer": []}

    def load_state_dict(self, state: dict) -> None:
        self.source.load(state.get("rollout_id"))


@hookimpl
@_when("data_source_path")
def slime_data_source(config):
    return SlimeDataSource(config, _function(config, "data_source_path")(make_args(config)))


@hookimpl
@_when("buffer_filter_path")
def slime_buffer_filter(config, buffer, num_groups):
    return _function(config, "buffer_filter_path")(make_args(config), None, buffer, num_groups)


# ---------------------------------------------------------------------------------------------
# Rollout
# ---------------------------------------------------------------------------------------------

_SEEN_GROUPS: list[list[Sample]] = []  # every group the group filter saw this step (--rollout-all-samples-...)


@hookimpl
@_when("rollout_function_path", "eval_function_path")
def slime_rollout(config, rollout_id, data_source, client, evaluation):
    """slime's rollout function for this call (the eval function, else the rollout function, in eval), or None to
    pass the call on (only ``--eval-function-path`` given, in training) to the plugin's or built-in rollout. A plain
    ``def`` so that it can pass: the answer, when there is one, is an awaitable."""
    path = _opt(config, "rollout_function_path")
    if evaluation:
        path = _opt(config, "eval_function_path") or path
    return _run_rollout_function(config, path, rollout_id, data_source, client, evaluation) if path else None


async def _run_rollout_function(config, path: str, rollout_id, data_source, client, evaluation) -> RolloutOutput:
    from slime.rollout.base_types import call_rollout_fn

    source = data_source.source if isinstance(data_source, SlimeDataSource) else data_source
    # slime's rollout functions are synchronous and often run their own event loop: give them a thread
    output = await asyncio.to_thread(call_rollout_fn, _function(config, "", path), make_args(config, client),
                                     rollout_id, source, evaluation=evaluation)
    if evaluation:
        return _eval_output(output)
    return RolloutOutput([_flatten(g) for g in output.samples], dict(output.metrics or {}))


@hookimpl(wrapper=True, specname="slime_rollout")
@_when("rollout_sample_filter_path", "rollout_all_samples_process_path", "data_source_path")
def wrap_slime_rollout(config, rollout_id, data_source, client, evaluation):
    """Around whichever rollout answers: the data source learns the step (its ``save``), and the step's samples
    go through ``--rollout-sample-filter-path`` and ``--rollout-all-samples-process-path`` once complete."""
    if isinstance(data_source, SlimeDataSource):
        data_source.rollout_id = rollout_id
    rollout = yield
    return _after_rollout(config, rollout, data_source, client, evaluation)


async def _after_rollout(config, rollout, data_source, client, evaluation) -> RolloutOutput:
    _SEEN_GROUPS.clear()
    out = await rollout
    args = make_args(config, client)
    if not evaluation and _opt(config, "rollout_sample_filter_path"):
        _function(config, "rollout_sample_filter_path")(args, out.samples)
    if not evaluation and _opt(config, "rollout_all_samples_process_path"):
        groups = sorted(_SEEN_GROUPS or out.samples, key=lambda g: g[0].index if g and g[0].index is not None else 0)
        _function(config, "rollout_all_samples_process_path")(args, groups, data_source)
    return out


def _flatten(group) -> list[Sample]:
    """A group may hold fan-out lists (a generate that returned several samples): one flat list."""
    return [s for item in group for s in (_flatten(item) if isinstance(item, list) else [item])]


def _eval_output(output) -> RolloutOutput:
    """slime's ``{name: {"samples": [...]}}`` -> groups (by ``group_index``) of every set's samples."""
    groups: dict = {}
    for entry in output.data.values():
        for sample in entry["samples"]:
            key = sample.group_index if sample.group_index is not None else ("sample", id(sample))
            groups.setdefault(key, []).append(sample)
    return RolloutOutput(list(groups.values()), dict(output.metrics or {}))


@hookimpl
@_when("custom_generate_function_path")
async def slime_generate(config, sample, sampling_params, client, evaluation):
    fn = _function(config, "custom_generate_function_path", sample.generate_function_path)
    params = dict(sampling_params)
    if "evaluation" in inspect.signature(fn).parameters:
        return await fn(make_args(config, client), sample, params, evaluation=evaluation)
    return await fn(make_args(config, client), sample, params)


@hookimpl
@_when("rollout_sample_hook_path")
async def slime_process_sample(config, sample, rollout_id, evaluation):
    args = make_args(config)
    for path in _opt(config, "rollout_sample_hook_path"):
        hook = _function(config, "rollout_sample_hook_path", path)
        accepted = inspect.signature(hook).parameters
        kwargs = {k: v for k, v in (("rollout_id", rollout_id), ("evaluation", evaluation)) if k in accepted}
        result = hook(args, sample, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        if isinstance(result, Sample) and result is not sample:  # slime replaces the sample with the answer
            vars(sample).update(vars(result))


@hookimpl
@_when("custom_rm_path")
async def slime_reward(config, sample):
    if sample.reward is not None:  # slime: a reward the generate function already set is kept
        return sample.reward
    return await _function(config, "custom_rm_path", sample.custom_rm_path)(make_args(config), sample)


slime_reward.slime_reward_name = lambda config: _opt(config, "custom_rm_path")  # its name among combined rewards


@hookimpl
@active_when(lambda config: bool(_opt(config, "custom_rm_path") and config.group_rm))
async def slime_group_reward(config, samples):
    return list(await _function(config, "custom_rm_path")(make_args(config), samples))


@hookimpl
@_when("dynamic_sampling_filter_path", "rollout_all_samples_process_path")
def slime_filter_group(config, samples):
    if _opt(config, "rollout_all_samples_process_path"):
        _SEEN_GROUPS.append(samples)
    if not _opt(config, "dynamic_sampling_filter_path"):
        return None
    answer = _function(config, "dynamic_sampling_filter_path")(make_args(config), samples)
    return answer if isinstance(answer, FilterResult) else bool(answer)


@hookimpl
@_when("custom_reward_post_process_path")
def slime_post_process_rewards(config, samples):
    raw, rewards = _function(config, "custom_reward_post_process_path")(make_args(config), samples)
    return [float(r) for r in raw], [float(r) for r in rewards]


@hookimpl
@_when("custom_rollout_log_function_path")
def slime_log_rollout(config, rollout_id, samples, metrics):
    default = [key for key in metrics if key.startswith("rollout/")]
    skip_default = _function(config, "custom_rollout_log_function_path")(
        rollout_id, make_args(config), samples, metrics, metrics.get("perf/rollout_time"))
    if skip_default:
        for key in default:
            metrics.pop(key, None)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

_SLIME_NAMES = {"raw_rewards": "raw_reward"}  # slime-core batch key -> slime's rollout_data key


def to_slime_batch(batch: dict) -> dict:
    """The batch under slime's ``rollout_data`` / ``batch`` key names: ``unconcat_tokens`` and ``tokens``
    (the packed tokens, ``(1, T)``), ``total_lengths``, ``raw_reward``, besides the shared ones (``advantages``,
    ``returns``, ``log_probs``, ``ref_log_probs``, ``rollout_log_probs``, ``loss_masks``, ``response_lengths``,
    ``rewards``, ``values``, ``rollout_mask_sums``)."""
    import torch

    out = {_SLIME_NAMES.get(key, key): value for key, value in batch.items() if key != "tokens"}
    device = batch["loss_masks"][0].device if batch.get("loss_masks") else None
    out["unconcat_tokens"] = [torch.as_tensor(t, dtype=torch.long, device=device) for t in batch["tokens"]]
    out["total_lengths"] = [len(t) for t in batch["tokens"]]
    out["tokens"] = torch.cat(out["unconcat_tokens"]).unsqueeze(0) if out["unconcat_tokens"] else None
    return out


def _write_back(slime: dict, batch: dict) -> None:
    """Keys a slime function set or replaced in its ``rollout_data`` go back into slime-core's batch."""
    names = {slime_name: key for key, slime_name in _SLIME_NAMES.items()}
    for key, value in slime.items():
        if key not in ("unconcat_tokens", "total_lengths", "tokens"):
            batch[names.get(key, key)] = value


@hookimpl
@_when("custom_loss_function_path", "custom_advantage_function_path")
def slime_train_inputs(config, role):
    return ["log_probs"] if role == "actor" else []  # slime's batch always has the old policy's log-probs


@hookimpl
@_when("custom_advantage_function_path")
def slime_compute_advantages(config, batch):
    rollout_data = to_slime_batch(batch)
    _function(config, "custom_advantage_function_path")(make_args(config), rollout_data)
    missing = [key for key in ("advantages", "returns") if rollout_data.get(key) is None]
    if missing:
        raise ValueError(f"--custom-advantage-function-path {_opt(config, 'custom_advantage_function_path')} did not "
                         f"set rollout_data{missing}; it must set both 'advantages' and 'returns'")
    return {"advantages": list(rollout_data["advantages"]), "returns": list(rollout_data["returns"])}


@hookimpl
@_when("rollout_data_postprocess_path")
def slime_rollout_data_postprocess(config, rollout_id, batch):
    rollout_data = to_slime_batch(batch)
    _function(config, "rollout_data_postprocess_path")(make_args(config), rollout_id, rollout_data)
    _write_back(rollout_data, batch)


class ResponseLogits:
    """What a custom loss gets as ``logits``: the trainer computes only the response positions' log-probs and
    entropies (with gradient), so this carries those. ``slime.backends.megatron_utils.loss.
    get_log_probs_and_entropy(logits, ...)`` (the shim) returns them, as slime's returns its own; any other use
    of ``logits`` is an error that says so."""

    def __init__(self, log_probs: list[torch.Tensor], entropy: list[torch.Tensor] | None):
        self.log_probs, self.entropy = log_probs, entropy

    def __getattr__(self, name: str):
        raise AttributeError(f"logits.{name}: slime-core's trainer hands a custom loss the response log-probs and "
                             "entropies, not the (1, T, V) logits; get them with slime.backends.megatron_utils.loss."
                             "get_log_probs_and_entropy(logits, args=args, ...) as slime's own losses do")


@hookimpl
@_when("custom_loss_function_path")
def slime_loss(config, role, batch, outputs, reducer):
    if role != "actor":  # slime's custom loss is the policy's: None passes a value model's on to its plugin
        return None
    import torch

    lengths = list(batch["response_lengths"])

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        """slime's reducer of a flat ``(sum of response lengths,)`` tensor; it already includes the step's
        division by the number of rollouts that slime applies after the loss."""
        return reducer(list(x.split(lengths)) if isinstance(x, torch.Tensor) else list(x))

    logits = ResponseLogits(outputs["log_probs"], outputs.get("entropy"))
    fn = _function(config, "custom_loss_function_path")
    loss, metrics = fn(make_args(config), to_slime_batch(batch), logits, sum_of_sample_mean)
    return loss, dict(metrics)
