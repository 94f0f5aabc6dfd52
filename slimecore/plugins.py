"""Plugin manager: find plugins, load them in every process, check them at start-up, call hooks.

A plugin is a Python module (or any object) with ``@slimecore.hookimpl`` functions named after the
specs in ``slimecore.hookspecs``. It is found by ``--plugin SPEC`` where SPEC is:
- the name of an installed entry point in the group ``slimecore`` (``[project.entry-points.slimecore]``
  ``grpo = "slime_grpo.plugin"`` in its pyproject.toml),
- a dotted module path (``my_pkg.my_reward``), or
- a path to a ``.py`` file (``./my_reward.py``).
Only the built-in defaults and the plugins named in the run's config are active. Built-in defaults
implement the same hooks; a non-default plugin answering a one-answer hook replaces the default.

Environment:
- ``SLIMECORE_LOAD_PLUGINS=a,b``: only these installed entry points are visible (allow list);
  an empty value hides every installed plugin.
- ``SLIMECORE_BLOCK_PLUGINS=a,b``: these installed entry points are hidden (deny list).
- ``SLIMECORE_TRACE_HOOKS=1``: log every hook call with the plugin that answered, to stderr.
"""

from __future__ import annotations

import asyncio
import difflib
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import pluggy

from slimecore import answers, hookspecs
from slimecore.config import Config, ConfigError, Option
from slimecore.errors import HookCallError, PluginError  # defined there, importable from here
from slimecore.watchdog import waiting

if TYPE_CHECKING:
    import torch

    from slimecore.protocols import (AgentHook, AgentSession, BufferFilter, ObservationHook, Reducer, RolloutClient,
                                     SampleHooks)
    from slimecore.types import (Advantages, DataSource, FilterResult, ModelOutputs, RolloutOutput, Sample, TrainBatch,
                                 TrainRole)

ENTRY_POINT_GROUP = "slimecore"
DEFAULT_PLUGINS = (
    "slimecore.defaults.data",
    "slimecore.defaults.rollout",
    "slimecore.defaults.reward",
    "slimecore.defaults.slime_compat",
)
log = logging.getLogger("slimecore.plugins")

# batch columns the trainer fills itself, which ``slime_scoring_weights`` may not name
TRAINER_COLUMNS = frozenset({"log_probs", "entropy", "ref_log_probs", "values", "advantages", "returns",
                             "rollout_log_probs", "tokens", "loss_masks", "rewards", "response_lengths"})
SPECS = {name: fn for name, fn in vars(hookspecs).items() if name.startswith("slime_") and callable(fn)}


def active_when(predicate: Callable[[Config], Any]):
    """Mark a built-in plugin's hookimpl as taking part only in runs where ``predicate(config)`` is true (the
    slime adapter's functions, each switched on by its ``--*-path`` flag). Switched on, it counts as a choice the
    user made: for a one-answer hook it answers over every plugin's implementation."""
    def mark(func):
        func.slime_active_when = predicate
        return func

    return mark


@dataclass
class PluginInfo:
    name: str
    origin: str  # "built-in", "entry point", "module", "file"
    module: Any
    distribution: str | None = None
    version: str | None = None
    location: str | None = None
    hooks: list[str] = field(default_factory=list)

    @property
    def is_default(self) -> bool:
        return self.origin == "built-in"


# ---------------------------------------------------------------------------------------------
# Discovery
# ---------------------------------------------------------------------------------------------

def _env_list(name: str) -> set[str] | None:
    value = os.environ.get(name)
    if value is None:
        return None
    return {item.strip() for item in value.split(",") if item.strip()}


def installed_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """Installed plugins by name, after the allow/deny environment lists."""
    allow, deny = _env_list("SLIMECORE_LOAD_PLUGINS"), _env_list("SLIMECORE_BLOCK_PLUGINS") or set()
    found = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if (allow is None or ep.name in allow) and ep.name not in deny:
            found.setdefault(ep.name, ep)
    return found


def _import_file(path: Path) -> Any:
    module_name = "slimecore_plugin_" + "".join(c if c.isalnum() else "_" for c in str(path.with_suffix("")))
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def normalize_spec(spec: str) -> str:
    """Make a ``--plugin`` value process-independent (``.py`` paths become absolute)."""
    if spec.endswith(".py"):
        return str(Path(spec).expanduser().resolve())
    return spec


