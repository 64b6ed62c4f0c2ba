"""Weighted routes over real runner versions: only ready variants serve, sticky keys hold."""

import asyncio
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from plugserve.registry import checks
from plugserve.registry.errors import Unavailable, VersionNotFound
from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.lifecycle.watcher import Watcher
from plugserve.registry.routing.route_specs import ROUTES_FILE, RouteSpecError, parse_route
from plugserve.server.processes.link import WorkerLink
from plugserve.server.processes.worker_control import _add_control_routes
from plugserve.server.state import REGISTRY
from tests.helpers import write_add_runner

CANARY = """
[routes.canary]
runner = { "add@1.0.0" = 75, "add@2.0.0" = 25 }
sticky = "X-User-ID"
"""


@pytest.fixture
async def registry(plugins_dir: Path, models_dir: Path):  # type: ignore[no-untyped-def]
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    write_add_runner(plugins_dir, "add", "2.0.0", amount=2)
    (plugins_dir / "routes.toml").write_text(CANARY)
    reg = Registry(plugins_dir, models_dir, drain_timeout=2)
    await reg.start()
    yield reg
    await reg.close()


def served(registry: Registry, n: int = 4000, sticky: bool = True) -> Counter[str]:
    picks = Counter()
    for i in range(n):
        headers = {"x-user-id": f"u{i}"} if sticky else {}
        picks[registry.routes.resolve("canary", None, headers).variant] += 1
    return picks


async def test_traffic_splits_by_weight_with_and_without_a_sticky_key(registry: Registry) -> None:
    for sticky in (True, False):
        picks = served(registry, sticky=sticky)
        assert picks["add@2.0.0"] / 4000 == pytest.approx(0.25, abs=0.03)
        assert picks["add@1.0.0"] + picks["add@2.0.0"] == 4000


async def test_a_sticky_key_always_gets_the_same_variant(registry: Registry) -> None:
    for i in range(200):
        headers = {"x-user-id": f"user-{i}"}
        first = registry.routes.resolve("canary", None, headers).variant
        assert {registry.routes.resolve("canary", None, headers).variant for _ in range(5)} == {
            first
        }


async def test_an_unloaded_variant_hands_its_share_on_and_gets_it_back(
    plugins_dir: Path, registry: Registry
) -> None:
    before = {
        f"u{i}": registry.routes.resolve("canary", None, {"x-user-id": f"u{i}"}).variant
        for i in range(1000)
    }
    await registry.unload(("runner", "add", "2.0.0"))
    assert served(registry) == Counter({"add@1.0.0": 4000})
    described = registry.routes.entries["canary"].describe()
    assert [(v["runner"], v["ready"], v["share"]) for v in described["variants"]] == [
        ("add@1.0.0", True, 1.0),
        ("add@2.0.0", False, 0.0),
    ]
    await registry.load(plugins_dir / "runner" / "add" / "2.0.0", explicit=True)
    after = {k: registry.routes.resolve("canary", None, {"x-user-id": k}).variant for k in before}
    assert after == before  # the same split as before, key by key


async def test_a_variant_whose_folder_is_deleted_leaves_the_rotation(
    plugins_dir: Path, registry: Registry
) -> None:
    shutil.rmtree(plugins_dir / "runner" / "add" / "1.0.0")
    await registry.sync()
    assert served(registry, 500) == Counter({"add@2.0.0": 500})


async def test_no_ready_variant_is_503_naming_why(registry: Registry) -> None:
    await registry.unload(("runner", "add", "1.0.0"))
    await registry.unload(("runner", "add", "2.0.0"))
    with pytest.raises(Unavailable, match="no variant is ready"):
        registry.routes.resolve("canary")


async def test_an_open_circuit_hands_its_share_on_until_it_may_be_probed(
    registry: Registry,
) -> None:
    canary = registry.routes.resolve("canary", "2.0.0").runner
    assert canary.breaker is not None
    for _ in range(canary.breaker.threshold):
        canary.breaker.failure()
    assert served(registry, 500) == Counter({"add@1.0.0": 500})
    canary.breaker.opened_at -= canary.breaker.reset_s  # the reset time has passed
    assert served(registry, 2000)["add@2.0.0"] > 0


