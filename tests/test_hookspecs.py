"""Like datasette's test_docs: every hook is documented, listed in docs/hooks.md and has a test."""

import inspect
import re
from pathlib import Path

import pytest

from slimecore.plugins import SPECS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hook_has_documentation_saying_where_it_is_called(name):
    doc = inspect.getdoc(SPECS[name]) or ""
    assert "Called in:" in doc, f"{name}'s docstring must say which process calls it ('Called in: ...')"
    assert SPECS[name].slime_kind in ("all", "one", "first")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hook_is_in_the_docs(name):
    assert re.search(rf"\b{name}\b", (ROOT / "docs" / "hooks.md").read_text()), f"docs/hooks.md lacks {name}"


def _test_sources() -> str:
    files = [p for p in (ROOT / "tests").glob("*.py") if p.name != "test_hookspecs.py"]  # plugins used by tests too
    files += list((ROOT / "plugins").glob("*/tests/test_*.py"))
    return "\n".join(p.read_text() for p in files)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hook_has_a_test(name):
    short = name.removeprefix("slime_")
    sources = _test_sources()
    assert re.search(rf"\b{name}\b|hooks\.{short}\(", sources), f"no test exercises {name}"


def test_async_specs_are_coroutines():
    for name, fn in SPECS.items():
        assert inspect.iscoroutinefunction(fn) == fn.slime_async, name
