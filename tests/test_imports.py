"""No import circles among slimecore's modules, counting imports inside functions (a lazy import that closes a
circle still ties the two modules together) and those only for type checkers (a reader follows them too); the
layers of docs/architecture.md hold (no import from a lower layer to a higher one, no circle between the files
and folders of one layer); and every module imports in a fresh interpreter."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "slimecore"
SHIM = "slimecore.compat.slime"  # the `import slime` shim: importable only under the name slime


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(tree: ast.AST):
    """Every import node: at module level, inside functions and under ``if TYPE_CHECKING:``."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def import_graph() -> dict[str, set[str]]:
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {owner(alias.name) for alias in node.names}
                continue
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            targets |= {owner(f"{module}.{alias.name}") for alias in node.names}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_among_slimecore_modules():
    graph = import_graph()
    assert "slimecore.rollout.evaluation" in graph["slimecore.preflight"]  # the graph sees lazy imports
    assert "slimecore.protocols" in graph["slimecore.hookspecs"]  # and those only for type checkers
    assert cycles(graph) == []


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def documented_layers() -> dict[str, int]:
    """``{room: layer}`` from the table under "## Layers" in docs/architecture.md: a room is a file or folder of
    slimecore/ as written there (``config.py``, ``engines/``, ``compat/slime/``)."""
    section = ARCHITECTURE.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for number, rooms in re.findall(r"^\| (\d+) \|[^|]*\|(.*)\|$", section, flags=re.M):
        for room in re.findall(r"`([^`]+)`", rooms):
            assert room not in layers, f"{room} stands on two layers in docs/architecture.md"
            layers[room] = int(number)
    return layers


def room_of(module: str, rooms: set[str]) -> str:
    """The longest documented file or folder that holds ``module`` (``slimecore.engines.fleet`` -> ``engines/``)."""
    path = module.split(".")[1:]
    candidates = ["/".join(path[:i]) + "/" for i in range(len(path), 0, -1)] + ["/".join(path) + ".py"]
    if not path or _modules()[module].name == "__init__.py":
        candidates = ["/".join(path + ["__init__.py"])] + candidates
    return next((c for c in sorted(candidates, key=len, reverse=True) if c in rooms), "/".join(path) + ".py")


def test_imports_follow_the_layers_of_the_architecture_page():
    layers = documented_layers()
    assert layers["hookspecs.py"] == layers["protocols.py"] == layers["types.py"] == 1  # the contract is the ground
    graph = import_graph()
    room = {module: room_of(module, set(layers)) for module in graph}
    unplaced = sorted({r for r in room.values() if r not in layers})
    assert not unplaced, f"modules on no layer: give each a row in docs/architecture.md's Layers table: {unplaced}"
    upward, rooms = [], {}
    for module, targets in graph.items():
        for target in targets:
            a, b = room[module], room[target]
            if a != b:
                rooms.setdefault(a, set()).add(b)
                if layers[a] < layers[b]:
                    upward.append(f"{module} (layer {layers[a]}) imports {target} (layer {layers[b]})")
    assert upward == [], "imports from a lower layer to a higher one:\n" + "\n".join(sorted(upward))
    assert cycles(rooms) == [], "files or folders that import each other in a circle"


def test_the_cycle_check_finds_a_circle_through_a_lazy_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_imports_in_a_fresh_interpreter():
    names = [name for name in _modules() if not name.startswith(SHIM)]
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_driver_starts_without_torch():
    """What the driver imports before Ray (the CLI, the built-in plugins, the grpo plugin's options, the checks,
    the loop) loads no torch: 1.2 s of a 2-core machine, before the actors that need it even start."""
    code = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported by the driver")
sys.meta_path.insert(0, NoTorch())
import slimecore_cli.main, slimecore.preflight, slimecore.loop, slimecore.defaults.slime_compat, slimecore.ops.kl
from slimecore.plugins import load_plugins
load_plugins(["grpo"])
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
