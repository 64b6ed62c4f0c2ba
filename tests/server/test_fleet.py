"""Three replicas as real subprocesses sharing one route table through a real etcd."""

import json
import time
from pathlib import Path

import pytest

from tests.etcd import EtcdProcess
from tests.helpers import ServerProcess, metric, until, wait_until_ok, write_add_runner

pytestmark = pytest.mark.workers(1, 2)

X = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]}


@pytest.fixture
def fleet(tmp_path: Path, models_dir: Path, etcd: EtcdProcess, server) -> list[ServerProcess]:  # type: ignore[no-untyped-def]
    """Replicas r0 and r1 have add 1.0.0 and 2.0.0; r2 has only 1.0.0. Each its own plugins dir."""
    procs = []
    for i, versions in enumerate([("1.0.0", "2.0.0"), ("1.0.0", "2.0.0"), ("1.0.0",)]):
        plugins = tmp_path / f"plugins{i}"
        for version in versions:
            write_add_runner(plugins, "add", version, amount=float(version[0]))
        args = ["--plugins-dir", str(plugins), "--models-dir", str(models_dir)]
        args += ["--registry", etcd.url("/fleet-test"), "--replica-id", f"r{i}"]
        procs.append(server(*args, ready=False))
    return [p.wait_ready() for p in procs]


def infer(replica: ServerProcess, user: str | None = None) -> str:
    headers = {"X-User-ID": user} if user else {}
    status, response_headers, body = replica.request("POST", "/v2/models/add/infer", X, headers)
    assert status == 200, body
    variant = response_headers["X-Plugserve-Variant"]
    value = json.loads(body)["outputs"][0]["data"][0]
    assert value == float(variant.split("@")[1][0])  # the header names what really ran
    return variant


def put(replica: ServerProcess, entry: dict[str, object]) -> tuple[int, dict[str, object]]:
    status, _, body = replica.request("PUT", "/admin/routes/add", entry)
    return status, json.loads(body)


def all_switch(fleet: list[ServerProcess], variant: str) -> list[float]:
    """Seconds until each replica's requests are served by ``variant`` (real requests)."""
    started = time.monotonic()
    times: dict[int, float] = {}
    while len(times) < len(fleet) and time.monotonic() - started < 5:
        for i, replica in enumerate(fleet):
            if i not in times and infer(replica) == variant:
                times[i] = time.monotonic() - started
    return [times.get(i, float("inf")) for i in range(len(fleet))]


def ready_details(replica: ServerProcess) -> dict[str, object]:
    status, _, body = replica.request("GET", "/v2/health/ready")
    assert status == 200, body
    return json.loads(body)["fleet"]  # type: ignore[no-any-return]


def test_a_weight_change_through_one_replica_is_served_by_all_within_a_second(
    fleet: list[ServerProcess],
) -> None:
    status, body = put(
        fleet[0], {"runner": {"add@1.0.0": 100, "add@2.0.0": 0}, "sticky": "x-user-id"}
    )
    assert status == 200, body
    assert max(all_switch(fleet, "add@1.0.0")) < 1.0
    # Move every request to 2.0.0 through r1: r0 and r1 follow within a second; r2 lacks
    # 2.0.0, so its share cannot move there and it keeps serving 1.0.0.
    status, body = put(
        fleet[1], {"runner": {"add@1.0.0": 0, "add@2.0.0": 100}, "sticky": "x-user-id"}
    )
    assert status == 200, body
    took = all_switch(fleet[:2], "add@2.0.0")
    assert max(took) < 1.0, took
    assert {infer(fleet[2]) for _ in range(50)} == {"add@1.0.0"}
    # 50/50: r0 and r1 split by the same hash (one user, one variant, on any replica);
    # r2 never routes to the version it lacks.
    status, body = put(
        fleet[2], {"runner": {"add@1.0.0": 50, "add@2.0.0": 50}, "sticky": "x-user-id"}
    )
    assert status == 200, body
    until(
        lambda: all(
            r.request("GET", "/admin/routes")[2].count(b'"weight": 50') == 2 for r in fleet
        ),
        1.0,
        interval=0.005,  # a second to apply a change: polled often
    )
    users = [f"user-{i}" for i in range(200)]
    on_r0 = [infer(fleet[0], u) for u in users]
    assert on_r0 == [infer(fleet[1], u) for u in users]
    assert 60 < on_r0.count("add@2.0.0") < 140
    assert {infer(fleet[2], u) for u in users} == {"add@1.0.0"}
    # The fleet as any replica sees it.
    _, _, body_bytes = fleet[2].request("GET", "/admin/fleet")
    view = json.loads(body_bytes)
    ready = {r["id"]: r["ready"] for r in view["replicas"]}
    assert ready == {
        "r0": ["runner/add@1.0.0", "runner/add@2.0.0"],
        "r1": ["runner/add@1.0.0", "runner/add@2.0.0"],
        "r2": ["runner/add@1.0.0"],
    }
    assert view["routes"]["add"]["entry"]["runner"] == {"add@1.0.0": 50, "add@2.0.0": 50}


