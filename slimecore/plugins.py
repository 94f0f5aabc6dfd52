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
from typing import Any, Callable, Iterable

import pluggy

from slimecore import hookspecs
from slimecore.config import Config, ConfigError, Option

ENTRY_POINT_GROUP = "slimecore"
DEFAULT_PLUGINS = (
    "slimecore.defaults.data",
    "slimecore.defaults.rollout",
    "slimecore.defaults.reward",
    "slimecore.defaults.slime_compat",
)
log = logging.getLogger("slimecore.plugins")

SPECS = {name: fn for name, fn in vars(hookspecs).items() if name.startswith("slime_") and callable(fn)}


def active_when(predicate: Callable[[Config], Any]):
    """Mark a built-in plugin's hookimpl as taking part only in runs where ``predicate(config)`` is true (the
    slime adapter's functions, each switched on by its ``--*-path`` flag). Switched on, it counts as a choice the
    user made: for a one-answer hook it answers over every plugin's implementation."""
    def mark(func):
        func.slime_active_when = predicate
        return func

    return mark


class PluginError(RuntimeError):
    """A plugin could not be found, loaded, checked or called. The message says what to do."""


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


def resolve(spec: str) -> PluginInfo:
    """Import the plugin named by ``spec`` (entry-point name, dotted module or ``.py`` path)."""
    def failed(what: str, exc: BaseException) -> PluginError:
        cause = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return PluginError(f"plugin {spec!r} ({what}) failed to import: {cause}\n"
                           f"Fix the error in the plugin, or drop --plugin {spec}. Full traceback above.")

    if spec.endswith(".py") or os.sep in spec:
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise PluginError(f"plugin file {spec!r} does not exist (resolved to {path}); check the path given to --plugin")
        try:
            module = _import_file(path)
        except Exception as exc:
            traceback.print_exc()
            raise failed(f"file {path}", exc) from exc
        return PluginInfo(path.stem, "file", module, location=str(path))
    entry_points = installed_entry_points()
    if spec in entry_points:
        ep = entry_points[spec]
        try:
            module = ep.load()
        except Exception as exc:
            traceback.print_exc()
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
            traceback.print_exc()
            raise failed("module", exc) from exc
        except Exception as exc:
            traceback.print_exc()
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
    """Typed entry point through which the core calls hooks.

    ``hooks.<name>(**kwargs)`` calls ``slime_<name>``; the return depends on the hook's kind:
    *all* -> list of non-None results; *one* -> the single answer; *first* -> the first non-None
    answer or None. Async hooks return an awaitable. Errors name the plugin and hook.
    """

    def __init__(self, pm: pluggy.PluginManager, infos: list[PluginInfo]):
        self.pm = pm
        self.plugins = infos
        self._by_module = {id(i.module): i for i in infos}
        self._trace = os.environ.get("SLIMECORE_TRACE_HOOKS", "") not in ("", "0")
        self.config: Config | None = None  # the run's config, once known: it switches ``active_when`` hookimpls

    def bind(self, config: Config) -> "Hooks":
        """Use ``config`` to decide which ``active_when`` implementations take part."""
        self.config = config
        return self

    # -- introspection ---------------------------------------------------------------------
    def plugin_name(self, impl: pluggy.HookImpl) -> str:
        info = self._by_module.get(id(impl.plugin))
        return info.name if info else impl.plugin_name

    def implementers(self, hook: str) -> list[pluggy.HookImpl]:
        """Implementations in call order (later-registered plugins first, as pluggy calls them), without the
        ``active_when`` ones this run does not switch on."""
        return [i for i in reversed(getattr(self.pm.hook, hook).get_hookimpls()) if self._switched(i) is not False]

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
        registered = list(reversed(self.implementers(hook)))
        chosen = [i for i in registered if self._switched(i)] + [i for i in registered if not self._is_default(i)]
        return chosen or registered[:1]

    def is_default(self, impl: pluggy.HookImpl | None) -> bool:
        """Whether ``impl`` is a built-in default (``slimecore.defaults.*``) that no flag switched on."""
        return impl is not None and self._is_default(impl) and not self._switched(impl)

    def call(self, hook: str, impl: pluggy.HookImpl, **kwargs):
        """Call one implementation of ``hook`` (an awaitable for async hooks); errors name its plugin."""
        return self._invoke(hook, impl, kwargs)

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
            if spec_fn.slime_kind == "one" and len(custom) > 1 and not spec_fn.slime_combined:
                raise PluginError(
                    f"plugins {', '.join(repr(c) for c in custom)} all implement {name}, which takes one answer; "
                    f"activate only one of them (remove a --plugin), or move one's {name} into a separate plugin")
            if spec_fn.slime_required and not impls and name not in skip:
                raise PluginError(
                    f"no active plugin implements {name}, which this run needs. Active plugins: "
                    f"{', '.join(i.name for i in self.plugins)}. Add one that does, e.g. --plugin grpo "
                    f"(`slime-core plugins` shows which installed plugin implements which hook)")

    # -- calling -----------------------------------------------------------------------------
    def __getattr__(self, short: str):
        name = "slime_" + short
        if name not in SPECS:
            raise AttributeError(f"no hook named {name}")
        spec_fn = SPECS[name]

        def call(**kwargs):
            if spec_fn.slime_kind == "all":
                return [r for r in (self._invoke(name, impl, kwargs) for impl in self.implementers(name)) if r is not None]
            if spec_fn.slime_kind == "one":
                impl = self.answerer(name)
                if impl is None:
                    raise PluginError(f"no active plugin implements {name}; add a plugin that does (see `slime-core plugins`)")
                return self._invoke(name, impl, kwargs, must_answer=True)
            for impl in self.implementers(name):
                result = self._invoke(name, impl, kwargs)
                if result is not None:
                    return result
            return None

        call.__name__ = short
        call.__doc__ = spec_fn.__doc__
        return call

    def answers(self, hook: str, **kwargs) -> list[tuple[str, Any]]:
        """``(plugin name, answer)`` of every implementation of an all-answers hook, in call order, None skipped:
        for a caller that must say which plugin answered what."""
        return [(self.plugin_name(impl), answer) for impl in self.implementers(hook)
                if (answer := self._invoke(hook, impl, kwargs)) is not None]

    def train_inputs(self, **kwargs) -> set[str]:
        """Union of the extra inputs every active plugin's loss needs."""
        return {item for items in self.__getattr__("train_inputs")(**kwargs) for item in items}

    def _invoke(self, hook: str, impl: pluggy.HookImpl, kwargs: dict, must_answer: bool = False):
        plugin = self.plugin_name(impl)
        args = {k: kwargs[k] for k in impl.argnames if k in kwargs}
        missing = [a for a in impl.argnames if a not in kwargs]
        if missing:
            raise PluginError(f"plugin {plugin!r}: {hook} asks for {missing}, which the core does not pass; "
                              f"valid parameters: {list(kwargs)}")
        if self._trace:
            print(f"[slimecore hook] {hook} -> {plugin}", file=sys.stderr)
        try:
            result = impl.function(**args)
        except (PluginError, ConfigError):
            raise  # already a message for the user (e.g. slime_validate_config rejecting flags)
        except Exception as exc:
            raise HookCallError(plugin, hook, exc) from exc
        if inspect.isawaitable(result):
            return self._await(plugin, hook, result, must_answer)
        if must_answer and result is None:
            raise PluginError(f"plugin {plugin!r}: {hook} returned None; it must return an answer")
        return result

    @staticmethod
    async def _await(plugin: str, hook: str, awaitable, must_answer: bool):
        try:
            result = await awaitable
        except (PluginError, ConfigError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise HookCallError(plugin, hook, exc) from exc
        if must_answer and result is None:
            raise PluginError(f"plugin {plugin!r}: {hook} returned None; it must return an answer")
        return result

    # -- options -----------------------------------------------------------------------------
    def declared_options(self) -> dict[str, list[Option]]:
        declared: dict[str, list[Option]] = {}
        for impl in self.implementers("slime_options"):
            options = self._invoke("slime_options", impl, {}) or []
            for option in options:
                if not isinstance(option, Option):
                    raise PluginError(f"plugin {self.plugin_name(impl)!r}: slime_options must return "
                                      f"slimecore.config.Option objects, got {type(option).__name__}")
            declared[self.plugin_name(impl)] = list(options)
        return declared

    def implied_options(self) -> dict[str, dict]:
        """Each active plugin's ``slime_implied_options`` answer (core option values), by plugin name."""
        return self._option_values("slime_implied_options")

    def quickstart_options(self) -> dict[str, dict]:
        """Each active plugin's non-empty ``slime_quickstart_options`` answer (core option values), by plugin."""
        return {name: values for name, values in self._option_values("slime_quickstart_options").items() if values}

    def _option_values(self, hook: str) -> dict[str, dict]:
        answers: dict[str, dict] = {}
        for impl in self.implementers(hook):
            values = self._invoke(hook, impl, {}) or {}
            if not isinstance(values, dict):
                raise PluginError(f"plugin {self.plugin_name(impl)!r}: {hook} must return a dict of core option names "
                                  f"to values, got {type(values).__name__}")
            answers[self.plugin_name(impl)] = dict(values)
        return answers


class HookCallError(PluginError):
    """A plugin raised inside a hook."""

    def __init__(self, plugin: str, hook: str, exc: BaseException):
        self.plugin, self.hook, self.original = plugin, hook, exc
        self.cause_kind, self.cause_text = type(exc).__name__, str(exc)
        self.cause_traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        super().__init__(f"plugin {plugin!r} raised in {hook}: {self.cause_kind}: {self.cause_text}")

    def __reduce__(self):
        # crosses Ray pickled; the plugin's own exception may not pickle, so it travels as text
        return _restore_hook_call_error, (self.plugin, self.hook, self.cause_kind, self.cause_text,
                                          self.cause_traceback)


def _restore_hook_call_error(plugin: str, hook: str, kind: str, text: str, trace: str) -> HookCallError:
    error = HookCallError.__new__(HookCallError)
    PluginError.__init__(error, f"plugin {plugin!r} raised in {hook}: {kind}: {text}")
    error.plugin, error.hook, error.original = plugin, hook, None
    error.cause_kind, error.cause_text, error.cause_traceback = kind, text, trace
    return error


def load_plugins(specs: Iterable[str], extra: Iterable[Any] = (), defaults: bool = True) -> Hooks:
    """Load the defaults, the plugins named by ``specs`` and ``extra`` objects; check them; return the facade.

    Every process that calls hooks calls this with the run's ``config.plugins``.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    infos = [resolve(spec) for spec in list(DEFAULT_PLUGINS if defaults else ()) + list(specs)]
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
    """What every Ray process calls first: the same plugins as the driver, checked the same way."""
    return load_plugins(config.plugins).bind(config)
