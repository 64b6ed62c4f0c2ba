"""deploy/systemd/plugserve.service: systemd's own check, and the server's settings."""

from __future__ import annotations

import configparser
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from plugserve.server.runtime.shutdown import SHUTDOWN_MARGIN_S
from tests.deploy.files import SYSTEMD, serve_settings, split_command

UNIT = SYSTEMD / "plugserve.service"
INSTALLED = "/opt/plugserve/bin/plugserve"
"""Where the unit expects plugserve (a virtual environment in /opt/plugserve)."""


def _unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read(UNIT)
    return unit


def _verify(unit_text: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` on ``unit_text``, plugserve being this environment's."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (Debian's systemd package)")
    here = shutil.which("plugserve", path=str(Path(sys.executable).parent))
    assert here is not None, "plugserve is not installed in this environment"
    path = folder / "plugserve.service"
    path.write_text(unit_text.replace(INSTALLED, here))
    return subprocess.run(
        [analyze, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60
    )


def test_systemd_analyze_finds_nothing(tmp_path: Path) -> None:
    done = _verify(UNIT.read_text(), tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout + done.stderr == ""  # verify reports mistakes as warnings, exit 0


def test_systemd_analyze_catches_a_mistake(tmp_path: Path) -> None:
    """A misspelt directive is reported (so silence above means something)."""
    bad = UNIT.read_text().replace("KillMode=mixed", "KillMode=mixd")
    done = _verify(bad, tmp_path)
    assert "KillMode" in done.stdout + done.stderr or "kill mode" in done.stderr


def _config(tmp_path: Path) -> tuple[list[str], str]:
    """ExecStart's arguments after the program, ``--config`` at ``tmp_path``; the config text."""
    argv = split_command(_unit()["Service"]["ExecStart"])
    assert argv[0] == INSTALLED
    config = argv.index("--config") + 1
    assert argv[config] == "/etc/plugserve/plugserve.toml"
    argv[config] = str(tmp_path / "plugserve.toml")
    return argv[1:], (SYSTEMD / "plugserve.toml").read_text()


def test_exec_start_is_a_command_plugserve_accepts(tmp_path: Path) -> None:
    argv, config = _config(tmp_path)
    environ = {"PLUGSERVE_ADMIN_TOKEN": "a" * 64, "PLUGSERVE_INFERENCE_TOKEN": "b" * 64}
    settings = serve_settings(argv, config, tmp_path, environ)
    assert settings.host == "0.0.0.0"
    assert str(settings.plugins_dir) == "/srv/plugserve/plugins"
    assert str(settings.models_dir) == "/srv/plugserve/models"
    assert settings.admin_token == "a" * 64


def test_stop_outlasts_the_drain(tmp_path: Path) -> None:
    service = _unit()["Service"]
    argv, config = _config(tmp_path)
    settings = serve_settings(argv, config, tmp_path)
    assert service["KillSignal"] == signal.SIGTERM.name
    # The supervisor alone is signalled; it drains its workers (docs/operations.md).
    assert service["KillMode"] == "mixed"
    assert float(service["TimeoutStopSec"]) > settings.drain_timeout_s + SHUTDOWN_MARGIN_S


def test_unit_is_hardened(tmp_path: Path) -> None:
    service = _unit()["Service"]
    assert service["User"] not in ("root", "0")
    assert service["Type"] in ("exec", "simple")
    assert service["EnvironmentFile"].lstrip("-").startswith("/etc/plugserve/")
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
    }.items():
        assert service[key] == value, key
    # The server writes its runtime routes file, never the plugins or models.
    argv, config = _config(tmp_path)
    settings = serve_settings(argv, config, tmp_path)
    writable = service.get("ReadWritePaths", "").split() + [
        f"/var/lib/{d}" for d in service.get("StateDirectory", "").split()
    ]
    assert settings.runtime_routes_file is not None
    assert any(settings.runtime_routes_file.is_relative_to(w) for w in writable)
    for folder in (settings.plugins_dir, settings.models_dir):
        assert not any(folder.is_relative_to(w) for w in writable), folder