@pytest.mark.workers(1, 2)
def test_losing_etcd_leaves_every_replica_serving_and_sync_resumes_when_it_returns(
    fleet: list[ServerProcess], etcd: EtcdProcess
) -> None:
    assert put(fleet[0], {"runner": "add@1.0.0"})[0] == 200
    assert max(all_switch(fleet, "add@1.0.0")) < 1.0
    etcd.stop()
    until(lambda: all(ready_details(r)["connected"] is False for r in fleet), 5.0)
    for replica in fleet:
        assert {infer(replica) for _ in range(30)} == {"add@1.0.0"}  # the last table, still served
        _, _, metrics = replica.request("GET", "/metrics")
        assert b"plugserve_fleet_connected 0.0" in metrics
    status, body = put(fleet[1], {"runner": "add@2.0.0"})
    assert status == 503 and "unreachable" in str(body["error"])
    etcd.start()
    until(lambda: all(ready_details(r)["connected"] is True for r in fleet), 10.0)
    status, body = put(fleet[2], {"runner": {"add@1.0.0": 0, "add@2.0.0": 100}})
    assert status == 200, body
    assert max(all_switch(fleet[:2], "add@2.0.0")) < 1.0
    # r2 applied the same revision; lacking 2.0.0, it stays on 1.0.0.
    until(lambda: len({ready_details(r)["revision"] for r in fleet}) == 1, 1.0, interval=0.005)
    assert {infer(fleet[2]) for _ in range(20)} == {"add@1.0.0"}
    for replica in fleet:
        assert ready_details(replica)["disconnects"] == 1


async def test_a_replica_that_never_read_the_fleet_table_is_not_ready_but_serves(
    plugins_dir: Path,
    client,
    etcd: EtcdProcess,  # type: ignore[no-untyped-def]
) -> None:
    import asyncio

    write_add_runner(plugins_dir, "add", "1.0.0")
    etcd.stop()
    cli = await client(registry=etcd.url(), fleet_startup_wait_s=0.2)
    resp = await cli.get("/v2/health/ready")
    assert resp.status == 503
    body = await resp.json()
    assert body["fleet"]["synced"] is False and "unreachable" in body["fleet"]["last_error"]
    # Inference is not refused meanwhile: the local routes serve.
    assert (await cli.post("/v2/models/add/infer", json=X)).status == 200
    etcd.start()
    for _ in range(200):
        resp = await cli.get("/v2/health/ready")
        if resp.status == 200:
            break
        await asyncio.sleep(0.05)
    assert resp.status == 200 and (await resp.json())["fleet"]["connected"] is True


