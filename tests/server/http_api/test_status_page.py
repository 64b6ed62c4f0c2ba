"""The status page in a real headless Chromium (Debian's `chromium`; .ci/run installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import ServerProcess, write_add_runner, write_plugin

pytestmark = [
    pytest.mark.slow,
    pytest.mark.workers(1, 2),
    pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed"),
]

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--virtual-time-budget=10000",
]  # fmt: skip


def chromium(tmp_path: Path, *args: str) -> str:
    profile = tmp_path / f"chromium-{len(list(tmp_path.glob('chromium-*')))}"
    result = subprocess.run(
        ["chromium", *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_status_page_shows_plugins_routes_and_rates(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0")
    write_add_runner(plugins_dir, "other", "1.0.0")
    write_add_runner(plugins_dir, "other", "2.0.0")
    (plugins_dir / "routes.toml").write_text(
        '[routes.split]\nrunner = { "other@1.0.0" = 3, "other@2.0.0" = 1 }\n'
    )
    write_plugin(plugins_dir, "preprocessor", "broken", "0.1.0", files={"plugin.py": "1/0"})
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 env={"PLUGSERVE_ADMIN_TOKEN": "page-token"})  # fmt: skip
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}]}
    for _ in range(3):
        assert srv.request("POST", "/v2/models/add/infer", body)[0] == 200
    url = f"{srv.url}/admin/#token=page-token"
    dom = chromium(tmp_path, "--dump-dom", url)
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", dom)
    assert "runner/add@1.0.0" in cells  # the route and what serves it
    assert "runner/add" in cells
    assert "ready" in cells
    assert any(c.startswith("failed: ") and "ZeroDivisionError" in c for c in cells)
    assert "3" in cells  # requests served on the route
    assert "other@1.0.0 75.0% · other@2.0.0 25.0%" in cells  # a weighted route's split
    assert re.search(r"version [^ ]+ · up \d+ s · 4 plugin versions · 3 routes", dom)
    screenshot = tmp_path / "status.png"
    chromium(tmp_path, "--window-size=1100,600", f"--screenshot={screenshot}", url)
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot.stat().st_size > 10_000  # a rendered page, not a blank one
    # Without the token the shell loads, and says why it has no data.
    dom = chromium(tmp_path, "--dump-dom", f"{srv.url}/admin/")
    assert "status 401" in dom
    assert "runner/add" not in dom
