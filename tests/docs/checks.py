"""Named checks for blocks that are neither commands nor code (``docs-test: check NAME``)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest

from plugserve.registry.errors import ManifestError
from plugserve.registry.manifest import load_manifest
from tests.docs.blocks import Block
from tests.docs.conftest import Project
from tests.helpers import ROOT


def cli_synopsis(block: Block, project: Project) -> None:
    """Every flag the synopsis gives a command is one its ``--help`` lists."""
    for command, flags in re.findall(
        r"^plugserve (\w+)(.*?)(?=^plugserve |\Z)", block.text, re.M | re.S
    ):
        helped = subprocess.run(
            [sys.executable, "-m", "plugserve", command, "--help"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        for flag in re.findall(r"--[a-z-]+", flags):
            assert flag in helped, f"{block.where}: `plugserve {command} --help` has no {flag}"


def manifest_error(block: Block, project: Project) -> None:
    """The error line a manifest whose version differs from its folder gets."""
    (line,) = block.text.strip().splitlines()
    shown_path, message = line.split(": ", 1)
    folder = project.folder / "errors" / shown_path.removesuffix("/plugin.toml")
    shutil.copytree(ROOT / "plugins/runner/iris/1.0.0", folder)
    version = re.search(r"'([^']+)' differs", message)
    assert version, f"{block.where}: the example is a version mismatch"
    manifest = folder / "plugin.toml"
    manifest.write_text(
        re.sub(
            r'version = "[^"]+"', f'version = "{version.group(1)}"', manifest.read_text(), count=1
        )
    )
    with pytest.raises(ManifestError) as error:
        load_manifest(folder)
    assert str(error.value) == f"{project.folder / 'errors'}/{line}", block.where


def file_list(block: Block, project: Project) -> None:
    """A folder's listing (the folder, then one entry a line): exactly what it holds."""
    folder, *entries = block.text.strip().splitlines()
    listed = {line.split()[0] for line in entries}
    held = {p.name + ("/" if p.is_dir() else "") for p in (ROOT / folder).iterdir()}
    assert listed == held, (
        f"{block.where}: lists {sorted(listed - held)}, leaves out {sorted(held - listed)}"
    )


CHECKS: dict[str, Callable[[Block, Project], None]] = {
    "file-list": file_list,
    "cli-synopsis": cli_synopsis,
    "manifest-error": manifest_error,
}