@pytest.mark.workers(1, 2)
def test_a_replica_started_while_etcd_is_down_is_not_ready_but_serves(
    tmp_path: Path, plugins_dir: Path, models_dir: Path, etcd: EtcdProcess, server
) -> None:  # type: ignore[no-untyped-def]
    """The subprocess form of the test above: what a real server, with its workers, answers."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    etcd.stop()
    config = tmp_path / "plugserve.toml"
    config.write_text("fleet_startup_wait_s = 0.2\n")
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--registry", etcd.url(), "--config", str(config), ready=False)  # fmt: skip
    wait_until_ok(srv.proc, srv.url + "/v2/health/live", 30, srv.log)
    # While the plugins first load, ready answers 503 for that reason: wait it out.
    until(lambda: b"still loading" not in srv.request("GET", "/v2/health/ready")[2], 10.0)
    status, _, body = srv.request("GET", "/v2/health/ready")
    assert status == 503, body
    assert json.loads(body)["fleet"]["synced"] is False
    status, _, body = srv.request("POST", "/v2/models/add/infer", X)
    assert status == 200, body
    etcd.start()
    until(lambda: srv.request("GET", "/v2/health/ready")[0] == 200, 10.0)


def test_bad_values_in_etcd_leave_every_replica_connected_and_listed(
    tmp_path: Path, models_dir: Path, etcd: EtcdProcess, server
) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 2: a route value with rps 1e999 or a key that is not UTF-8 took
    every replica off etcd (503 for writes, a new replica never ready); a replica record
    that is not an object made GET /admin/fleet a 500."""
    import asyncio

    from plugserve.registry.fleet.etcd import EtcdClient

    write_add_runner(tmp_path / "plugins", "add", "1.0.0")
    write_add_runner(tmp_path / "plugins", "add", "2.0.0", amount=2.0)
    args = ["--plugins-dir", str(tmp_path / "plugins"), "--models-dir", str(models_dir)]
    args += ["--registry", etcd.url("/bad")]
    first = server(*args, "--replica-id", "r0")

    async def write_bad() -> None:
        client = EtcdClient([etcd.endpoint])
        await client.put("/bad/routes/inf", b'{"runner": "add", "rate_limit": {"rps": 1e999}}')
        await client.put(b"/bad/routes/\xff", b'{"runner": "add"}')
        await client.put("/bad/replicas/five", b"5")
        await client.put("/bad/replicas/list", b"[1, 2]")
        await client.close()

    asyncio.run(write_bad())
    assert put(first, {"runner": "add@1.0.0"})[0] == 200
    second = server(*args, "--replica-id", "r1")  # started meanwhile: becomes ready
    for replica in (first, second):
        until(lambda r=replica: b'"five"' in r.request("GET", "/admin/fleet")[2], 5.0)
        # r1 publishes its record once ready; r0 sees it through its watch a moment later.
        until(lambda r=replica: b'"id": "r1"' in r.request("GET", "/admin/fleet")[2], 5.0)
        status, _, body = replica.request("GET", "/admin/fleet")
        assert status == 200, body
        view = json.loads(body)
        assert sorted(r["id"] for r in view["replicas"]) == ["r0", "r1"]
        assert sorted(view["invalid_replicas"]) == ["five", "list"]
        assert sorted(view["invalid"]) == ["\\xff", "inf"]
        assert view["connected"] is True and view["disconnects"] == 0
        _, _, routes = replica.request("GET", "/admin/routes")
        assert sorted(json.loads(routes)["runtime"]["invalid"]) == ["\\xff", "inf"]
        _, _, metrics = replica.request("GET", "/metrics")
        assert metric(metrics, "plugserve_fleet_invalid_entries") == 4
    assert infer(second) == "add@1.0.0"
    status, body = put(second, {"runner": "add@2.0.0"})
    assert status == 200, body
    assert all_switch([first, second], "add@2.0.0")[0] < 1.0
    assert "Traceback" not in first.log()
    assert first.log().count("fleet_route_invalid") == 2  # logged once each
