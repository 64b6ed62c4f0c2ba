"""The local runtime-route store: revisions, compare-and-swap, one rebuild per change."""

from pathlib import Path

import pytest

from registry.errors import Conflict, NotFound
from registry.registry import Registry
from registry.route_store import Replica, RouteStore
from registry.routes import parse_route
from tests.helpers import write_add_runner


@pytest.fixture
async def store(plugins_dir: Path, models_dir: Path):  # type: ignore[no-untyped-def]
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    write_add_runner(plugins_dir, "add", "2.0.0", amount=2)
    registry = Registry(plugins_dir, models_dir, drain_timeout=1)
    await registry.start()
    yield RouteStore(registry, Replica("me", "http://me"))
    await registry.close()


async def test_revisions_grow_and_if_revision_is_checked(store: RouteStore) -> None:
    first = await store.put(parse_route("add", {"runner": "add@1.0.0"}, "admin"), if_revision=0)
    assert (first.source, first.revision) == ("admin", 1)
    assert store.registry.routes.resolve("add").variant == "add@1.0.0"
    with pytest.raises(Conflict) as refused:
        await store.put(parse_route("add", {"runner": "add@2.0.0"}, "admin"), if_revision=0)
    assert refused.value.fields == {"revision": 1}
    second = await store.put(parse_route("add", {"runner": "add@2.0.0"}, "admin"), if_revision=1)
    assert second.revision == 2 and store.registry.routes.resolve("add").variant == "add@2.0.0"
    with pytest.raises(Conflict):
        await store.delete("add", if_revision=1)
    assert await store.delete("add", if_revision=2) == 3
    assert store.registry.runtime_routes == {}
    with pytest.raises(NotFound):
        await store.delete("add")


async def test_a_change_is_one_table_swap(store: RouteStore) -> None:
    before = store.registry.routes
    await store.put(parse_route("new", {"runner": {"add@1.0.0": 1, "add@2.0.0": 1}}, "admin"))
    after = store.registry.routes
    assert after is not before and set(after.entries) == {"add", "new"}
    assert "new" not in before.entries  # the old snapshot is untouched


async def test_the_fleet_view_is_this_server(store: RouteStore) -> None:
    await store.registry.unload(("runner", "add", "2.0.0"))
    view = await store.fleet()
    assert view["mode"] == "local" and view["replica"] == "me"
    assert view["replicas"][0]["ready"] == ["runner/add@1.0.0"]
