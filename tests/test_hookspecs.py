"""Like datasette's test_docs: every hook is documented, listed in docs/hooks.md and has a test."""

import inspect
import re
from pathlib import Path

import pytest

from slimecore.plugins import SPECS, Hooks, load_plugins

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
    assert re.search(rf"\b{name}\b", _test_sources()), f"no test exercises {name}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_facade_has_a_method_named_as_the_hook_with_its_parameters(name):
    """``hooks.slime_loss(...)`` is written where the loss is called, so ``grep slime_loss`` finds the call sites."""
    method = getattr(Hooks, name, None)
    assert method is not None, f"Hooks has no method {name}"
    params = list(inspect.signature(method).parameters.values())[1:]
    assert [p.name for p in params] == list(inspect.signature(SPECS[name]).parameters), name
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), f"{name}: keyword arguments only"
    if SPECS[name].slime_async:
        assert inspect.iscoroutinefunction(method), f"Hooks.{name} must be async, as the hook is"
    assert re.search(rf"^    (async )?def {name}\(", inspect.getsource(Hooks), re.MULTILINE)


def test_the_facade_dispatches_nothing_by_attribute_name():
    assert "__getattr__" not in vars(Hooks) and "__getattribute__" not in vars(Hooks)
    hooks = load_plugins([])
    with pytest.raises(AttributeError):
        hooks.loss  # noqa: B018 - the old short names are gone


def test_async_specs_are_coroutines():
    for name, fn in SPECS.items():
        assert inspect.iscoroutinefunction(fn) == fn.slime_async, name
