"""CONTRIBUTING.md's habits hold: the pre-commit hooks run what CI runs, the fast loop is
the one the guide names, and a commit subject is one line."""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType

import pytest
import yaml

from tests.helpers import ROOT


def hooks() -> dict[str, dict[str, object]]:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    return {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}


def ci_checks() -> list[str]:
    """The lint, format, type and layer commands of .ci/run."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [line.strip() for line in lines if line.startswith(("ruff ", "mypy", "lint-imports"))]


def test_the_hooks_run_what_ci_runs() -> None:
    entries = {str(hook["entry"]) for hook in hooks().values()}
    checks = ci_checks()
    assert len(checks) == 4, checks
    assert set(checks) <= entries, set(checks) - entries


def test_the_fast_loop_is_the_one_the_guide_names() -> None:
    guide = (ROOT / "CONTRIBUTING.md").read_text()
    fast = re.search(r"\| fast \| `([^`]+)` \|", guide)
    assert fast is not None, "CONTRIBUTING.md names no fast loop"
    assert hooks()["fast-tests"]["entry"] == f"{fast.group(1)} -q"
    assert hooks()["fast-tests"]["stages"] == ["pre-push"]


def commit_msg() -> ModuleType:
    spec = importlib.util.spec_from_file_location("commit_msg", ROOT / ".ci" / "commit_msg.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("message", "wrong"),
    [
        ("Settings declared once\n\nWhy it changed.\n", None),
        ("One line\n", None),
        ("# a comment git strips\nOne line\n", None),
        ("", "empty"),
        ("x" * 101 + "\n", "101 characters"),
        ("Subject\nbody right under it\n", "blank line"),
    ],
)
def test_a_commit_subject_is_one_line(message: str, wrong: str | None) -> None:
    found = commit_msg().problem(message)
    assert found is None if wrong is None else wrong in (found or ""), found
