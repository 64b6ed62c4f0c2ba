"""Fleet route stores in one process against a real etcd: sync, CAS, outage and catch-up."""

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from plugserve.registry.errors import ConfigError, Conflict, NotFound, Unavailable
from plugserve.registry.fleet.etcd import EtcdClient
from plugserve.registry.fleet.etcd_store import EtcdLocation, EtcdRouteStore
from plugserve.registry.fleet.route_store import Replica
from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.routing.route_specs import parse_route
from tests.etcd import EtcdProcess
from tests.helpers import write_add_runner


async def until(check: Callable[[], bool], within: float = 5.0) -> float:
    """Wait for ``check()``; the seconds it took."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not check():
        if loop.time() - started > within:
            raise AssertionError(f"not true within {within}s")
        await asyncio.sleep(0.01)
    return loop.time() - started


@pytest.fixture
async def replicas(
    tmp_path: Path, models_dir: Path, etcd: EtcdProcess
) -> AsyncIterator[Callable[..., object]]:
    made: list[tuple[Registry, EtcdRouteStore]] = []

    async def make(name: str, versions: tuple[str, ...] = ("1.0.0", "2.0.0")) -> EtcdRouteStore:
        plugins = tmp_path / name
        for version in versions:
            write_add_runner(plugins, "add", version, amount=float(version[0]))
        registry = Registry(plugins, models_dir, drain_timeout=1)
        await registry.start()
        store = EtcdRouteStore(
            registry, Replica(name, f"http://{name}"), EtcdLocation.parse(etcd.url()), lease_ttl_s=2
        )
        await store.start()
        made.append((registry, store))
        return store

    yield make
    for registry, store in made:
        await store.close()
        await registry.close()


def serving(store: EtcdRouteStore, route: str = "add") -> str:
    return store.registry.routes.resolve(route, None, {}).variant


def spec(entry: dict[str, object], name: str = "add"):  # type: ignore[no-untyped-def]
    return parse_route(name, entry, "admin")


def test_etcd_urls() -> None:
    loc = EtcdLocation.parse("etcd://a:2379,b:2379/team/models/")
    assert loc.endpoints == ("http://a:2379", "http://b:2379") and loc.prefix == "/team/models"
    assert EtcdLocation.parse("etcds://a:1").prefix == "/plugserve"
    assert EtcdLocation.parse("etcds://a:1").endpoints == ("https://a:1",)


@pytest.mark.parametrize("url", ["etcd://[::1", "etcd://", "etcd:///prefix", "etcd://@/p"])
def test_a_malformed_etcd_url_is_a_config_error(url: str) -> None:
    """Attack round after issue 12: ``etcd://[::1`` escaped as a ValueError traceback at start."""
    with pytest.raises(ConfigError, match="registry"):
        EtcdLocation.parse(url)


async def test_a_write_on_one_replica_is_applied_by_the_other(replicas) -> None:  # type: ignore[no-untyped-def]
    a, b = await replicas("a"), await replicas("b")
    assert serving(a) == serving(b) == "add@2.0.0"
    stored = await a.put(spec({"runner": "add@1.0.0"}))
    assert stored.source == "etcd" and serving(a) == "add@1.0.0"  # read-your-writes
    took = await until(lambda: serving(b) == "add@1.0.0")
    assert took < 1.0
    assert b.registry.runtime_routes["add"].revision == stored.revision
    await b.delete("add")
    await until(lambda: serving(a) == "add@2.0.0")
    assert "add" not in a.registry.runtime_routes


async def test_writes_are_compare_and_swap_on_the_revision(replicas) -> None:  # type: ignore[no-untyped-def]
    a, b = await replicas("a"), await replicas("b")
    first = await a.put(spec({"runner": "add@1.0.0"}))
    await until(lambda: "add" in b.registry.runtime_routes)
    second = await b.put(spec({"runner": "add@2.0.0"}), if_revision=first.revision)
    with pytest.raises(Conflict) as refused:
        await a.put(spec({"runner": "add@1.0.0"}), if_revision=first.revision)
    assert refused.value.fields["revision"] == second.revision
    assert refused.value.fields["current"] == {"runner": "add@2.0.0"}
    with pytest.raises(NotFound):
        await a.delete("nothing")


