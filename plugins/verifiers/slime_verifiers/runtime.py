"""Verifiers' subprocess runtime, with its programs run on this interpreter instead of a fresh uv environment.

A Verifiers harness runs its agent program (the ``null`` and ``bash`` harnesses' chat loop, for instance) as a
PEP 723 script: the runtime's ``prepare_uv_script`` installs uv when missing, then ``uv sync --script`` resolves
the script's dependencies from the network. A training run may have neither network nor uv, while every
dependency of those programs is already installed here with ``verifiers`` itself. ``LocalInterpreterRuntime``
keeps everything else of ``SubprocessRuntime`` (a work directory per rollout, its own process group, the
environment it passes) and runs the script with ``sys.executable``, after checking that the script's declared
dependencies are installed, so a harness that needs something else fails at its setup naming the packages.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from verifiers.v1.runtimes import SubprocessConfig, SubprocessRuntime


class MissingProgramDependencies(RuntimeError):
    """A harness program declares packages this Python does not have."""


def script_dependencies(script: str) -> list[str]:
    """The ``dependencies`` of a PEP 723 ``# /// script`` block (none without one)."""
    lines, inside = [], False
    for line in script.splitlines():
        if line.strip() == "# /// script":
            inside = True
        elif inside and line.strip() == "# ///":
            return list(tomllib.loads("\n".join(lines)).get("dependencies", []))
        elif inside:
            lines.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
    return []


def missing_dependencies(requirements: list[str]) -> list[str]:
    """The requirements not satisfied by the installed distributions."""
    missing = []
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(text)
            continue
        if requirement.specifier and not requirement.specifier.contains(version, prereleases=True):
            missing.append(f"{text} (installed: {version})")
    return missing


class LocalInterpreterRuntime(SubprocessRuntime):
    """A verifiers runtime (``type = "subprocess"``) whose PEP 723 programs run on ``sys.executable``."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(SubprocessConfig(), name)

    async def prepare_uv_script(self, script: str | bytes, env: dict[str, str] | None = None, *,
                                activate: bool = True) -> list[str]:
        text = script.decode() if isinstance(script, bytes) else script
        missing = missing_dependencies(script_dependencies(text))
        if missing:
            raise MissingProgramDependencies(
                f"the harness program needs {missing}, which this Python ({sys.executable}) does not have; "
                "install them (python -m pip install ...) or pick a harness whose program needs only verifiers' "
                "own dependencies (--vf-harness null or bash)")
        path = Path(self.scripts_dir) / f"{hashlib.sha256(text.encode()).hexdigest()}.py"
        if not path.exists():  # content-addressed: concurrent rollouts write the same bytes
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(text)
            partial.replace(path)
        return [sys.executable, str(path)]
