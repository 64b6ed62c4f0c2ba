"""Property tests: hostile values written straight into a real etcd under a replica's prefix.

issue 12, finding 2 (the class): whatever a key under the routes or replicas prefix
holds, no exception leaves the watch or the snapshot, the replica stays connected and
ready, the bad keys are listed as invalid, and good entries written after them apply.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plugserve.registry.fleet.etcd import EtcdClient
from plugserve.registry.fleet.etcd_store import EtcdLocation, EtcdRouteStore
from plugserve.registry.fleet.route_store import Replica
from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.routing.route_specs import parse_route
from tests.etcd import EtcdProcess
from tests.helpers import write_add_runner

T = TypeVar("T")
PREFIX = "/prop"

numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.sampled_from([0, -1, 2**63, 2**64 + 1, 1e308, -1e308, 5e-324, True, None]),
)
texts = st.text(max_size=20) | st.sampled_from(["add", "add@1.0.0", "add@x", "\x00\n\x1b", ""])
scalars = numbers | texts
nested = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
route_entries = st.fixed_dictionaries(
    {"runner": nested | st.dictionaries(texts, numbers, max_size=3)},
    optional={
        "rate_limit": st.fixed_dictionaries({"rps": numbers}, optional={"burst": numbers}) | nested,
        "preprocess": nested,
        "postprocess": nested,
        "sticky": nested,
        "extra": nested,
    },
)
replica_records = st.fixed_dictionaries(
    {},
    optional={
        "id": nested,
        "url": nested,
        "started_at": numbers,
        "updated_at": numbers,
        "ready": nested,
    },
)


def as_json(value: Any) -> bytes:
    """JSON as Python writes it: Infinity, NaN and 400-digit integers included."""
    return json.dumps(value).encode()


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


hostile_values = st.one_of(
    st.binary(max_size=40),
    (route_entries | replica_records | nested).map(as_json),
    st.integers(min_value=1, max_value=200_000).map(deep),
    st.sampled_from([b"1e999", b"-1e999", b"NaN", b'{"a": 1e999}', b"\xff\xfe{}", b"null"]),
)
hostile_names = st.binary(min_size=0, max_size=12) | texts.map(str.encode)


class Rig:
    """An event loop of its own (hypothesis calls a plain function), one etcd, one replica."""

    def __init__(self, plugins: Path, models: Path, etcd: EtcdProcess) -> None:
        self.loop = asyncio.new_event_loop()
        self.plugins, self.models, self.etcd = plugins, models, etcd
        self.made: list[tuple[Registry, EtcdRouteStore]] = []
        self.client = EtcdClient([etcd.endpoint])
        self.store = self.run(self.replica("a"))
        self.written = 0

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(work)

    async def replica(self, name: str) -> EtcdRouteStore:
        registry = Registry(self.plugins, self.models, drain_timeout=1)
        await registry.start()
        location = EtcdLocation.parse(self.etcd.url(PREFIX))
        store = EtcdRouteStore(registry, Replica(name, f"http://{name}"), location, 10, 5.0)
        await store.start()
        self.made.append((registry, store))
        return store

    async def close(self) -> None:
        for registry, store in self.made:
            await store.close()
            await registry.close()
        await self.client.close()


@pytest.fixture
def rig(tmp_path: Path, models_dir: Path, etcd: EtcdProcess) -> Iterator[Rig]:
    plugins = tmp_path / "plugins"
    write_add_runner(plugins, "add", "1.0.0", amount=1)
    write_add_runner(plugins, "add", "2.0.0", amount=2)
    made = Rig(plugins, models_dir, etcd)
    yield made
    made.run(made.close())
    made.loop.close()


async def until(check: Any, within: float = 5.0) -> None:
    for _ in range(int(within / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not true within {within}s")


def assert_healthy(store: EtcdRouteStore) -> None:
    """Connected, ready, never disconnected, and every bad key handled as outside data:
    the safety nets that catch what escapes parsing (``apply_errors``) stay unused."""
    assert store.connected and store.ready and store.disconnects == 0, store.health()
    assert store.apply_errors == 0


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    writes=st.lists(
        st.tuples(st.sampled_from(["routes", "replicas"]), hostile_names, hostile_values),
        min_size=1,
        max_size=4,
    ),
    delete_one=st.booleans(),
)
def test_hostile_values_in_etcd_never_escape_and_good_entries_still_apply(
    rig: Rig,
    writes: list[tuple[str, bytes, bytes]],
    delete_one: bool,
) -> None:
    """issue 12, finding 2: inf, nan, huge and negative numbers, deep nesting, non-UTF-8
    bytes, control characters, wrong types and non-object JSON, as keys and as values."""
    store = rig.store

    async def example() -> None:
        for i, (where, name, value) in enumerate(writes):
            if name in (b"good", b"a"):
                continue  # the good entry and this replica's own record are checked below
            key = f"{PREFIX}/{where}/".encode() + name
            await rig.client.put(key, value)
            if delete_one and i == 0:
                current = await rig.client.get(key)
                assert current is not None
                await rig.client.put_if(key, None, current.mod_revision)
        rig.written += 1
        runner = f"add@{1 + rig.written % 2}.0.0"
        revision = await rig.client.put(
            f"{PREFIX}/routes/good", json.dumps({"runner": runner}).encode()
        )
        await until(lambda: store.revision >= revision)
        good = store.registry.runtime_routes.get("good")
        assert good is not None and good.revision == revision
        assert store.registry.routes.resolve("good").variant == runner
        view = await store.fleet()
        json.dumps(view, allow_nan=False)  # GET /admin/fleet: strict JSON whatever etcd holds
        assert_healthy(store)

    rig.run(example())


def test_a_replica_started_over_hostile_values_is_ready_and_writes_work(rig: Rig) -> None:
    """issue 12, finding 2: the snapshot path as well as the watch: a replica that reads a
    prefix full of bad keys becomes ready, lists them, and takes writes."""
    bad = [b"\xff", deep(100_000), as_json({"runner": "add", "rate_limit": {"rps": math.inf}})]
    bad += [as_json([1, 2]), b"5", as_json({"runner": "add", "rate_limit": {"rps": 10**400}})]

    async def scenario() -> None:
        for i, value in enumerate(bad):
            await rig.client.put(f"{PREFIX}/routes/bad{i}".encode(), value)
            await rig.client.put(f"{PREFIX}/replicas/bad{i}".encode(), value)
        await rig.client.put(f"{PREFIX}/routes/\xff".encode("latin-1"), b"{}")
        b = await rig.replica("b")
        assert sorted(b.invalid) == sorted([*(f"bad{i}" for i in range(len(bad))), "\\xff"])
        assert sorted(b.invalid_replicas) == [f"bad{i}" for i in range(len(bad))]
        stored = await b.put(parse_route("good", {"runner": "add@1.0.0"}, "admin"))
        await until(lambda: "good" in rig.store.registry.runtime_routes)
        assert rig.store.registry.runtime_routes["good"].revision == stored.revision
        fixed = await b.put(parse_route("bad0", {"runner": "add@2.0.0"}, "admin"))
        await until(lambda: "bad0" not in rig.store.invalid)
        assert rig.store.registry.runtime_routes["bad0"].revision == fixed.revision
        for store in (rig.store, b):
            assert_healthy(store)
            json.dumps(await store.fleet(), allow_nan=False)

    rig.run(scenario())
