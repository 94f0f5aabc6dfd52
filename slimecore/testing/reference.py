"""Run functions of a reference framework's source (slime's, Miles') on fixed inputs, to make oracle vectors.

A plugin's test data generator (``plugins/*/tests/oracle/make_vectors.py``) reads a file of slime or Miles at a
pinned commit (``git show COMMIT:path`` in a local clone), loads the pure-torch functions it names with
:func:`load_functions`, runs them on fixed inputs and writes the outputs as JSON beside the tests. The tests
then compare the plugin's own implementation with those vectors; neither the tests nor the plugin import the
reference code, and none of it is kept in this repository.

Only the named functions (and the module's top-level constants and the helpers they call, if also named) are
executed: decorators such as ``@torch.compile`` are dropped (same maths, no compiler), and the module's own
imports of its package (relative ones, ``slime.*``, ``miles.*``, ``megatron``, ``aiohttp``) are skipped, so the functions must
not need them.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import subprocess
import typing
from pathlib import Path

SKIPPED_IMPORTS = ("slime", "miles", "megatron", "aiohttp", "sglang", "transformers", "ray")


def git_show(repo: str | Path, commit: str, path: str) -> str:
    """The text of ``path`` at ``commit`` in the git repository (or bare git directory) ``repo``."""
    return subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def load_functions(source: str, names: list[str]) -> dict[str, typing.Callable]:
    """Execute the top-level constants, allowed imports and the functions ``names`` of ``source``; return the
    functions by name. Raises KeyError naming a function the source does not define."""
    tree = ast.parse(source)
    kept: list[ast.stmt] = []
    defined = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if getattr(node, "level", 0) or (module and module.split(".")[0] in SKIPPED_IMPORTS):
                continue  # the package's own modules (relative or by name) are not loaded
            kept.append(node)
        elif isinstance(node, ast.Assign) or (isinstance(node, ast.AnnAssign) and node.value is not None):
            kept.append(node)
        elif isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            kept.append(node)
            defined.add(node.name)
    missing = [n for n in names if n not in defined]
    if missing:
        raise KeyError(f"the reference source defines no function {missing}")
    namespace: dict = {"__name__": "reference", "Namespace": argparse.Namespace, "Any": typing.Any, "math": math}
    for node in kept:  # a constant whose value needs a skipped name is left out, not fatal
        try:
            exec(compile(ast.Module(body=[node], type_ignores=[]), "<reference>", "exec"), namespace)
        except NameError:
            if isinstance(node, ast.FunctionDef):
                raise
    return {n: namespace[n] for n in names}


def to_json(value):
    """Tensors (and nested lists/dicts/tuples of them) as plain JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def write_vectors(path: str | Path, provenance: dict, cases: list[dict]) -> None:
    """Write ``{"provenance": ..., "cases": [...]}`` as JSON, one case per line."""
    lines = ",\n".join(json.dumps(case) for case in to_json(cases))
    Path(path).write_text(f'{{"provenance": {json.dumps(provenance, indent=1)},\n"cases": [\n{lines}\n]}}\n')


def read_vectors(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
