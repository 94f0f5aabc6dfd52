"""Contract checks for plugin authors: does a plugin's every hookimpl match a spec?"""

from __future__ import annotations

import inspect
from typing import Any

from slimecore.plugins import SPECS, load_plugins, resolve


class ContractError(AssertionError):
    """A hookimpl that does not fit its spec."""


def hookimpls(plugin: Any) -> dict[str, Any]:
    """The functions of ``plugin`` (module, object or ``--plugin`` spec string) marked as hookimpls."""
    module = resolve(plugin).module if isinstance(plugin, str) else plugin
    return {name: getattr(module, name) for name in dir(module)
            if hasattr(getattr(module, name, None), "slimecore_impl")}


def check_plugin_contract(plugin: Any) -> list[str]:
    """Raise ContractError if a hookimpl is not a spec, asks for parameters the spec lacks, differs in
    async-ness, or ``slime_options`` does not return Options. Returns the checked hook names."""
    from slimecore.config import Option

    impls = hookimpls(plugin)
    if not impls:
        raise ContractError(f"{plugin!r} has no @slimecore.hookimpl functions")
    for attr, fn in impls.items():
        opts = fn.slimecore_impl
        name = opts.get("specname") or attr
        if name not in SPECS:
            raise ContractError(f"{name} is not a slime-core hook (see `slime-core hooks`)")
        spec = SPECS[name]
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        extra = set(params) - set(inspect.signature(spec).parameters)
        if extra:
            raise ContractError(f"{name} asks for {sorted(extra)}, which the spec does not pass")
        if opts.get("wrapper") or opts.get("hookwrapper"):
            if not inspect.isgeneratorfunction(fn):
                raise ContractError(f"{attr} wraps {name}, so it must be a generator (`yield` to get the answer)")
        elif inspect.iscoroutinefunction(fn) != spec.slime_async:
            want = "async def" if spec.slime_async else "def"
            raise ContractError(f"{name} must be declared with `{want}`")
        if name == "slime_options":
            options = fn() if not params else fn(**{p: None for p in params})
            if not all(isinstance(o, Option) for o in options or []):
                raise ContractError("slime_options must return slimecore.config.Option objects")
    load_plugins([], extra=[plugin] if not isinstance(plugin, str) else [], defaults=False)
    return sorted(impls)
