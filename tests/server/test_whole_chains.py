"""A route moves only to a whole chain, end to end: a real server subprocess, plugin
versions dropped into its plugins dir while requests run.

A ready runner version whose chain cannot be built (a pinned stage not installed, a
floating one whose only version failed) waits: the route keeps the chain it has, the
admin API and the log say what the version waits for, and the route moves by itself
once the missing stage is ready.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.helpers import ServerProcess, processor_source, until, write_add_runner, write_plugin

pytestmark = pytest.mark.slow

X = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]}
ADDONE_PINNED = '[route]\npreprocess = ["addone@1.0.0"]\n'

FAILING_PROCESSOR = """
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    @hookimpl
    def plugserve_create_component(plugin, config):
        raise RuntimeError("no accelerator for this stage")
"""


def get(srv: ServerProcess, path: str) -> Any:
    status, _, body = srv.request("GET", path)
    assert status == 200, body
    return json.loads(body)


def plugin_row(srv: ServerProcess, label: str) -> dict[str, Any] | None:
    """The version's ``/admin/plugins`` row once every worker has it in one state."""
    for row in get(srv, "/admin/plugins")["plugins"]:
        if f"{row['type']}/{row['name']}@{row['version']}" == label and "states" not in row:
            return dict(row)
    return None


def route(srv: ServerProcess, name: str) -> dict[str, Any]:
    return next(r for r in get(srv, "/admin/routes")["routes"] if r["name"] == name)


def infer(srv: ServerProcess, name: str, version: str = "") -> tuple[int, str, float | str]:
    """Status, runner version and ``y[0]`` (or the error) of one v2 request."""
    path = f"/v2/models/{name}/versions/{version}/infer" if version else f"/v2/models/{name}/infer"
    status, _, body = srv.request("POST", path, X)
    doc = json.loads(body)
    if status != 200:
        return status, "", doc["error"]
    return status, doc["model_version"], doc["outputs"][0]["data"][0]


def drop(staging: Path, plugins_dir: Path, folder: Path) -> None:
    """Move a plugin version written under ``staging`` into the plugins dir in one rename."""
    target = plugins_dir / folder.relative_to(staging)
    target.parent.mkdir(parents=True, exist_ok=True)
    folder.rename(target)


def write_processor(root: Path, name: str, version: str, amount: float = 1) -> Path:
    return write_plugin(
        root,
        "preprocessor",
        name,
        version,
        f"[config]\namount = {amount}\n",
        {"plugin.py": processor_source("preprocessor")},
    )


