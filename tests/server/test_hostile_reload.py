"""Hostile values in files, end to end: a real server subprocess with its watcher.

issue 12, finding 1: ``rps = inf`` in ``routes.toml`` or ``plugin.toml`` stopped
the server at start with an OverflowError traceback; dropped in while running,
the version stuck in ``loading``, ``POST /admin/reload`` answered 500, and a bad
``routes.toml`` was silently ignored.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ServerProcess, until, write_add_runner

pytestmark = [pytest.mark.slow, pytest.mark.workers(1, 2)]

INF_LIMIT = "[route]\nrate_limit = { rps = inf }\n"
X = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]}


def get(srv: ServerProcess, path: str) -> Any:
    status, _, body = srv.request("GET", path)
    assert status == 200, body
    return json.loads(body)


def plugin_state(srv: ServerProcess, label: str) -> dict[str, Any] | None:
    for p in get(srv, "/admin/plugins")["plugins"]:
        if f"{p['type']}/{p['name']}@{p['version']}" == label:
            return dict(p)
    return None


def infer(srv: ServerProcess, route: str) -> int:
    return srv.request("POST", f"/v2/models/{route}/infer", X)[0]


def test_inf_in_routes_toml_and_plugin_toml_at_start_is_reported_not_a_crash(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """issue 12, finding 1: at start, each bad file is its own error; the server serves."""
    write_add_runner(plugins_dir, "good", "1.0.0")
    write_add_runner(plugins_dir, "bad", "1.0.0", route=INF_LIMIT)
    (plugins_dir / "routes.toml").write_text(
        '[routes.alias]\nrunner = "good"\nrate_limit = { rps = inf }\n'
    )
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--no-strict-readiness")  # fmt: skip
    bad = plugin_state(srv, "runner/bad@1.0.0")
    assert bad is not None and bad["state"] == "failed"
    assert "route.rate_limit.rps: must be a finite number" in bad["last_error"]
    error = get(srv, "/admin/routes")["routes_file"]["error"]
    assert "routes.alias.rate_limit.rps: must be a finite number" in error
    assert infer(srv, "good") == 200
    assert "Traceback" not in srv.log() and "OverflowError" not in srv.log()


def test_bad_files_dropped_in_while_running_fail_cleanly_and_are_reported(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """issue 12, finding 1: a version with ``rps = inf`` or a ~500-deep array fails (never
    stuck in ``loading``), ``POST /admin/reload`` answers 200, and a bad ``routes.toml`` is
    shown in ``GET /admin/routes`` and logged while the previous table keeps serving."""
    write_add_runner(plugins_dir, "good", "1.0.0")
    routes = plugins_dir / "routes.toml"
    routes.write_text('[routes.alias]\nrunner = "good"\n')
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    assert infer(srv, "alias") == 200

    staging = write_add_runner(plugins_dir, "good", ".2.0.0.tmp", route=INF_LIMIT)
    text = (staging / "plugin.toml").read_text().replace(".2.0.0.tmp", "2.0.0")
    (staging / "plugin.toml").write_text(text)
    staging.rename(staging.with_name("2.0.0"))
    failed = until(
        lambda: (p := plugin_state(srv, "runner/good@2.0.0")) and p["state"] == "failed" and p,
        15,
    )
    assert "route.rate_limit.rps" in failed["last_error"]

    deep = write_add_runner(plugins_dir, "deep", "1.0.0")
    with (deep / "plugin.toml").open("a") as f:
        f.write("[config]\nx = " + "[" * 500 + "]" * 500 + "\n")
    failed = until(
        lambda: (p := plugin_state(srv, "runner/deep@1.0.0")) and p["state"] == "failed" and p,
        15,
    )
    assert "deeper than" in failed["last_error"]

    routes.write_text('[routes.alias]\nrunner = "good"\nrate_limit = { rps = inf }\n')
    error = until(lambda: get(srv, "/admin/routes")["routes_file"]["error"], 15)
    assert "rate_limit.rps: must be a finite number" in error
    assert infer(srv, "alias") == 200  # the previous table keeps serving
    status, _, body = srv.request("POST", "/admin/reload")
    assert status == 200, body
    report = json.loads(body)
    assert report["routes_file"] == "unchanged"
    for label in ("runner/good@2.0.0", "runner/deep@1.0.0"):
        assert (plugin_state(srv, label) or {}).get("state") == "failed"
    assert get(srv, "/admin/routes")["routes_file"]["error"] == error  # not forgotten
    assert "routes_file_invalid" in srv.log()
    assert "Traceback" not in srv.log()

    routes.write_text('[routes.alias]\nrunner = "good"\nrate_limit = { rps = 100 }\n')
    until(lambda: get(srv, "/admin/routes")["routes_file"]["error"] is None, 15)
    assert infer(srv, "alias") == 200
