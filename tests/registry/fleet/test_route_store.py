"""The local runtime-route store: revisions, compare-and-swap, one rebuild per change."""

import asyncio
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugserve.registry.errors import ConfigError, Conflict, NotFound, Unavailable
from plugserve.registry.fleet.route_store import Replica, RouteStore
from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.routing.route_specs import parse_route
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


async def test_with_a_state_file_changes_survive_a_restart(
    plugins_dir: Path, models_dir: Path, tmp_path: Path, store: RouteStore
) -> None:
    state = tmp_path / "state" / "runtime-routes.json"
    saving = RouteStore(store.registry, store.replica, state)
    await saving.start()  # no file yet: nothing to restore
    await saving.put(parse_route("add", {"runner": {"add@1.0.0": 90, "add@2.0.0": 10}}, "admin"))
    await saving.put(parse_route("beta", {"runner": "add@2.0.0"}, "admin"))
    await saving.delete("beta")
    assert not list(state.parent.glob(".*.tmp"))  # written by rename, nothing left over
    # A new server on the same file: the same entries at the same revisions.
    registry = Registry(plugins_dir, models_dir, drain_timeout=1)
    await registry.start()
    try:
        restored = RouteStore(registry, store.replica, state)
        await restored.start()
        assert restored.revision == 3
        [(name, spec)] = registry.runtime_routes.items()
        assert (name, spec.revision, spec.as_entry()) == (
            "add",
            1,
            {"runner": {"add@1.0.0": 90, "add@2.0.0": 10}},
        )
        assert registry.routes.entries["add"].spec.source == "admin"
    finally:
        await registry.close()


async def test_a_change_that_cannot_be_saved_is_not_made(tmp_path: Path, store: RouteStore) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    saving = RouteStore(store.registry, store.replica, blocker / "routes.json")
    with pytest.raises(Unavailable, match="could not be saved"):
        await saving.put(parse_route("add", {"runner": "add@1.0.0"}, "admin"))
    assert store.registry.runtime_routes == {} and saving.revision == 0


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"revision": "x", "routes": {}}',
        b'{"revision": 1, "routes": {"a": {"entry": {"runner": "add"}, "revision": -1}}}',
        b'{"revision": 1, "routes": {"a": {"entry": {"rate_limit": {"rps": 1e999}}, "revision": 1}}}',
        b'{"revision": NaN, "routes": {}}',
        b'{"revision": 1, "routes": {"a": 5}}',
        b"[" * 100_000 + b"]" * 100_000,
    ],
    ids=["json", "utf8", "array", "revision", "negative", "inf", "nan", "item", "deep"],
)
async def test_a_state_file_that_cannot_be_read_stops_the_start(
    tmp_path: Path, store: RouteStore, content: bytes
) -> None:
    """issue 12, finding 3: starting empty would overwrite the saved entries at the next
    change; a file that is not a saved state is a ConfigError that names it."""
    state = tmp_path / "routes.json"
    state.write_bytes(content)
    with pytest.raises(ConfigError, match="routes.json"):
        await RouteStore(store.registry, store.replica, state).start()
    assert state.read_bytes() == content  # left as it was for the operator


async def test_a_saved_entry_no_longer_valid_is_kept_shown_and_replaceable(
    tmp_path: Path, store: RouteStore
) -> None:
    """issue 12, finding 3: an entry a stricter check refuses is not served, is listed with
    its reason, stays in the file across changes, and is replaced by a PUT at its revision."""
    state = tmp_path / "routes.json"
    good = {"entry": {"runner": "add@1.0.0"}, "revision": 4}
    bad = {"entry": {"runner": {"add@1.0.0": -1}}, "revision": 5}
    state.write_text(json.dumps({"revision": 5, "routes": {"good": good, "bad": bad}}))
    restored = RouteStore(store.registry, store.replica, state)
    await restored.start()
    assert list(store.registry.runtime_routes) == ["good"]
    assert "integer from 0" in restored.invalid["bad"]["error"]
    assert (await restored.fleet())["invalid"]["bad"]["revision"] == 5
    await restored.put(parse_route("other", {"runner": "add@2.0.0"}, "admin"))
    assert json.loads(state.read_text())["routes"]["bad"] == bad  # kept, not dropped
    with pytest.raises(Conflict):
        await restored.put(parse_route("bad", {"runner": "add@2.0.0"}, "admin"), if_revision=0)
    fixed = await restored.put(parse_route("bad", {"runner": "add@2.0.0"}, "admin"), 5)
    assert fixed.revision == 7 and not restored.invalid
    assert json.loads(state.read_text())["routes"]["bad"]["entry"] == {"runner": "add@2.0.0"}


