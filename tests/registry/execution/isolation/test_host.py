"""The runner host's housekeeping (its processes are tested end to end in
tests/server/processes/test_isolation.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from plugserve.registry.execution.isolation.host import sweep_folders


def test_folders_of_servers_that_are_gone_are_swept(tmp_path: Path) -> None:
    """A server killed with SIGKILL cannot remove its runner-socket folder: the next one does."""
    dead = tmp_path / f"plugserve-runners-{_ended_pid()}-abc"
    live = tmp_path / f"plugserve-runners-{os.getpid()}-def"
    other = tmp_path / "plugserve-runners-notapid"
    for folder in (dead, live, other):
        folder.mkdir()
        (folder / "1.sock").write_text("")
    assert sweep_folders(tmp_path) == [dead]
    assert not dead.exists()
    assert live.exists()
    assert other.exists()


def _ended_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