class Traffic:
    """Requests to a route one after another, in a thread, until stopped."""

    def __init__(self, srv: ServerProcess, name: str) -> None:
        self.answers: list[tuple[int, str, float | str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(srv, name), daemon=True)
        self._thread.start()

    def _run(self, srv: ServerProcess, name: str) -> None:
        while not self._stop.is_set():
            self.answers.append(infer(srv, name))

    def more(self, count: int) -> None:
        """Wait until ``count`` more requests have been answered."""
        target = len(self.answers) + count
        until(lambda: len(self.answers) >= target, 20)

    def stop(self) -> list[tuple[int, str, float | str]]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.answers


@pytest.fixture
def staging(tmp_path: Path) -> Path:
    folder = tmp_path / "staging"
    folder.mkdir()
    return folder


@pytest.mark.workers(1, 2)
def test_a_version_pinning_a_missing_processor_waits_and_the_route_moves_when_it_arrives(
    plugins_dir: Path,
    models_dir: Path,
    staging: Path,
    server: Callable[..., ServerProcess],
    workers: int,
) -> None:
    """Issue 29 finding 9: runner 2.0.0 pinning ``addone@1.0.0`` took its route as soon as
    it was ready, and requests got 503 'preprocessor addone@1.0.0 is not installed' until
    the processor arrived. The route stays on 1.0.0 (every request 200) while the admin
    API and the log say what 2.0.0 waits for, then moves to 2.0.0 by itself once the
    processor is dropped in, without one request failing."""
    write_add_runner(plugins_dir, "ocr", "1.0.0", amount=1)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    traffic = Traffic(srv, "ocr")
    try:
        traffic.more(5)
        drop(staging, plugins_dir, write_add_runner(staging, "ocr", "2.0.0", 2, ADDONE_PINNED))
        until(lambda: (plugin_row(srv, "runner/ocr@2.0.0") or {}).get("state") == "ready", 20)
        traffic.more(20)
        waiting = route(srv, "ocr").get("waiting")
        row = plugin_row(srv, "runner/ocr@2.0.0")
        drop(staging, plugins_dir, write_processor(staging, "addone", "1.0.0"))
        # Ready in every worker: each has rebuilt its table with it, in the same step.
        until(
            lambda: (plugin_row(srv, "preprocessor/addone@1.0.0") or {}).get("state") == "ready", 20
        )
        until(lambda: traffic.answers[-10:] == [(200, "2.0.0", 3.0)] * 10, 20)
    finally:
        answers = traffic.stop()
    failed = [a for a in answers if a[0] != 200]
    assert not failed, f"{len(failed)} of {len(answers)} requests failed: {failed[:3]}"
    served = [a[1:] for a in answers]
    assert set(served) == {("1.0.0", 1.0), ("2.0.0", 3.0)}
    if workers == 1:  # once moved, it stays (each worker moves on its own)
        assert ("1.0.0", 1.0) not in served[served.index(("2.0.0", 3.0)) :]
    reasons = ["preprocessor addone@1.0.0 is not installed"]
    assert waiting == [{"runner": "ocr@2.0.0", "waiting_for": reasons}]
    assert row is not None and row.get("waiting_for") == reasons
    assert route(srv, "ocr")["waiting"] == []
    assert "waiting_for" not in (plugin_row(srv, "runner/ocr@2.0.0") or {})
    log = srv.log()
    assert "route_waiting" in log and "addone@1.0.0 is not installed" in log
    assert "route_chain_whole" in log


def test_a_floating_stage_whose_only_version_fails_keeps_the_route_on_the_old_chain(
    plugins_dir: Path, models_dir: Path, staging: Path, server: Callable[..., ServerProcess]
) -> None:
    """Issue 29 finding 9, a variant: the new version's stage floats (``preprocess =
    ["flaky"]``) and its only version fails in ``plugserve_create_component``; over gRPC,
    the route keeps 1.0.0, version 2.0.0 asked for by name is UNAVAILABLE saying why (so
    is Triton's repository index), and a later good version of the stage moves the route."""
    write_add_runner(plugins_dir, "ocr", "1.0.0", amount=1)
    write_plugin(
        plugins_dir, "preprocessor", "flaky", "1.0.0", files={"plugin.py": FAILING_PROCESSOR}
    )
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    assert (plugin_row(srv, "preprocessor/flaky@1.0.0") or {}).get("state") == "failed"
    floating = '[route]\npreprocess = ["flaky"]\n'
    drop(staging, plugins_dir, write_add_runner(staging, "ocr", "2.0.0", 2, floating))
    until(lambda: (plugin_row(srv, "runner/ocr@2.0.0") or {}).get("state") == "ready", 20)

    client = grpcclient.InferenceServerClient(srv.grpc_url)
    x = grpcclient.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.zeros((1, 4), np.float32))

    def grpc_infer(version: str = "") -> tuple[str, float]:
        result = client.infer("ocr", [x], model_version=version)
        answer = result.get_response()
        return answer.model_version, float(result.as_numpy("y")[0][0])

    for _ in range(10):
        assert grpc_infer() == ("1.0.0", 1.0)
    with pytest.raises(InferenceServerException) as refused:
        grpc_infer("2.0.0")
    assert "ocr@2.0.0 waits for its chain" in str(refused.value)
    assert "preprocessor flaky has no ready version (1.0.0 failed" in str(refused.value)
    assert "no accelerator for this stage" in str(refused.value)
    [waiting] = route(srv, "ocr")["waiting"]
    assert waiting["runner"] == "ocr@2.0.0"
    assert "no accelerator for this stage" in waiting["waiting_for"][0]
    assert client.is_model_ready("ocr") and not client.is_model_ready("ocr", "2.0.0")
    index = client.get_model_repository_index(as_json=True)["models"]
    row = next(m for m in index if m["name"] == "ocr" and m["version"] == "2.0.0")
    assert row["state"] == "UNAVAILABLE" and "ocr@2.0.0 waits for its chain" in row["reason"]

    drop(staging, plugins_dir, write_processor(staging, "flaky", "1.1.0"))
    until(lambda: grpc_infer() == ("2.0.0", 3.0), 20)
    assert route(srv, "ocr")["waiting"] == []
    client.close()


def test_a_first_route_whose_stage_is_missing_says_what_it_waits_for(
    plugins_dir: Path, models_dir: Path, staging: Path, server: Callable[..., ServerProcess]
) -> None:
    """Issue 29 finding 9, a variant: a route with no chain yet (its only runner version
    pins a processor not installed) answers 503 naming what the version waits for, is not
    ready, and serves once the processor is dropped in."""
    write_add_runner(plugins_dir, "fresh", "1.0.0", amount=2, route=ADDONE_PINNED)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--no-strict-readiness")  # fmt: skip
    status, _, error = infer(srv, "fresh")
    assert status == 503
    assert error == (
        "route 'fresh': fresh@1.0.0 waits for its chain: preprocessor addone@1.0.0 is not installed"
    )
    assert srv.request("GET", "/v2/models/fresh/ready")[0] == 503
    described = route(srv, "fresh")
    assert described["ready"] is False and described["error"] == error
    assert described["waiting"] == [
        {"runner": "fresh@1.0.0", "waiting_for": ["preprocessor addone@1.0.0 is not installed"]}
    ]
    drop(staging, plugins_dir, write_processor(staging, "addone", "1.0.0"))
    until(lambda: infer(srv, "fresh") == (200, "1.0.0", 3.0), 20)
    assert route(srv, "fresh")["ready"] is True