def resolve(spec: str, show_traceback: bool = True) -> PluginInfo:
    """Import the plugin named by ``spec`` (entry-point name, dotted module or ``.py`` path); a failed import's
    traceback is printed unless ``show_traceback`` is false (a Ray worker's: ``load_for_config``)."""
    def failed(what: str, exc: BaseException) -> PluginError:
        cause = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        if show_traceback:
            traceback.print_exception(type(exc), exc, exc.__traceback__)
        return PluginError(f"plugin {spec!r} ({what}) failed to import: {cause}\n"
                           f"Fix the error in the plugin, or drop --plugin {spec}."
                           + (" Full traceback above." if show_traceback else ""))

    if spec.endswith(".py") or os.sep in spec:
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise PluginError(f"plugin file {spec!r} does not exist (resolved to {path}); check the path given to --plugin")
        try:
            module = _import_file(path)
        except Exception as exc:
            raise failed(f"file {path}", exc) from exc
        return PluginInfo(path.stem, "file", module, location=str(path))
    entry_points = installed_entry_points()
    if spec in entry_points:
        ep = entry_points[spec]
        try:
            module = ep.load()
        except Exception as exc:
            raise failed(f"entry point {ep.value}", exc) from exc
        dist = ep.dist
        return PluginInfo(spec, "entry point", module, dist.name if dist else None, dist.version if dist else None,
                          getattr(module, "__file__", None))
    if "." in spec and importlib.util.find_spec(spec.split(".")[0]) is not None:
        try:
            module = importlib.import_module(spec)
        except ModuleNotFoundError as exc:
            if exc.name and spec.startswith(exc.name):
                raise PluginError(_unknown_message(spec, entry_points)) from None
            raise failed("module", exc) from exc
        except Exception as exc:
            raise failed("module", exc) from exc
        return PluginInfo(spec, "built-in" if spec in DEFAULT_PLUGINS else "module", module,
                          location=getattr(module, "__file__", None))
    raise PluginError(_unknown_message(spec, entry_points))


def _unknown_message(spec: str, entry_points: dict) -> str:
    names = sorted(entry_points)
    hint = difflib.get_close_matches(spec, names, n=1)
    return (f"unknown plugin {spec!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "") + ". "
            f"Installed plugins: {', '.join(names) or 'none'}. "
            "Give an installed name, a dotted module path, or a path to a .py file; "
            "`slime-core plugins` lists what is installed, `pip install ./my-plugin` adds one.")


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------

def _check_names(info: PluginInfo) -> None:
    """Catch misspelled or undecorated hook functions, which pluggy would silently ignore."""
    for attr, value in vars(info.module).items() if hasattr(info.module, "__dict__") else []:
        if not attr.startswith("slime_") or not callable(value):
            continue
        decorated = hasattr(value, "slimecore_impl")
        if attr not in SPECS:
            if getattr(value, "__module__", None) != getattr(info.module, "__name__", None):
                continue  # imported from elsewhere, e.g. a dependency plugin's functions
            hint = difflib.get_close_matches(attr, SPECS, n=1)
            raise PluginError(
                f"plugin {info.name!r} defines {attr!r}, which is not a slime-core hook"
                + (f"; did you mean {hint[0]!r}?" if hint else "")
                + " Rename it (hooks are listed by `slime-core hooks`) or give it a name not starting with 'slime_'.")
        if not decorated and getattr(value, "__module__", None) == getattr(info.module, "__name__", None):
            raise PluginError(f"plugin {info.name!r} defines {attr!r} without @slimecore.hookimpl, so it would never "
                              "be called; add the decorator (from slimecore import hookimpl)")


# ---------------------------------------------------------------------------------------------
# The facade
# ---------------------------------------------------------------------------------------------

