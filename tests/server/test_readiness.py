"""Readiness that tells the truth: at start-up the server is ready only once every route can
serve (strict, as Triton's), the answer, ``/admin/status`` and the log naming each route
that cannot and why; once it has been ready, a route that fails is reported and never
takes readiness away: a failed reload keeps its previous version serving, a bad new drop
leaves the others served, and a worker started again later does not start over."""

from __future__ import annotations

import json
import os
import signal
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ServerProcess, until, write_plugin, write_sequence_runner

ECHO = """
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Echo:
        def infer(self, inputs):
            return {"y": np.asarray(inputs["x"]) + 1}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Echo()
"""

BROKEN = """
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    @hookimpl
    def plugserve_create_component(plugin, config):
        raise RuntimeError("the weights are missing")
"""


def runner(plugins_dir: Path, name: str, source: str, version: str = "1.0.0") -> Path:
    return write_plugin(plugins_dir, "runner", name, version, "", {"plugin.py": source})


def ready(srv: ServerProcess) -> tuple[int, dict[str, Any]]:
    try:
        code, _, body = srv.request("GET", "/v2/health/ready")
    except OSError:  # not listening yet
        return 0, {}
    return code, json.loads(body)


def readiness(srv: ServerProcess) -> dict[str, Any]:
    code, _, body = srv.request("GET", "/admin/status")
    assert code == 200, body
    return json.loads(body)["readiness"]  # type: ignore[no-any-return]


def predict(srv: ServerProcess, route: str) -> int:
    return srv.request("POST", f"/predict/{route}", {"x": [1.0]})[0]


@pytest.mark.workers(1, 2)
def test_a_route_that_fails_at_start_keeps_the_server_unready_until_it_serves(
    server: Callable[..., ServerProcess], plugins_dir: Path, models_dir: Path
) -> None:
    runner(plugins_dir, "good", ECHO)
    folder = runner(plugins_dir, "bad", BROKEN)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir), ready=False)
    _, body = until(lambda: (answer := ready(srv))[0] == 503 and "unserved" in answer[1]
                       and answer, 20, what="the unready answer naming the route")  # fmt: skip
    assert set(body["unserved"]) == {"bad"}, body
    assert "the weights are missing" in body["unserved"]["bad"]
    assert "strict_readiness" in body["error"]  # the way to a partial start
    status = readiness(srv)
    assert status["ready"] is False and set(status["unserved"]) == {"bad"}
    assert predict(srv, "good") == 200  # what can serve does
    assert "route_cannot_serve" in srv.log()
    (folder / "plugin.py").write_text(textwrap.dedent(ECHO))
    until(lambda: ready(srv)[0] == 200, 20, what="ready once the route serves")
    assert ready(srv)[1] == {"ready": True}
    assert predict(srv, "bad") == 200


@pytest.mark.workers(1, 2)
def test_once_ready_a_failed_reload_or_a_bad_drop_never_takes_readiness_away(
    workers: int, server: Callable[..., ServerProcess], plugins_dir: Path, models_dir: Path
) -> None:
    folder = runner(plugins_dir, "good", ECHO)
    runner(plugins_dir, "other", ECHO)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    runner(plugins_dir, "dropped", BROKEN)  # a new route that cannot serve
    until(lambda: "dropped" in ready(srv)[1].get("unserved", {}), 20, what="the drop reported")
    (folder / "plugin.py").write_text(
        textwrap.dedent(BROKEN)
    )  # a reload that fails: 1.0.0 keeps serving
    until(lambda: "the weights are missing" in json.dumps(plugin(srv, "good")), 20, what="failed")
    code, body = ready(srv)
    assert code == 200 and set(body["unserved"]) == {"dropped"}, body
    assert predict(srv, "good") == 200 and predict(srv, "other") == 200
    if workers > 1:  # a worker started again does not go back to start-up's strictness
        pids = worker_pids(srv)
        os.kill(min(pids), signal.SIGKILL)
        until(lambda: len(worker_pids(srv)) == 2 and min(pids) not in worker_pids(srv),
              30, "the worker replaced")  # fmt: skip
        assert {ready(srv)[0] for _ in range(20)} == {200}  # new connections: both workers


def test_a_partial_start_is_ready_and_says_what_cannot_serve(
    server: Callable[..., ServerProcess], plugins_dir: Path, models_dir: Path
) -> None:
    runner(plugins_dir, "good", ECHO)
    runner(plugins_dir, "bad", BROKEN)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--no-strict-readiness")  # fmt: skip
    code, body = ready(srv)
    assert code == 200 and set(body["unserved"]) == {"bad"}, body
    assert readiness(srv)["ready"] is True


def test_a_sequence_runner_refused_in_several_workers_keeps_the_server_unready(
    server: Callable[..., ServerProcess], plugins_dir: Path, models_dir: Path
) -> None:
    """The in-worker sequence runner cannot keep its state across workers: the server does
    not say ready while the route it serves answers 503."""
    write_sequence_runner(plugins_dir, "acc")
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--workers", "2", ready=False)  # fmt: skip
    _, body = until(lambda: (answer := ready(srv))[0] == 503 and "unserved" in answer[1]
                       and answer, 30, "the unready answer")  # fmt: skip
    assert set(body["unserved"]) == {"acc"} and "isolation" in body["unserved"]["acc"], body


def plugin(srv: ServerProcess, name: str) -> dict[str, Any]:
    code, _, body = srv.request("GET", "/admin/plugins")
    assert code == 200, body
    (record,) = [p for p in json.loads(body)["plugins"] if p["name"] == name]
    return record  # type: ignore[no-any-return]


def worker_pids(srv: ServerProcess) -> set[int]:
    try:
        code, _, body = srv.request("GET", "/admin/status")
    except OSError:  # the connection went to the worker just killed
        return set()
    assert code == 200, body
    return {w["pid"] for w in json.loads(body)["workers"]}
