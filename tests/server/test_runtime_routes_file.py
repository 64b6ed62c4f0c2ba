"""``--runtime-routes-file`` under concurrent admin writes, through a real server."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import ServerProcess, write_add_runner

pytestmark = pytest.mark.workers(1, 2)

X = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]}


def test_concurrent_puts_are_all_saved_with_distinct_revisions_and_survive_a_restart(
    plugins_dir: Path,
    models_dir: Path,
    tmp_path: Path,
    server,  # type: ignore[no-untyped-def]
) -> None:
    """issue 12, finding 3: of 20 concurrent PUTs, 10 got 200 with repeated revisions and
    4 entries remained; the others got 503 (a shared temporary file). If-Match "0" on one
    new route let 8 writers through."""
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    state = tmp_path / "state" / "runtime-routes.json"
    args = ["--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir)]
    args += ["--runtime-routes-file", str(state)]
    first: ServerProcess = server(*args)
    names = [f"r{i}" for i in range(20)]

    def put(name: str, headers: dict[str, str] | None = None) -> tuple[int, int | None]:
        status, _, body = first.request(
            "PUT", f"/admin/routes/{name}", {"runner": "add@1.0.0"}, headers
        )
        return status, json.loads(body).get("revision")

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(put, names))
    assert [status for status, _ in answers] == [200] * 20, answers
    assert sorted(revision for _, revision in answers) == list(range(1, 21))  # type: ignore[type-var]
    saved = json.loads(state.read_text())
    assert saved["revision"] == 20 and sorted(saved["routes"]) == sorted(names)
    with ThreadPoolExecutor(8) as pool:
        statuses = sorted(
            status for status, _ in pool.map(lambda _: put("once", {"If-Match": '"0"'}), range(8))
        )
    assert statuses == [200] + [409] * 7
    assert not list(state.parent.glob(".*.tmp"))
    first.stop()
    second = server(*args)
    _, _, body = second.request("GET", "/admin/fleet")
    restored = json.loads(body)
    assert sorted(restored["routes"]) == sorted([*names, "once"]) and restored["revision"] == 21
    for name in names:
        status, _, _ = second.request("POST", f"/v2/models/{name}/infer", X)
        assert status == 200


def test_a_corrupt_state_file_stops_the_server_with_a_clear_error(
    plugins_dir: Path,
    models_dir: Path,
    tmp_path: Path,
    server,  # type: ignore[no-untyped-def]
) -> None:
    """issue 12, finding 3: a state file that cannot be read used to start the server
    empty, and the next change overwrote every saved entry."""
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    state = tmp_path / "runtime-routes.json"
    state.write_bytes(b'{"revision": 3, "routes": {"a": \xff')
    args = ["--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir)]
    proc: ServerProcess = server(*args, "--runtime-routes-file", str(state), ready=False)
    assert proc.proc.wait(timeout=30) == 2
    assert f"runtime_routes_file {state}" in proc.log() and "Traceback" not in proc.log()
    assert state.read_bytes() == b'{"revision": 3, "routes": {"a": \xff'
