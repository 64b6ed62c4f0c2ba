"""Every hook of the contract is documented (one template) and exercised by a test."""

import inspect
import re
from pathlib import Path

import pytest

from plugserve.registry import hookspecs

HOOKS = sorted(n for n in dir(hookspecs) if n.startswith("plugserve_"))
ROOT = Path(__file__).resolve().parents[2]


def test_the_contract_hooks_exist() -> None:
    assert HOOKS == [
        "plugserve_backends",
        "plugserve_create_component",
        "plugserve_shutdown",
        "plugserve_startup",
    ]


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_docstring_follows_the_template(hook: str) -> None:
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    assert ":return:" in doc
    assert "Example::" in doc
    assert "@hookimpl" in doc
    params = [p for p in inspect.signature(getattr(hookspecs, hook)).parameters]
    for param in params:
        assert f":param {param}:" in doc


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_is_documented_in_the_plugin_guide(hook: str) -> None:
    guide = (ROOT / "docs" / "plugins.md").read_text()
    assert re.search(rf"^#+ .*`{hook}", guide, re.MULTILINE), f"{hook} has no section"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_test(hook: str) -> None:
    tests = [p for p in (ROOT / "tests").rglob("test_*.py") if p.name != Path(__file__).name]
    assert any(hook in p.read_text() for p in tests), f"no test mentions {hook}"


def test_firstresult_hooks_are_synchronous_specs() -> None:
    create = hookspecs.plugserve_create_component
    assert create.plugserve_spec["firstresult"] is True  # type: ignore[attr-defined]
    assert not inspect.iscoroutinefunction(create)
