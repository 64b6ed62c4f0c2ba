"""The README's command synopsis leaves out no option of ``plugserve serve``,
``validate`` or ``new`` (``tests/docs/checks.py`` checks the other way: every flag it shows
exists)."""

import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def synopsis(command: str) -> str:
    """The README synopsis's lines for ``plugserve <command>``."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- docs-test: check cli-synopsis -->\n```\n(.*?)```", text, re.S)
    assert block is not None, "the README has no command synopsis"
    lines = re.search(
        rf"^plugserve {command}\b(.*?)(?=^plugserve |\Z)", block.group(1), re.M | re.S
    )
    assert lines is not None, f"the synopsis has no `plugserve {command}`"
    return lines.group(1)


@pytest.mark.parametrize("command", ["serve", "validate", "new"])
def test_every_option_of_the_command_is_in_the_readme_synopsis(command: str) -> None:
    helped = subprocess.run(
        [sys.executable, "-m", "plugserve", command, "--help"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", helped)) - {"--help"}
    assert {"serve": "--grpc-port", "validate": "--batching", "new": "--backend"}[
        command
    ] in options  # read whole
    shown = set(re.findall(r"--[a-z][a-z-]*", synopsis(command)))
    assert not options - shown, f"`plugserve {command}` options the README leaves out"
