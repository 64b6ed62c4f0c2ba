"""Runner versions that load on their first request (``[runner] load = "on_demand"``, or
``--default-load on_demand``): registered and listed, loaded once by the requests that
need them, whatever their number."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tritonclient.http as httpclient

from tests.helpers import ServerProcess, write_add_runner, write_plugin

ON_DEMAND = 'load = "on_demand"'

SLOW = """
    import time

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Slow:
        def warmup(self):
            time.sleep({warmup_s})

        def infer(self, inputs):
            return {{"y": np.asarray(inputs["x"]) * 2}}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Slow()
"""


def infer(srv: ServerProcess, route: str, **parameters: Any) -> tuple[int, dict[str, str], Any]:
    body: dict[str, Any] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]
    }
    if parameters:
        body["parameters"] = parameters
    status, headers, raw = srv.request("POST", f"/v2/models/{route}/infer", body)
    return status, headers, json.loads(raw)


def record(srv: ServerProcess, name: str) -> dict[str, Any]:
    status, _, body = srv.request("GET", "/admin/plugins")
    assert status == 200, body
    (found,) = [p for p in json.loads(body)["plugins"] if p["name"] == name]
    return found


@pytest.mark.workers(1, 2)
@pytest.mark.parametrize("isolated", [False, True], ids=["in-worker", "isolated"])
def test_a_version_loads_on_its_first_request_once_whatever_the_requests(
    isolated: bool, plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    runner = ON_DEMAND + ('\nisolation = "process"' if isolated else "")
    write_add_runner(plugins_dir, "lazy", "1.0.0", amount=1.0, runner=runner)
    write_add_runner(plugins_dir, "eager", "1.0.0", amount=2.0)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    assert record(srv, "lazy")["state"] == "available"
    assert record(srv, "eager")["state"] == "ready"
    status, _, body = srv.request("POST", "/v2/repository/index", {})
    rows = {r["name"]: r for r in json.loads(body)}
    assert rows["lazy"]["state"] == "UNAVAILABLE"
    assert "loads on its first request" in rows["lazy"]["reason"]
    assert srv.request("GET", "/v2/models/lazy/ready")[0] != 200
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: infer(srv, "lazy"), range(32)))
    for status, _, answer in answers:
        assert status == 200, answer
        assert answer["outputs"][0]["data"] == [2.0, 3.0, 4.0, 5.0]
    assert record(srv, "lazy")["state"] == "ready"
    log = srv.log()
    # One load per worker that took a request, never two in one worker.
    loads = [line for line in log.splitlines() if "plugin_demanded" in line]
    assert 1 <= len(loads) <= 2, loads
    pids = [line.split("pid=")[1].split()[0] for line in loads if "pid=" in line]
    assert len(pids) == len(set(pids)), loads


def test_the_server_default_and_an_eager_manifest(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """``--default-load on_demand`` defers every runner that does not say; metadata, read
    first as clients do, loads it as a request would."""
    write_add_runner(plugins_dir, "plain", "1.0.0", amount=1.0)
    write_add_runner(plugins_dir, "pinned", "1.0.0", amount=1.0, runner='load = "eager"')
    srv = server(
        "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
        "--default-load", "on_demand",
    )  # fmt: skip
    assert record(srv, "plain")["state"] == "available"
    assert record(srv, "pinned")["state"] == "ready"
    client = httpclient.InferenceServerClient(f"127.0.0.1:{srv.port}")
    try:
        metadata = client.get_model_metadata("plain")
    finally:
        client.close()
    assert [t["name"] for t in metadata["inputs"]] == ["x"]
    assert record(srv, "plain")["state"] == "ready"


def test_a_request_waits_for_the_load_as_long_as_its_deadline_then_504(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """The load goes on past a request that could not wait for it (its deadline's 504); a
    later one is served."""
    write_plugin(
        plugins_dir, "runner", "slow", "1.0.0", f"[runner]\n{ON_DEMAND}\n",
        files={"plugin.py": SLOW.format(warmup_s=2.0)},
    )  # fmt: skip
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    status, _, answer = infer(srv, "slow", timeout=300_000)  # 0.3 s
    assert status == 504, answer
    assert "deadline" in answer["error"]
    status, _, answer = infer(srv, "slow")  # waits for the load under way
    assert status == 200, answer
    assert answer["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
    assert srv.log().count("plugin_demanded") == 1


BIG = """
    import time

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Big:
        def __init__(self, mib):
            self.weights = np.ones(mib * 1024 * 1024 // 8)  # touched: resident

        def infer(self, inputs):
            x = np.asarray(inputs["x"])
            if x[0, 0] < 0:  # a slow request: the version stays busy meanwhile
                time.sleep(4)
            return {"y": x * 2}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Big(config["mib"])
"""


def write_big(plugins_dir: Path, names: str, mib: int, runner: str = "") -> None:
    """Versions ``names`` that load on demand and hold ``mib`` MiB resident (a request
    whose first value is negative takes 4 s)."""
    for name in names:
        write_plugin(
            plugins_dir, "runner", name, "1.0.0",
            f"[config]\nmib = {mib}\n[runner]\n{ON_DEMAND}\n{runner}",
            files={"plugin.py": BIG},
        )  # fmt: skip


def test_a_memory_budget_evicts_the_least_recently_used_idle_version(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """Four versions of 64 MiB each, a budget that holds two: a load evicts the least
    recently used idle one (measured, not guessed), which its next request loads again;
    a pinned version is never evicted."""
    for name in ("a", "b", "c", "keep"):
        pinned = "\npinned = true" if name == "keep" else ""
        write_plugin(
            plugins_dir, "runner", name, "1.0.0",
            f"[config]\nmib = 64\n[runner]\n{ON_DEMAND}{pinned}\n",
            files={"plugin.py": BIG},
        )  # fmt: skip
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--memory-budget", "150MiB")  # fmt: skip

    def states() -> dict[str, str]:
        return {n: record(srv, n)["state"] for n in ("a", "b", "c", "keep")}

    assert infer(srv, "a")[0] == 200
    assert 60 * 2**20 < record(srv, "a")["memory_bytes"] < 80 * 2**20
    assert infer(srv, "b")[0] == 200
    assert infer(srv, "c")[0] == 200  # a, the least recently used, makes room
    assert states() == {"a": "available", "b": "ready", "c": "ready", "keep": "available"}
    assert infer(srv, "b")[0] == 200  # b used: c is now the least recently used
    assert infer(srv, "a")[0] == 200
    assert states() == {"a": "ready", "b": "ready", "c": "available", "keep": "available"}
    assert infer(srv, "keep")[0] == 200  # pinned: loaded, and the others make room
    assert infer(srv, "c")[0] == 200
    after = states()
    assert after["keep"] == "ready" and after["c"] == "ready", after
    assert srv.log().count("plugin_evicted") >= 3


@pytest.mark.workers(1, 2)
def test_versions_taking_turns_in_a_budget_for_one_answer_every_request(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """Eight clients alternate two versions a budget holds one of: a version is never
    evicted while requests wait for its load, so each waiting request is served, none is
    sent back with a 503 after its version was loaded for it."""
    write_big(plugins_dir, "ab", mib=40)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--memory-budget", "60MiB")  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: infer(srv, "ab"[i % 2]), range(120)))
    statuses = [status for status, _, _ in answers]
    assert statuses.count(200) == len(answers), [a for a in answers if a[0] != 200][:3]


def test_an_explicit_load_of_an_on_demand_version_counts_against_the_budget(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """A repository load and an admin reload of versions that load on demand go through
    the budget as a request's load does: each makes room, each is measured."""
    write_big(plugins_dir, "abc", mib=64)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--memory-budget", "150MiB")  # fmt: skip
    assert srv.request("POST", "/v2/repository/models/a/load", {})[0] == 200
    assert srv.request("POST", "/admin/plugins/runner/b/1.0.0/reload")[0] == 200
    assert srv.request("POST", "/v2/repository/models/c/load", {})[0] == 200
    states = {name: record(srv, name)["state"] for name in "abc"}
    assert states == {"a": "available", "b": "ready", "c": "ready"}, states
    status, _, body = srv.request("GET", "/admin/status")
    assert status == 200, body
    memory = json.loads(body)["memory"]
    assert {row["plugin"] for row in memory["resident"]} == {"runner/b@1.0.0", "runner/c@1.0.0"}
    assert memory["resident_bytes"] <= memory["budget_bytes"]
    assert srv.request("POST", "/admin/plugins/runner/b/1.0.0/unload")[0] == 200
    assert record(srv, "b").get("memory_bytes") is None
