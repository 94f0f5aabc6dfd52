"""Field names of SGLang's own request and argument classes, read from the installed ``sglang`` package.

``ServerArgs`` (``sglang.srt.server_args``) and the request classes of ``sglang.srt.managers.io_struct``
(``UpdateWeightsFromTensorReqInput``, ...) are read from their source with ``ast``, without importing
sglang: its import pulls triton, torchvision and CUDA kernels, which a CPU machine (or the driver, before
Ray starts) should not need. A class's fields are its annotated class attributes and those of its bases
in the same module, as for a dataclass or a msgspec ``Struct``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path


def sglang_root() -> Path | None:
    """The installed ``sglang`` package directory (found without importing it), or None."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=None)
def class_fields(module: str, class_name: str) -> dict[str, bool] | None:
    """``{field: required}`` of ``module.class_name`` in the installed sglang (``module`` relative to the
    package, e.g. ``srt.server_args``); None when sglang is not installed."""
    root = sglang_root()
    if root is None:
        return None
    path = root.joinpath(*module.split(".")).with_suffix(".py")
    classes = {node.name: node for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)}
    if class_name not in classes:
        raise LookupError(f"sglang {path} has no class {class_name}")

    def fields(name: str) -> dict[str, bool]:
        node, out = classes[name], {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(fields(base.id))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                annotation = ast.unparse(stmt.annotation)
                if not annotation.startswith("ClassVar"):
                    out[stmt.target.id] = stmt.value is None
        return out

    return fields(class_name)


def server_args_fields() -> dict[str, bool] | None:
    """SGLang's ``ServerArgs`` fields, or None when sglang is not installed."""
    return class_fields("srt.server_args", "ServerArgs")


def sglang_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None