async def test_explicit_versions_bypass_the_weights(registry: Registry) -> None:
    assert registry.routes.resolve("canary", "2.0.0").variant == "add@2.0.0"
    with pytest.raises(VersionNotFound, match="split between add@1.0.0, add@2.0.0"):
        registry.routes.resolve("canary", "3.0.0")


def test_entries_round_trip_through_their_json_shape() -> None:
    entry = {
        "runner": {"iris@1.0.0": 90, "iris@2.0.0": 10},
        "preprocess": ["scale"],
        "postprocess": [],
        "sticky": "x-user-id",
        "rate_limit": {"rps": 5.0, "burst": 10},
    }
    spec = parse_route("iris", entry, "admin")
    assert spec.as_entry() == entry
    assert parse_route("iris", spec.as_entry(), "etcd").variants == spec.variants
    assert parse_route("x", {"runner": "a@1.0.0"}, "admin").as_entry() == {"runner": "a@1.0.0"}
    with pytest.raises(RouteSpecError, match=r"^\.runner: must be a string or a table"):
        parse_route("x", {"runner": 3}, "admin")
    with pytest.raises(RouteSpecError, match=r"^\.runner: is required"):
        parse_route("x", {}, "admin")


async def test_zero_weight_versions_serve_only_when_no_weighted_one_is_ready(
    plugins_dir: Path, registry: Registry
) -> None:
    (plugins_dir / "routes.toml").write_text(
        '[routes.canary]\nrunner = { "add@1.0.0" = 0, "add@2.0.0" = 100 }\n'
    )
    await registry.reload_routes_file()
    assert served(registry, 300) == Counter({"add@2.0.0": 300})
    await registry.unload(("runner", "add", "2.0.0"))
    # A full rollout to a version this server lacks leaves it on what it has.
    assert served(registry, 300) == Counter({"add@1.0.0": 300})
    shares = {
        v["runner"]: v["share"] for v in registry.routes.entries["canary"].describe()["variants"]
    }
    assert shares == {"add@1.0.0": 1.0, "add@2.0.0": 0.0}


async def test_without_a_request_a_weighted_route_gives_its_primary_variant(
    registry: Registry,
) -> None:
    # Metadata and readiness place no request: the highest weight ready, every time.
    assert {registry.routes.resolve("canary").variant for _ in range(100)} == {"add@1.0.0"}
    await registry.unload(("runner", "add", "1.0.0"))
    assert registry.routes.resolve("canary").variant == "add@2.0.0"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"runner": "add", "rate_limit": 5}, ".rate_limit: must be a table"),
        ({"runner": "add", "rate_limit": {"rps": float("nan")}}, ".rate_limit.rps: must be a finite"),
        ({"runner": "add", "rate_limit": {"rps": 1e999}}, ".rate_limit.rps: must be a finite"),
        ({"runner": "add\n"}, ".runner: must not hold control characters"),
        ({"runner": {"add@1.0.0\x00": 1}}, ".runner.'add@1.0.0\\x00': must not hold"),
        ({"runner": "add@1.0.0\n"}, ".runner: must not hold control characters"),
        ({"runner": "add", "sticky": "x-user-id\n"}, ".sticky: must not hold control characters"),
        ({"runner": "add", "sticky": "x user"}, ".sticky: must match"),
        ({"runner": "add", "preprocess": ["a"] * 65}, ".preprocess: must have at most 64 items"),
        ({"runner": "add", "postprocess": json.loads("[" * 40 + "]" * 40)},
         ": nests tables or arrays deeper than 32"),
    ],
)  # fmt: skip
def test_hostile_entries_are_route_spec_errors_naming_the_field(
    entry: dict[str, object], message: str
) -> None:
    """issue 12, findings 1 and 16: the check every source of a route entry goes through."""
    with pytest.raises(RouteSpecError) as info:
        parse_route("x", entry, "admin")
    assert str(info.value).startswith(message), str(info.value)


GRAPH = {
    "steps": [
        {"runner": "det@1.0.0", "inputs": {"x": "image"}, "outputs": {"y": "boxes"}},
        {"processor": "crop", "inputs": ["image", "boxes"], "outputs": ["crops"]},
        {"runner": "rec", "inputs": {"x": "crops"}, "outputs": {"y": "text"}},
    ],
}