class Hooks:
    """How the core calls hooks: one method per hook, named as the hook, with the spec's keyword arguments.

    Each method calls ``pm.hook.slime_xxx`` and pluggy's semantics decide (``firstresult`` for one- and
    first-answer hooks, wrappers, ``tryfirst`` / ``trylast``); the method adds what the caller needs: async
    answers awaited, None refused where an answer is required, and for a few all-answers hooks the answers by
    plugin (options) or combined (``slime_train_inputs``). Every implementation is called through a guard (see
    ``_guard``) that switches ``active_when`` implementations, traces calls (``SLIMECORE_TRACE_HOOKS=1``) and
    wraps a plugin's exception in ``HookCallError`` naming the plugin and the hook.
    """

    def __init__(self, pm: pluggy.PluginManager, infos: list[PluginInfo]):
        self.pm = pm
        self.plugins = infos
        self._by_module = {id(i.module): i for i in infos}
        self._trace = os.environ.get("SLIMECORE_TRACE_HOOKS", "") not in ("", "0")
        self.config: Config | None = None  # the run's config, once known: it switches ``active_when`` hookimpls
        for name in SPECS:
            for impl in getattr(pm.hook, name).get_hookimpls():
                impl.function = self._guard(name, impl)

    def bind(self, config: Config) -> "Hooks":
        """Use ``config`` to decide which ``active_when`` implementations take part."""
        self.config = config
        return self

    # -- options and lifecycle -----------------------------------------------------------------
    def slime_options(self) -> dict[str, list[Option]]:
        """Each active plugin's declared options, by plugin name."""
        declared = self._by_plugin("slime_options", list)
        for plugin, options in declared.items():
            for option in options:
                if not isinstance(option, Option):
                    raise PluginError(f"plugin {plugin!r}: slime_options must return slimecore.config.Option "
                                      f"objects, got {type(option).__name__}")
        return declared

    def slime_implied_options(self) -> dict[str, dict[str, Any]]:
        """Each active plugin's answer (core option values), by plugin name."""
        return self._by_plugin("slime_implied_options", dict)

    def slime_quickstart_options(self) -> dict[str, dict[str, Any]]:
        """Each active plugin's non-empty answer (core option values), by plugin name."""
        return {name: values for name, values in self._by_plugin("slime_quickstart_options", dict).items() if values}

    def slime_validate_config(self, *, config: Config) -> None:
        self.pm.hook.slime_validate_config(config=config)

    def slime_startup(self, *, config: Config, process: str) -> None:
        self.pm.hook.slime_startup(config=config, process=process)

    def slime_step_end(self, *, config: Config, rollout_id: int, metrics: dict[str, float]) -> None:
        self.pm.hook.slime_step_end(config=config, rollout_id=rollout_id, metrics=metrics)

    def slime_shutdown(self, *, config: Config, process: str) -> None:
        self.pm.hook.slime_shutdown(config=config, process=process)

    # -- data ----------------------------------------------------------------------------------
    def slime_data_source(self, *, config: Config, tokenizer: Any, buffer_filter: BufferFilter) -> DataSource:
        return self._answer("slime_data_source", self.pm.hook.slime_data_source(
            config=config, tokenizer=tokenizer, buffer_filter=buffer_filter))

    def slime_buffer_filter(self, *, config: Config, buffer: list[list[Sample]],
                            num_groups: int) -> list[list[Sample]] | None:
        return self.pm.hook.slime_buffer_filter(config=config, buffer=buffer, num_groups=num_groups)

    def slime_datasets(self) -> list[dict[str, str]]:
        return self.pm.hook.slime_datasets()

    # -- rollout -------------------------------------------------------------------------------
    async def slime_rollout(self, *, config: Config, rollout_id: int, data_source: DataSource, client: RolloutClient,
                            sample_hooks: SampleHooks, evaluation: bool) -> RolloutOutput:
        return self._answer("slime_rollout", await self._awaited(self.pm.hook.slime_rollout(
            config=config, rollout_id=rollout_id, data_source=data_source, client=client, sample_hooks=sample_hooks,
            evaluation=evaluation)))

    async def slime_generate(self, *, config: Config, sample: Sample, sampling_params: dict, client: RolloutClient,
                             evaluation: bool, observation: ObservationHook | None,
                             agent: AgentHook | None) -> Sample | list[Sample]:
        return self._answer("slime_generate", await self._awaited(self.pm.hook.slime_generate(
            config=config, sample=sample, sampling_params=sampling_params, client=client, evaluation=evaluation,
            observation=observation, agent=agent)))

    async def slime_observation(self, *, config: Config, sample: Sample, text: str, turn: int) -> str | None:
        return await self._awaited(self.pm.hook.slime_observation(config=config, sample=sample, text=text, turn=turn))

    async def slime_agent(self, *, config: Config, sample: Sample, session: AgentSession) -> float | dict | None:
        return await self._awaited(self.pm.hook.slime_agent(config=config, sample=sample, session=session))

    async def slime_process_sample(self, *, config: Config, sample: Sample, rollout_id: int, evaluation: bool) -> None:
        for answer in self.pm.hook.slime_process_sample(config=config, sample=sample, rollout_id=rollout_id,
                                                        evaluation=evaluation):
            await self._awaited(answer)  # an async implementation (slime's sample hooks may be async)

    async def slime_reward(self, *, config: Config, sample: Sample) -> float | dict:
        """The first answer (several reward plugins are combined by ``SampleHooks.reward``)."""
        return self._answer("slime_reward", await self._awaited(self.pm.hook.slime_reward(config=config,
                                                                                          sample=sample)))

    async def slime_group_reward(self, *, config: Config, samples: list[Sample]) -> list[float | dict]:
        return self._answer("slime_group_reward", await self._awaited(self.pm.hook.slime_group_reward(
            config=config, samples=samples)))

    def slime_filter_group(self, *, config: Config, samples: list[Sample]) -> list[tuple[str, FilterResult | bool]]:
        """``(plugin, verdict)`` of every plugin with an opinion, in call order: the rollout names the plugin that
        dropped a group, so each implementation is called in turn rather than through pluggy's list."""
        return self._each("slime_filter_group", config=config, samples=samples)

    def slime_post_process_rewards(self, *, config: Config,
                                   samples: list[Sample]) -> tuple[list[float], list[float]]:
        return self._answer("slime_post_process_rewards", self.pm.hook.slime_post_process_rewards(
            config=config, samples=samples))

    def slime_log_rollout(self, *, config: Config, rollout_id: int, samples: list[Sample],
                          metrics: dict[str, float]) -> None:
        self.pm.hook.slime_log_rollout(config=config, rollout_id=rollout_id, samples=samples, metrics=metrics)

    # -- training ------------------------------------------------------------------------------
    def slime_train_roles(self, *, config: Config) -> list[tuple[str, list[TrainRole | str]]]:
        """``(plugin, declarations)`` of every plugin that declares roles: errors in a declaration name its plugin
        (``slimecore.trainers.roles.declared_roles``)."""
        return self._each("slime_train_roles", config=config)

    def slime_train_inputs(self, *, config: Config, role: str) -> set[str]:
        """The union of the extra inputs every active plugin's loss needs."""
        return {item for items in self.pm.hook.slime_train_inputs(config=config, role=role) for item in items}

    def slime_scoring_weights(self, *, config: Config, role: str) -> dict[str, str]:
        """``{column: checkpoint}`` of every active plugin, merged; a column two plugins name, or one the trainer
        fills itself, is a ``PluginError`` naming the plugins."""
        merged: dict[str, str] = {}
        owners: dict[str, str] = {}
        for plugin, answer in self._each("slime_scoring_weights", config=config, role=role):
            if not isinstance(answer, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in answer.items()):
                raise PluginError(f"plugin {plugin!r}: slime_scoring_weights must return a dict of column names to "
                                  f"checkpoint paths, got {answer!r}")
            for column, checkpoint in answer.items():
                if column in TRAINER_COLUMNS:
                    raise PluginError(f"plugin {plugin!r}: slime_scoring_weights names column {column!r}, which the "
                                      "trainer fills itself; name the column after what it holds")
                if column in owners:
                    raise PluginError(f"plugins {owners[column]!r} and {plugin!r} both ask slime_scoring_weights for "
                                      f"column {column!r}")
                merged[column], owners[column] = checkpoint, plugin
        return merged

    def slime_compute_advantages(self, *, config: Config, role: str, batch: TrainBatch) -> Advantages:
        return self._answer("slime_compute_advantages", self.pm.hook.slime_compute_advantages(
            config=config, role=role, batch=batch))

    def slime_rollout_data_postprocess(self, *, config: Config, rollout_id: int, batch: TrainBatch) -> None:
        self.pm.hook.slime_rollout_data_postprocess(config=config, rollout_id=rollout_id, batch=batch)

    def slime_loss(self, *, config: Config, role: str, batch: TrainBatch, outputs: ModelOutputs,
                   reducer: Reducer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self._answer("slime_loss", self.pm.hook.slime_loss(config=config, role=role, batch=batch,
                                                                  outputs=outputs, reducer=reducer))

    # -- models --------------------------------------------------------------------------------
    def slime_model_bridge(self, *, config: Config, hf_config: Any) -> Any | None:
        return self.pm.hook.slime_model_bridge(config=config, hf_config=hf_config)

    # -- introspection -------------------------------------------------------------------------
    def plugin_name(self, impl: pluggy.HookImpl) -> str:
        info = self._by_module.get(id(impl.plugin))
        return info.name if info else impl.plugin_name

    def implementers(self, hook: str) -> list[pluggy.HookImpl]:
        """Implementations in pluggy's call order (switched-on ``active_when`` ones of one- and first-answer hooks
        first, then plugins, later-registered first, then the built-in defaults), without wrappers and without
        the ``active_when`` ones this run does not switch on."""
        return [i for i in reversed(getattr(self.pm.hook, hook).get_hookimpls())
                if not (i.wrapper or i.hookwrapper) and self._switched(i) is not False]

    def _switched(self, impl: pluggy.HookImpl) -> bool | None:
        """None for an ordinary implementation; for an ``active_when`` one, whether this run switches it on."""
        predicate = getattr(impl.function, "slime_active_when", None)
        if predicate is None:
            return None
        return self.config is not None and bool(predicate(self.config))

    def answerer(self, hook: str) -> pluggy.HookImpl | None:
        """For a one-answer hook: the implementation that will answer (a switched-on ``active_when`` one, else a
        plugin over the default)."""
        return (self.answerers(hook) or [None])[0]

    def answerers(self, hook: str) -> list[pluggy.HookImpl]:
        """Every implementation that answers a one-answer hook over the built-in default, in activation order
        (switched-on ``active_when`` ones, then plugins in ``--plugin`` order); else the default alone. Only
        hooks whose answers are combined (``slime_reward``) use more than the first."""
        registered = sorted(self.implementers(hook), key=self._registration_order)
        chosen = [i for i in registered if self._switched(i)] + [i for i in registered if not self._is_default(i)]
        return chosen or registered[:1]

    def _registration_order(self, impl: pluggy.HookImpl) -> int:
        return next((n for n, info in enumerate(self.plugins) if info.module is impl.plugin), len(self.plugins))

    def is_default(self, impl: pluggy.HookImpl | None) -> bool:
        """Whether ``impl`` is a built-in default (``slimecore.defaults.*``) that no flag switched on."""
        return impl is not None and self._is_default(impl) and not self._switched(impl)

    def call(self, hook: str, impl: pluggy.HookImpl, **kwargs):
        """Call one implementation of ``hook`` (an awaitable for async hooks; guarded like every call): for the
        core's combination of several plugins' answers (``slime_reward`` with ``--reward-weights``)."""
        return impl.function(*(kwargs[name] for name in impl.argnames))

    def _is_default(self, impl: pluggy.HookImpl) -> bool:
        info = self._by_module.get(id(impl.plugin))
        return bool(info and info.is_default)

    def check(self, *, skip_required: Iterable[str] = ()) -> None:
        """Start-up checks: unknown hookimpls, conflicting one-answer hooks, missing required hooks."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"{exc}. Rename the hook to one listed by `slime-core hooks`.") from None
        skip = set(skip_required)
        for name, spec_fn in SPECS.items():
            impls = self.implementers(name)
            custom = [self.plugin_name(i) for i in impls if not self._is_default(i)]
            if spec_fn.slime_single and len(custom) > 1:
                raise PluginError(
                    f"plugins {', '.join(repr(c) for c in custom)} all implement {name}, which takes one answer; "
                    f"activate only one of them (remove a --plugin), or move one's {name} into a separate plugin")
            if spec_fn.slime_required and not impls and name not in skip:
                raise PluginError(
                    f"no active plugin implements {name}, which this run needs. Active plugins: "
                    f"{', '.join(i.name for i in self.plugins)}. Add one that does, e.g. --plugin grpo "
                    f"(`slime-core plugins` shows which installed plugin implements which hook)")

    # -- calling -------------------------------------------------------------------------------
    def _guard(self, hook: str, impl: pluggy.HookImpl) -> Callable:
        """``impl``'s function as pluggy calls it (positional arguments in ``impl.argnames`` order): an
        ``active_when`` one this run does not switch on answers None (pluggy moves on; a wrapper passes the inner
        answer through); otherwise the call is traced and a plugin's exception, raised at once or when its
        awaitable is awaited, becomes a ``HookCallError`` naming the plugin and the hook."""
        function, plugin = impl.function, self.plugin_name(impl)

        def guarded(*args):
            if self._switched(impl) is False:
                return None
            self._trace_call(hook, plugin)
            try:
                result = function(*args)
            except (PluginError, ConfigError):
                raise  # already a message for the user (e.g. slime_validate_config rejecting flags)
            except Exception as exc:
                raise HookCallError(plugin, hook, exc) from exc
            return _answer_of(plugin, hook, result, dict(zip(impl.argnames, args)))

        def guarded_wrapper(*args):
            if self._switched(impl) is False:
                return (yield)
            self._trace_call(hook, plugin)
            try:
                result = yield from function(*args)
            except (PluginError, ConfigError):
                raise
            except Exception as exc:
                raise HookCallError(plugin, hook, exc) from exc
            return _answer_of(plugin, hook, result, dict(zip(impl.argnames, args)))

        wrapped = guarded_wrapper if impl.wrapper or impl.hookwrapper else guarded
        wrapped.slime_active_when = getattr(function, "slime_active_when", None)
        wrapped.slime_reward_name = getattr(function, "slime_reward_name", None)
        wrapped.__wrapped__ = function
        return wrapped

    def _trace_call(self, hook: str, plugin: str) -> None:
        if self._trace:
            print(f"[slimecore hook] {hook} -> {plugin}", file=sys.stderr)

    @staticmethod
    async def _awaited(answer):
        return await answer if inspect.isawaitable(answer) else answer

    def _answer(self, hook: str, answer):
        """A one-answer hook's answer, which must not be None. For an async hook the first implementation's
        awaitable was the answer; for a sync one every implementation answered None."""
        if answer is None:
            tried = [self.plugin_name(i) for i in self.implementers(hook)]
            tried = tried[:1] if SPECS[hook].slime_async else tried
            if not tried:
                raise PluginError(f"no active plugin implements {hook}; add a plugin that does "
                                  "(see `slime-core plugins`)")
            raise PluginError(f"plugin {', '.join(repr(t) for t in tried)}: {hook} returned None; it must return an "
                              "answer")
        return answer

    def _each(self, hook: str, **kwargs) -> list[tuple[str, Any]]:
        """``(plugin name, answer)`` of every implementation of an all-answers hook, in call order, None skipped."""
        return [(self.plugin_name(impl), answer) for impl in self.implementers(hook)
                if (answer := self.call(hook, impl, **kwargs)) is not None]

    def _by_plugin(self, hook: str, kind: type) -> dict[str, Any]:
        """Each implementation's answer to an argument-less all-answers hook, by plugin name (None: empty)."""
        answers: dict[str, Any] = {}
        for impl in self.implementers(hook):
            values = self.call(hook, impl) or kind()
            if not isinstance(values, (list, tuple) if kind is list else kind):
                raise PluginError(f"plugin {self.plugin_name(impl)!r}: {hook} must return a {kind.__name__}, got "
                                  f"{type(values).__name__}")
            answers[self.plugin_name(impl)] = kind(values)
        return answers


def _answer_of(plugin: str, hook: str, result, args: dict):
    """A guarded implementation's answer, checked against what ``hook`` may return (``slimecore.answers``) right
    after it returns; an awaitable's once awaited."""
    if inspect.isawaitable(result):
        return _guarded_await(plugin, hook, result, args)
    return answers.check(plugin, hook, result, args)


async def _guarded_await(plugin: str, hook: str, awaitable, args: dict):
    try:
        with waiting(plugin, hook, args):  # what the rollout's watchdog and timeouts name while it runs
            result = await awaitable
    except (PluginError, ConfigError, asyncio.CancelledError):
        raise
    except Exception as exc:
        raise HookCallError(plugin, hook, exc) from exc
    return answers.check(plugin, hook, result, args)


class _PluginManager(pluggy.PluginManager):
    """pluggy's manager, ordering the built-in defaults' implementations: ``trylast`` (a plugin's answer comes
    first, so it replaces the default's), except ``active_when`` ones of one- and first-answer hooks, which are
    ``tryfirst`` (a ``--*-path`` flag the user gave answers over every plugin)."""

    def __init__(self, default_modules: set[int]):
        super().__init__(hookspecs.PROJECT)
        self.default_modules = default_modules

    def parse_hookimpl_opts(self, plugin, name: str):
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None or id(plugin) not in self.default_modules or opts.get("tryfirst") or opts.get("trylast"):
            return opts
        spec_fn = SPECS.get(opts.get("specname") or name)
        switched = getattr(getattr(plugin, name), "slime_active_when", None) is not None
        first = switched and spec_fn is not None and spec_fn.slime_kind != "all"
        return {**opts, "tryfirst": first, "trylast": not first}


def load_plugins(specs: Iterable[str], extra: Iterable[Any] = (), defaults: bool = True,
                 show_traceback: bool = True) -> Hooks:
    """Load the defaults, the plugins named by ``specs`` and ``extra`` objects; check them; return the facade.

    Every process that calls hooks calls this with the run's ``config.plugins``.
    """
    infos = [resolve(spec, show_traceback) for spec in list(DEFAULT_PLUGINS if defaults else ()) + list(specs)]
    pm = _PluginManager({id(info.module) for info in infos if info.is_default})
    pm.add_hookspecs(hookspecs)
    seen: set[int] = set()
    for obj in extra:
        name = getattr(obj, "__name__", None) or type(obj).__name__
        infos.append(PluginInfo(name, "object", obj))
    for info in infos:
        if id(info.module) in seen:
            continue
        seen.add(id(info.module))
        _check_names(info)
        try:
            pm.register(info.module, name=f"{info.origin}:{info.name}")
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {info.name!r}: {exc}. Its hook parameters must be a subset of the spec's "
                              "(see `slime-core hooks`).") from None
        except ValueError as exc:
            raise PluginError(f"plugin {info.name!r} could not be registered: {exc}") from None
        info.hooks = sorted(impl_name for impl_name in SPECS
                            if any(i.plugin is info.module for i in getattr(pm.hook, impl_name).get_hookimpls()))
    return Hooks(pm, infos)


def load_for_config(config: Config) -> Hooks:
    """What every Ray process calls first: the same plugins as the driver, checked the same way. In a Ray worker a
    plugin that does not load is one error (no traceback printed by each worker) saying it loaded in the driver,
    which checked every plugin before Ray started, and where it did not."""
    worker = _ray_worker()
    try:
        return load_plugins(config.plugins, show_traceback=worker is None).bind(config)
    except PluginError as exc:
        if worker is None:
            raise
        raise PluginError(f"{exc}\nIt loads in the driver (which checked it before Ray started) but not in this Ray "
                          f"worker ({worker}): install what the plugin needs in the workers' Python environment on "
                          "every node (or ship it with a Ray runtime_env)") from None


def _ray_worker() -> str | None:
    """Where this process runs when it is a Ray worker (an actor or task): host, pid and Python; else None."""
    if "ray" not in sys.modules:
        return None
    import socket

    from ray._private.worker import WORKER_MODE, global_worker

    if global_worker.mode != WORKER_MODE:
        return None
    return f"host {socket.gethostname()}, pid {os.getpid()}, Python {sys.executable}"