async def test_a_new_replica_reads_the_table_and_the_fleet_lists_everyone(replicas) -> None:  # type: ignore[no-untyped-def]
    a = await replicas("a")
    await a.put(spec({"runner": {"add@1.0.0": 70, "add@2.0.0": 30}}))
    c = await replicas("c", versions=("1.0.0",))
    assert (
        c.ready
        and c.registry.runtime_routes["add"].variants == a.registry.runtime_routes["add"].variants
    )
    # c lacks 2.0.0: all of its traffic goes to 1.0.0.
    assert {serving(c) for _ in range(200)} == {"add@1.0.0"}
    await until(lambda: len(a.replicas) == 2)
    fleet = await a.fleet()
    ready = {r["id"]: r["ready"] for r in fleet["replicas"]}
    assert ready == {"a": ["runner/add@1.0.0", "runner/add@2.0.0"], "c": ["runner/add@1.0.0"]}
    # A replica that stops leaves the fleet at once (its lease is revoked).
    await c.close()
    await until(lambda: set(a.replicas) == {"a"})


async def test_a_replica_republishes_when_its_versions_change(replicas) -> None:  # type: ignore[no-untyped-def]
    a = await replicas("a")
    await a.registry.unload(("runner", "add", "2.0.0"))
    await until(lambda: a.replicas.get("a", {}).get("ready") == ["runner/add@1.0.0"])


async def test_an_outage_keeps_the_table_refuses_writes_and_sync_resumes(
    replicas, etcd: EtcdProcess
) -> None:  # type: ignore[no-untyped-def]
    a, b = await replicas("a"), await replicas("b")
    await a.put(spec({"runner": "add@1.0.0"}))
    await until(lambda: serving(b) == "add@1.0.0")
    etcd.stop()
    await until(lambda: not a.connected and not b.connected)
    assert serving(a) == serving(b) == "add@1.0.0"  # the last table keeps serving
    assert a.ready and a.health()["last_error"]
    with pytest.raises(Unavailable, match="unreachable"):
        await a.put(spec({"runner": "add@2.0.0"}))
    etcd.start()
    # What changes in etcd right after it returns reaches both, snapshot or watch.
    client = EtcdClient([etcd.endpoint])
    await client.put("/plugserve/routes/add", json.dumps({"runner": "add@2.0.0"}).encode())
    await client.close()
    await until(lambda: a.connected and b.connected, within=10)
    await until(lambda: serving(a) == serving(b) == "add@2.0.0")
    assert a.disconnects == 1


async def test_a_bad_entry_written_by_hand_keeps_what_served(replicas, etcd: EtcdProcess) -> None:  # type: ignore[no-untyped-def]
    a = await replicas("a")
    await a.put(spec({"runner": "add@1.0.0"}))
    client = EtcdClient([etcd.endpoint])
    await client.put("/plugserve/routes/add", b'{"runner": {"add@1.0.0": -5}}')
    await client.close()
    await until(lambda: "add" in a.invalid)
    assert "integer from 0" in a.invalid["add"]["error"]
    assert serving(a) == "add@1.0.0"
    # Fixing it through the API is a CAS on the bad entry's revision.
    await a.put(spec({"runner": "add@2.0.0"}))
    assert serving(a) == "add@2.0.0" and not a.invalid


async def test_a_hung_etcd_is_noticed_by_the_lease_and_left_behind(
    replicas, etcd: EtcdProcess
) -> None:  # type: ignore[no-untyped-def]
    """etcd frozen (SIGSTOP): no connection breaks, so the watch alone would wait forever;
    the lease keepalive times out and the replica reports the outage, then recovers."""
    import signal

    a = await replicas("a")
    await a.put(spec({"runner": "add@1.0.0"}))
    assert etcd.proc is not None
    etcd.proc.send_signal(signal.SIGSTOP)
    try:
        took = await until(lambda: not a.connected, within=10)
        assert took < a.lease_ttl_s / 3 + a.client.timeout.total + 1  # type: ignore[operator]
        assert serving(a) == "add@1.0.0"
    finally:
        etcd.proc.send_signal(signal.SIGCONT)
    await until(lambda: a.connected, within=10)
    await a.put(spec({"runner": "add@2.0.0"}))
    assert serving(a) == "add@2.0.0"


async def test_a_fleet_with_etcd_authentication(
    tmp_path: Path, models_dir: Path, etcd: EtcdProcess
) -> None:
    etcd.enable_auth("plugserve", "pw", "/plugserve/")
    write_add_runner(tmp_path / "p", "add", "1.0.0")
    registry = Registry(tmp_path / "p", models_dir, drain_timeout=1)
    await registry.start()
    location = EtcdLocation.parse(
        f"etcd://plugserve@127.0.0.1:{etcd.port}/plugserve", password="pw"
    )
    assert "pw" not in location.shown and "pw" not in repr(location)
    store = EtcdRouteStore(registry, Replica("a", "http://a"), location, lease_ttl_s=2)
    try:
        await store.start()
        assert store.connected
        await store.put(spec({"runner": "add@1.0.0"}))
        await until(lambda: "a" in store.replicas)  # its own record, written and watched
        assert store.registry.routes.resolve("add").variant == "add@1.0.0"
    finally:
        await store.close()
        await registry.close()


