"""What ``slime-core plugins`` lists, without importing every installed plugin each time.

A plugin's hooks are known only once its module is imported, and some import heavy libraries (a verifiers
environment pulls in several SDKs: 8 s here). Each plugin's row is kept in a small cache file, keyed by its
entry point, its distribution's name and version and its module file's size and modification time, so the
listing reads metadata alone until a plugin is installed, upgraded or edited.
"""

from __future__ import annotations

import importlib.util
import json
import os
from importlib.machinery import PathFinder
from pathlib import Path

import slimecore
from slimecore.plugins import DEFAULT_PLUGINS, PluginError, installed_entry_points, load_plugins


def cache_file() -> Path:
    """``$SLIMECORE_CACHE/plugins.json`` (default ``~/.cache/slimecore``, beside the converted default model)."""
    from slimecore.hf_checkpoint import cache_root

    return cache_root() / "plugins.json"


def module_file(module: str) -> Path | None:
    """The source file of the dotted ``module``, found without importing it or the packages above it."""
    try:
        spec = importlib.util.find_spec(module.split(".")[0])  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        return None
    for part in module.split(".")[1:]:
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return Path(spec.origin) if spec is not None and spec.origin and spec.has_location else None


def _stamp(module: str) -> str:
    path = module_file(module)
    if path is None or not path.is_file():
        return "?"
    stat = path.stat()
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


def _keys() -> dict[str, str]:
    """Plugin name -> cache key, in listing order (the built-ins first)."""
    keys = {name: f"{name}|slime-core=={slimecore.__version__}|{_stamp(name)}" for name in DEFAULT_PLUGINS}
    for name, ep in sorted(installed_entry_points().items()):
        dist = f"{ep.dist.name}=={ep.dist.version}" if ep.dist else "?"
        keys[name] = f"{name}|{ep.value}|{dist}|{_stamp(ep.module)}"
    return keys


def _row(name: str) -> tuple[dict, bool]:
    """(the plugin's row, whether it loaded): importing it is the only way to learn its hooks."""
    try:
        info = load_plugins([name], defaults=False).plugins[0]
    except PluginError as exc:
        return {"name": name, "distribution": "?", "version": "?", "hooks": [], "origin": "error",
                "location": str(exc)}, False
    return {"name": info.name, "distribution": info.distribution or "slime-core",
            "version": info.version or slimecore.__version__, "hooks": info.hooks, "origin": info.origin,
            "location": info.location}, True


def plugin_rows(on_import=None) -> list[dict]:
    """Every built-in and installed plugin's row (name, distribution, version, hooks, origin, location), from
    the cache where its key is unchanged; ``on_import(names)`` is told which plugins are imported first (so the
    caller can say why it waits). A plugin that fails to load gets a row with origin ``error`` (never cached)."""
    path = cache_file()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    keys = _keys()
    missing = [name for name, key in keys.items() if key not in cached]
    if missing and on_import:
        on_import(missing)
    rows, fresh = [], {}
    for name, key in keys.items():
        if key in cached:
            row, ok = cached[key], True
        else:
            row, ok = _row(name)
        rows.append(row)
        if ok:
            fresh[key] = row
    if missing:
        try:  # written whole, then renamed: two listings at once never read half a file
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(fresh, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home: the listing still works, imported every time
    return rows
