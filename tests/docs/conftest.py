"""One project folder (and, when a block needs one, one live server) per doc file."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.docs.blocks import all_blocks
from tests.helpers import ROOT, ServerProcess


class Project:
    """What a doc's reader has: a project folder with the bundled plugins/ and models/,
    a package staged in build/iris-2.0.0/, and a server on that plugins folder.

    In example outputs, ``/home/me/proj`` stands for this folder.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        shutil.copytree(ROOT / "plugins", folder / "plugins")
        shutil.copytree(ROOT / "models", folder / "models")
        staged = folder / "build" / "iris-2.0.0"
        shutil.copytree(ROOT / "plugins" / "runner" / "iris" / "1.0.0", staged)
        manifest = staged / "plugin.toml"
        manifest.write_text(manifest.read_text().replace('"1.0.0"', '"2.0.0"', 1))
        self._server: ServerProcess | None = None

    @property
    def server(self) -> ServerProcess:
        """Started on first use, on this project's plugins and models."""
        if self._server is None:
            self._server = ServerProcess(
                "--plugins-dir", str(self.folder / "plugins"),
                "--models-dir", str(self.folder / "models"),
                log=self.folder.parent / "server.log",
            ).wait_ready(60)  # fmt: skip
        return self._server

    def localize(self, text: str) -> str:
        """The doc's addresses made this server's."""
        if not any(a in text for a in ("localhost:800", "127.0.0.1:800")):
            return text
        server = self.server
        for host in ("localhost", "127.0.0.1"):
            text = text.replace(f"{host}:8000", f"127.0.0.1:{server.port}")
            text = text.replace(f"{host}:8001", server.grpc_url)
        return text

    def env(self) -> dict[str, str]:
        """This interpreter's scripts (plugserve, python) first on PATH."""
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return {**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1"}

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()


@pytest.fixture(scope="session")
def projects(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Project]]:
    made: dict[str, Project] = {}

    class Projects(dict[str, Project]):
        def __missing__(self, doc: str) -> Project:
            folder = tmp_path_factory.mktemp(doc.replace("/", "-")) / "proj"
            made[doc] = self[doc] = Project(folder)
            return made[doc]

    yield Projects()
    for project in made.values():
        project.close()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """List every block the docs test skips, with its reason: nothing skipped silently."""
    skipped = [b for b in all_blocks() if b.marker == "skip"]
    ran = terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
    if not any("tests/docs/" in report.nodeid for report in ran):
        return
    terminalreporter.section(f"docs-test: {len(skipped)} blocks skipped by their markers")
    for block in skipped:
        terminalreporter.write_line(f"{block.doc}:{block.line}: {block.reason}")