async def test_concurrent_changes_are_each_saved_with_their_own_revision(
    tmp_path: Path, store: RouteStore
) -> None:
    """issue 12, finding 3: check, save and apply are one step; every acknowledged write
    is in the file, revisions never repeat, and If-Match "0" lets exactly one through."""
    state = tmp_path / "routes.json"
    saving = RouteStore(store.registry, store.replica, state)
    await saving.start()
    names = [f"r{i}" for i in range(20)]
    stored = await asyncio.gather(
        *(saving.put(parse_route(n, {"runner": "add@1.0.0"}, "admin")) for n in names)
    )
    assert sorted(s.revision for s in stored) == list(range(1, 21))  # type: ignore[type-var]
    saved = json.loads(state.read_text())
    assert saved["revision"] == 20 and sorted(saved["routes"]) == sorted(names)
    outcomes = await asyncio.gather(
        *(
            saving.put(parse_route("once", {"runner": "add@2.0.0"}, "admin"), if_revision=0)
            for _ in range(8)
        ),
        return_exceptions=True,
    )
    assert sum(not isinstance(o, Exception) for o in outcomes) == 1
    assert all(isinstance(o, Conflict) for o in outcomes if isinstance(o, Exception))
    assert not list(state.parent.glob(".*.tmp"))


async def test_a_state_file_path_that_is_a_folder_stops_the_start(
    tmp_path: Path, store: RouteStore
) -> None:
    """issue 12, finding 3: an unreadable state file is a ConfigError, not an empty start."""
    with pytest.raises(ConfigError, match="cannot be read"):
        await RouteStore(store.registry, store.replica, tmp_path).start()


_numbers = st.floats() | st.integers(-(10**400), 10**400) | st.sampled_from([True, None, -1])
_values = st.recursive(
    _numbers | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
_items = st.fixed_dictionaries(
    {"entry": _values | st.fixed_dictionaries({"runner": _values}), "revision": _numbers}
)
_states = st.one_of(
    st.binary(max_size=60),
    _values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {"revision": _numbers, "routes": st.dictionaries(st.text(max_size=8), _items | _values)}
    ).map(lambda v: json.dumps(v).encode()),
)


@settings(max_examples=150, deadline=None)
@given(content=_states)
def test_whatever_the_state_file_holds_the_start_fails_cleanly_or_restores(
    content: bytes, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """issue 12, finding 3 (the class): hostile state files (inf, NaN, huge and negative
    numbers, non-UTF-8, wrong types) are a ConfigError or a start with valid and invalid
    entries; nothing else escapes, and revisions stay ahead of every saved entry."""
    folder = tmp_path_factory.mktemp("state")
    (folder / "routes.json").write_bytes(content)
    registry = Registry(folder / "plugins", folder / "models")
    store = RouteStore(registry, Replica("me", "http://me"), folder / "routes.json")
    refused: ConfigError | None = None
    try:
        routes = store._read_state()
    except ConfigError as exc:
        refused = exc
    if refused is not None:
        assert "routes.json" in refused.message
        return
    revisions = [s.revision for s in routes.values()] + [
        i["revision"] for i in store.invalid.values()
    ]
    assert all(store.revision >= r for r in revisions)  # type: ignore[operator]
    json.dumps(store.invalid, allow_nan=False)