BAD_ROUTE_VALUES = {
    "inf": b'{"runner": "add@1.0.0", "rate_limit": {"rps": 1e999}}',
    "huge int": b'{"runner": "add@1.0.0", "rate_limit": {"rps": 1' + b"0" * 400 + b"}}",
    "not json": b"{runner",
    "not utf-8": b'{"runner": "add\xff"}',
    "wrong type": b'{"runner": 5}',
    "not an object": b"[1, 2]",
    "deep": b"[" * 50_000 + b"]" * 50_000,
    "NaN": b'{"runner": "add@1.0.0", "rate_limit": {"rps": NaN}}',
}


@pytest.mark.parametrize("value", BAD_ROUTE_VALUES.values(), ids=BAD_ROUTE_VALUES.keys())
async def test_a_bad_route_value_is_invalid_and_everything_else_applies(
    replicas, etcd: EtcdProcess, value: bytes
) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 2: one bad value under the routes prefix is an invalid entry with
    its reason; the replica stays connected, writes work, a new replica becomes ready."""
    a = await replicas("a")
    client = EtcdClient([etcd.endpoint])
    await client.put("/plugserve/routes/bad", value)
    await client.put("/plugserve/routes/add", json.dumps({"runner": "add@1.0.0"}).encode())
    await client.close()
    await until(lambda: "bad" in a.invalid and serving(a) == "add@1.0.0")
    assert a.connected and a.disconnects == 0 and a.invalid["bad"]["error"].startswith("routes.bad")
    assert a.apply_errors == 0  # handled as a bad value, not by the safety net
    b = await replicas("b")  # started meanwhile: reads the same table, ready
    assert b.ready and b.connected and serving(b) == "add@1.0.0" and "bad" in b.invalid
    await b.put(spec({"runner": "add@2.0.0"}))
    await until(lambda: serving(a) == "add@2.0.0")
    assert a.connected and b.connected
    fleet = await a.fleet()
    json.dumps(fleet, allow_nan=False)  # what GET /admin/fleet sends is strict JSON
    assert fleet["invalid"]["bad"]["revision"] > 0


async def test_a_key_that_is_not_utf8_is_an_invalid_entry(replicas, etcd: EtcdProcess) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 2: a non-UTF-8 key under the routes prefix used to disconnect
    every replica (the key was decoded as UTF-8)."""
    a = await replicas("a")
    client = EtcdClient([etcd.endpoint])
    await client.put(b"/plugserve/routes/x\xff", b'{"runner": "add@1.0.0"}')
    await client.put(b"/plugserve/replicas/r\xfe", b"{}")
    await client.close()
    await until(lambda: "x\\xff" in a.invalid and "r\\xfe" in a.invalid_replicas)
    assert a.connected and a.disconnects == 0
    b = await replicas("b")
    assert b.ready and "x\\xff" in b.invalid
    await a.put(spec({"runner": "add@1.0.0"}))
    await until(lambda: serving(b) == "add@1.0.0")


@pytest.mark.parametrize(
    "value",
    [b"5", b"[1, 2]", b"\xff", b'{"id": "z"}', b'{"id": "z", "url": 1}', b"null", b"1e999"],
)
async def test_a_replica_record_that_is_not_one_is_listed_as_invalid(
    replicas, etcd: EtcdProcess, value: bytes
) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 2: a replica record that is not an object made GET /admin/fleet
    a 500 on every replica; it is listed under invalid_replicas with its reason."""
    a = await replicas("a")
    client = EtcdClient([etcd.endpoint])
    await client.put("/plugserve/replicas/z", value)
    await client.close()
    await until(lambda: "z" in a.invalid_replicas and "a" in a.replicas)
    fleet = await a.fleet()
    assert [r["id"] for r in fleet["replicas"]] == ["a"]
    assert fleet["invalid_replicas"]["z"]["error"].startswith("replicas.z: ")
    json.dumps(fleet, allow_nan=False)
    assert a.connected and a.disconnects == 0


async def test_a_large_value_does_not_break_the_watch(replicas, etcd: EtcdProcess) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 2: a 1.4 MB value reached the watch as one line longer than
    aiohttp reads, and the replica disconnected."""
    a = await replicas("a")
    client = EtcdClient([etcd.endpoint])
    await client.put("/plugserve/routes/big", b'{"runner": "' + b"x" * 1_400_000 + b'"}')
    await client.put("/plugserve/routes/add", b'{"runner": "add@1.0.0"}')
    await client.close()
    await until(lambda: "big" in a.invalid and serving(a) == "add@1.0.0")
    assert a.connected and a.disconnects == 0
    assert len(a.invalid["big"]["error"]) <= 500