def test_a_graph_entry_round_trips_and_answers_what_no_step_reads() -> None:
    spec = parse_route("ocr", GRAPH, "admin")
    assert spec.outputs == ("text",) and str(spec.runner) == "rec"
    assert [s.kind for s in spec.steps] == ["runner", "processor", "runner"]
    assert spec.steps[1].inputs == (("image", "image"), ("boxes", "boxes"))
    again = parse_route("ocr", spec.as_entry(), "etcd")
    assert again.steps == spec.steps and again.outputs == spec.outputs


def step(**entry: object) -> dict[str, object]:
    return {"inputs": ["a"], "outputs": ["b"], **entry}


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"runner": "a", "steps": [step(runner="a")]}, ".runner: a graph route names its runners"),
        ({"runner": "a", "outputs": ["b"]}, ".outputs: only a graph route"),
        ({"steps": []}, ".steps: must not be empty"),
        ({"steps": [step(processor="p")]}, ".steps: a graph route runs at least one runner"),
        ({"steps": [step(runner="a", processor="p")]}, ".steps[0]: names one of runner"),
        ({"steps": [step(route="x")]}, ".steps[0].route: a route cannot call itself"),
        ({"steps": [{"runner": "a", "outputs": ["b"]}]}, ".steps[0].inputs: is required"),
        ({"steps": [step(runner="a", inputs=["b"])]}, ".steps[0].inputs: tensor 'b' is given by"),
        ({"steps": [step(runner="a"), step(runner="c")]}, ".steps[1].outputs: tensor 'b' is given"),
        ({"steps": [step(runner="a")], "outputs": ["z"]}, ".outputs: 'z' is given by no step"),
        ({"steps": [step(runner="a", unknown=1)]}, ".steps[0]: unknown key(s) ['unknown']"),
        ({"steps": [step(runner="a", outputs={"y": "a\n"})]}, ".steps[0].outputs.'y': must not"),
    ],
)  # fmt: skip
def test_graph_entries_that_cannot_run_are_refused_naming_the_field(
    entry: dict[str, object], message: str
) -> None:
    with pytest.raises(RouteSpecError) as info:
        parse_route("x", entry, "admin")
    assert str(info.value).startswith(message), str(info.value)


async def test_routes_file_is_read_and_parsed_off_the_event_loop(
    plugins_dir: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``routes.toml`` costs as much to digest and parse as it is long (up to 16 MiB): at
    start, on the watcher's change and on a worker's sync, both run on a thread."""
    seen: list[tuple[str, str, bool]] = []
    moment = "start"

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    real_read = checks.read_toml

    def read(path: Path, *args: Any) -> dict[str, Any]:
        if path.name == ROUTES_FILE:
            seen.append(("read", moment, on_loop()))
        return real_read(path, *args)

    monkeypatch.setattr(checks, "read_toml", read)
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    (plugins_dir / ROUTES_FILE).write_text('[routes.a]\nrunner = "add"\n')
    registry = Registry(plugins_dir, models_dir, drain_timeout=2)
    real_digest = registry.fingerprinter.file

    def digest(path: Path) -> str:
        if path.name == ROUTES_FILE:
            seen.append(("digest", moment, on_loop()))
        return real_digest(path)

    monkeypatch.setattr(registry.fingerprinter, "file", digest)
    control = web.Application()
    control[REGISTRY] = registry
    _add_control_routes(control, cast(WorkerLink, None))
    client = TestClient(TestServer(control))
    await client.start_server()
    try:
        await registry.start()
        moment = "watcher"
        (plugins_dir / ROUTES_FILE).write_text('[routes.b]\nrunner = "add"\n')
        watcher = Watcher(registry)
        watcher._arm(first=True)
        await watcher.apply(("routes",))
        moment = "worker"
        (plugins_dir / ROUTES_FILE).write_text('[routes.c]\nrunner = "add"\n')
        reply = await client.post("/_control/sync_routes_file")
        assert (await reply.json()) == {"result": "applied"}
        assert sorted(registry.file_routes) == ["c"]
    finally:
        await client.close()
        await registry.close()
    assert {(kind, when) for kind, when, _ in seen} == {
        (kind, when) for kind in ("digest", "read") for when in ("start", "watcher", "worker")
    }
    assert [call for call in seen if call[2]] == []  # none on the event loop
