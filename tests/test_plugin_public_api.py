"""The plugins shipped in plugins/ use only slime-core's public API: no private name (``_x``) imported from slimecore
or from another plugin's package, and no built-in plugin's hook function called directly (compose through hooks, or
call the public helper the built-in uses)."""

import ast
import sys
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parent.parent / "plugins"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package(path: Path) -> str:
    """The import name of the plugin package that holds ``path`` (``plugins/grpo/...`` -> ``slime_grpo``)."""
    root = PLUGINS / path.relative_to(PLUGINS).parts[0]
    return next(p.name for p in root.iterdir() if (p / "__init__.py").is_file())


def _foreign(module: str, own: str) -> bool:
    top = module.split(".")[0]
    return top == "slimecore" or (top.startswith("slime_") and top != own)


def violations(path: Path) -> list[str]:
    """What in ``path`` reaches past the public API, as ``file:line: what`` strings."""
    own, where = _package(path), path.relative_to(PLUGINS.parent)
    tree = ast.parse(path.read_text(), str(path))
    found, builtin_modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _foreign(node.module, own):
            for part in node.module.split("."):
                if _private(part):
                    found.append(f"{where}:{node.lineno}: imports the private module {node.module}")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{where}:{node.lineno}: imports the private name {alias.name} from {node.module}")
                if node.module == "slimecore.defaults" or node.module.startswith("slimecore.defaults."):
                    if alias.name.startswith("slime_"):
                        found.append(f"{where}:{node.lineno}: imports the built-in hook function {alias.name}")
                    builtin_modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _foreign(alias.name, own) and any(_private(part) for part in alias.name.split(".")):
                    found.append(f"{where}:{node.lineno}: imports the private module {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in builtin_modules:
            if node.attr.startswith("slime_") or _private(node.attr):
                found.append(f"{where}:{node.lineno}: uses {node.value.id}.{node.attr} of a built-in plugin")
    return found


SOURCES = sorted(p for p in PLUGINS.rglob("*.py") if "build" not in p.parts)


def test_plugins_are_found():
    assert {p.relative_to(PLUGINS).parts[0] for p in SOURCES} >= {"grpo", "gspo", "ppo", "sft", "search_r1"}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PLUGINS)))
def test_plugin_uses_only_the_public_api(path):
    assert violations(path) == []


def test_the_check_catches_what_it_forbids(tmp_path, monkeypatch):
    root = tmp_path / "plugins"
    package = root / "demo" / "slime_demo"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "own.py").write_text("def _mine():\n    pass\n")
    plugin = package / "plugin.py"
    plugin.write_text("from slimecore.data.dataset import _json_rows\n"
                      "from slimecore.defaults import data as builtin_data\n"
                      "from slime_grpo.algorithm import _helper\n"
                      "import slimecore._internal\n"
                      "from slime_demo.own import _mine\n"  # its own package: allowed
                      "source = builtin_data.slime_data_source(None, None, None)\n")
    monkeypatch.setattr(sys.modules[__name__], "PLUGINS", root)
    found = violations(plugin)
    assert [line.split(": ", 1)[1] for line in found] == [
        "imports the private name _json_rows from slimecore.data.dataset",
        "imports the private name _helper from slime_grpo.algorithm",
        "imports the private module slimecore._internal",
        "uses builtin_data.slime_data_source of a built-in plugin",
    ]
