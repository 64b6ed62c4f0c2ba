"""Discovery, lifecycle and route resolution over real plugin folders on disk."""

import asyncio
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plugserve.registry import checks, manifest
from plugserve.registry.errors import RouteNotFound, Unavailable, VersionNotFound
from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.types import RequestContext
from tests.helpers import processor_source, write_add_runner, write_plugin, write_processor


def ctx(route: str = "r") -> RequestContext:
    return RequestContext("id", route, {}, {}, "application/json")


@pytest.fixture
async def registry(plugins_dir: Path, models_dir: Path):  # type: ignore[no-untyped-def]
    reg = Registry(plugins_dir, models_dir, drain_timeout=2)
    yield reg
    await reg.close()


async def run(registry: Registry, route: str, x: float, version: str | None = None) -> float:
    chain = registry.routes.resolve(route, version)
    out = await chain.run({"x": np.full((1, 4), x, np.float32)}, ctx(route))
    return float(out["y"][0, 0])


async def test_discovery_skips_ignored_names_and_unknown_types(
    plugins_dir: Path, registry: Registry
) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0")
    (plugins_dir / "runner" / "add" / ".2.0.0.tmp").mkdir()
    (plugins_dir / "runner" / "add" / "1.1.0~").mkdir()
    (plugins_dir / "runner" / "add" / "__pycache__").mkdir()
    (plugins_dir / "models").mkdir()
    (plugins_dir / "runner" / "add" / "README.md").write_text("not a version")
    assert registry.discover() == [plugins_dir / "runner" / "add" / "1.0.0"]


async def test_every_runner_is_a_route_floating_to_its_highest_ready_version(
    plugins_dir: Path, registry: Registry
) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    write_add_runner(plugins_dir, "add", "1.10.0", amount=10)
    write_add_runner(plugins_dir, "add", "1.9.0", amount=9)
    await registry.start()
    assert await run(registry, "add", 0) == 10  # 1.10.0 > 1.9.0: numbers, not strings
    assert registry.routes.entries["add"].versions == ["1.10.0", "1.9.0", "1.0.0"]


async def test_prerelease_sorts_below_release_but_above_older(
    plugins_dir: Path, registry: Registry
) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    write_add_runner(plugins_dir, "add", "2.0.0-rc.1", amount=2)
    await registry.start()
    assert await run(registry, "add", 0) == 2
    write_add_runner(plugins_dir, "add", "2.0.0", amount=3)
    await registry.load(plugins_dir / "runner" / "add" / "2.0.0")
    assert await run(registry, "add", 0) == 3


async def test_chain_with_floating_and_pinned_processors(
    plugins_dir: Path, registry: Registry
) -> None:
    write_processor(plugins_dir, "preprocessor", "pre", "1.0.0", 100)
    write_processor(plugins_dir, "preprocessor", "pre", "2.0.0", 200)
    write_processor(plugins_dir, "postprocessor", "post", "1.0.0", 1000)
    write_add_runner(
        plugins_dir, "add", "1.0.0", amount=1,
        route='[route]\nname = "sum"\npreprocess = ["pre@1.0.0", "pre"]\npostprocess = ["post"]\n',
    )  # fmt: skip
    await registry.start()
    assert await run(registry, "sum", 0) == 100 + 200 + 1 + 1000
    chain = registry.routes.resolve("sum")
    assert [s.label for s in chain.stages] == [
        "preprocessor/pre@1.0.0", "preprocessor/pre@2.0.0", "runner/add@1.0.0",
        "postprocessor/post@1.0.0",
    ]  # fmt: skip
    with pytest.raises(RouteNotFound):
        registry.routes.resolve("add")


async def test_version_selects_the_runner_and_errors_say_why(
    plugins_dir: Path, registry: Registry
) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    write_add_runner(plugins_dir, "add", "2.0.0", amount=2)
    broken = write_add_runner(plugins_dir, "add", "3.0.0", amount=3)
    (broken / "model.onnx").write_bytes(b"not onnx")
    await registry.start()
    assert await run(registry, "add", 0, "1.0.0") == 1
    assert await run(registry, "add", 0) == 2
    with pytest.raises(VersionNotFound, match="no runner version '9.0.0'"):
        registry.routes.resolve("add", "9.0.0")
    with pytest.raises(Unavailable, match="runner/add@3.0.0 is failed"):
        registry.routes.resolve("add", "3.0.0")
    with pytest.raises(RouteNotFound, match="Request for unknown model: 'nope' is not found"):
        registry.routes.resolve("nope")


async def test_an_integer_version_selects_the_highest_ready_release_of_that_major(
    plugins_dir: Path, registry: Registry
) -> None:
    """Triton's model_version="1": an exact version first, else the highest ready 1.x.y."""
    for version, amount in (("1.0.0", 1), ("1.2.0", 12), ("1.10.0-rc.1", 110), ("2.0.0", 2)):
        write_add_runner(plugins_dir, "add", version, amount=amount)
    broken = write_add_runner(plugins_dir, "add", "3.0.0", amount=3)
    (broken / "model.onnx").write_bytes(b"not onnx")
    await registry.start()
    routes = registry.routes
    assert routes.resolve("add", "1").runner_version == "1.2.0"  # not the prerelease
    assert routes.resolve("add", "2").runner_version == "2.0.0"
    assert routes.resolve("add", "1.0.0").runner_version == "1.0.0"  # exact versions stay
    with pytest.raises(Unavailable, match="runner/add@3.0.0 is failed"):
        routes.resolve("add", "3")
    for unknown in ("7", "01", "1.", "\u0661"):  # no 7.x.y; not ASCII digits in a plain form
        with pytest.raises(VersionNotFound, match="no runner version"):
            routes.resolve("add", unknown)
    await registry.unload(("runner", "add", "1.2.0"))
    assert registry.routes.resolve("add", "1").runner_version == "1.0.0"


async def test_failed_load_is_recorded_and_the_rest_serves(
    plugins_dir: Path, registry: Registry
) -> None:
    write_add_runner(plugins_dir, "good", "1.0.0")
    write_plugin(plugins_dir, "runner", "bad", "1.0.0", '[runner]\nbackend = "nope"\n', module=None)
    write_plugin(
        plugins_dir, "runner", "Bad_Name", "1.0.0", '[runner]\nbackend = "x"\n', module=None
    )
    await registry.start()
    states = {(r.name, r.state) for r in registry.plugins()}
    assert states == {("good", "ready"), ("bad", "failed"), ("Bad_Name", "failed")}
    bad = registry.records[("runner", "bad", "1.0.0")]
    assert "unknown backend 'nope' (known: onnxruntime, tensorrt)" in (bad.last_error or "")
    assert await run(registry, "good", 1) == 2
    with pytest.raises(Unavailable, match="has no ready version"):
        registry.routes.resolve("bad")


async def test_missing_processor_makes_the_route_unavailable(
    plugins_dir: Path, registry: Registry
) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0", route='[route]\npreprocess = ["ghost"]\n')
    await registry.start()
    with pytest.raises(Unavailable, match="preprocessor ghost is not installed"):
        registry.routes.resolve("add")
    assert registry.routes.describe()[0]["ready"] is False


async def test_routes_file_adds_and_overrides_routes(plugins_dir: Path, registry: Registry) -> None:
    write_processor(plugins_dir, "preprocessor", "pre", "1.0.0", 100)
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1, route='[route]\npreprocess = ["pre"]\n')
    write_add_runner(plugins_dir, "add", "2.0.0", amount=2, route='[route]\npreprocess = ["pre"]\n')
    (plugins_dir / "routes.toml").write_text(
        '[routes.stable]\nrunner = "add@1.0.0"\n[routes.add]\nrunner = "add"\npreprocess = []\n'
    )
    await registry.start()
    assert await run(registry, "stable", 0) == 101  # keeps the manifest's preprocess
    assert await run(registry, "add", 0) == 2  # the file emptied the chain
    assert registry.routes.entries["stable"].versions == ["1.0.0"]
    with pytest.raises(VersionNotFound, match="pinned to add@1.0.0"):
        registry.routes.resolve("stable", "2.0.0")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[routes.x\n", "routes.toml"),
        ('[routes.x]\nrunner = { "a@1.0.0" = 90, "b@2.0.0" = 10 }\n', "split one runner's versions"),
        ('[routes.x]\nrunner = { "a" = 90, "a@2.0.0" = 10 }\n', "names a version"),
        ('[routes.x]\nrunner = { "a@1.0.0" = 0 }\n', "at least one weight"),
        ('[routes.x]\nrunner = { "a@1.0.0" = -1 }\n', "integer from 0"),
        ('[routes.x]\nrunner = { "a@1.0.0" = 1.5 }\n', "integer from 0"),
        ('[routes.x]\nrunner = {}\n', "at least one name@version"),
        ('[routes.x]\nrunner = "a"\nsticky = "bad header"\n', "sticky: must match"),
        ("[routes.x]\npreprocess = []\n", "runner: is required"),
        ('[routes.x]\nrunner = "a"\nextra = 1\n', "unknown key"),
        ('[routes.X]\nrunner = "a"\n', "route name must match"),
        ('[other]\n', "unknown table"),
    ],
)  # fmt: skip
async def test_invalid_routes_file_keeps_the_previous_routes(
    plugins_dir: Path, registry: Registry, text: str, message: str
) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0")
    (plugins_dir / "routes.toml").write_text('[routes.alias]\nrunner = "add"\n')
    await registry.start()
    assert "alias" in registry.routes.entries
    (plugins_dir / "routes.toml").write_text(text)
    assert await registry.reload_routes_file() is False
    assert message in (registry.routes_file_error or "")
    assert "alias" in registry.routes.entries


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'[routes.x]\nrunner = "add"\nrate_limit = { rps = inf }\n', "rate_limit.rps: must be a finite"),
        (b'[routes.x]\nrunner = "add"\nrate_limit = { rps = nan }\n', "rate_limit.rps: must be a finite"),
        (b'[routes.x]\nrunner = "add"\nrate_limit = { rps = 1e999 }\n', "rate_limit.rps: must be a finite"),
        (b'[routes.x]\nrunner = "add"\nrate_limit = { rps = 1e-300 }\n', ">= 0.001"),
        (b'[routes.x]\nrunner = "add"\nrate_limit = { rps = 1, burst = -1 }\n', "rate_limit.burst"),
        (b'[routes.x]\nrunner = "add"\nsticky = "x-user\\n"\n', "sticky"),
        (b'[routes."x\\n"]\nrunner = "add"\n', "route name must match"),
        (b'[routes.x]\nrunner = "add\\u0000"\n', "control characters"),
        (b"[routes.x]\nrunner = " + b"[" * 500 + b"]" * 500 + b"\n", "deeper than"),
        (b'[routes.x]\nrunner = "\xff"\n', "not UTF-8"),
    ],
)  # fmt: skip
async def test_a_hostile_routes_file_is_reported_once_and_the_table_kept(
    plugins_dir: Path, registry: Registry, data: bytes, message: str
) -> None:
    """issue 12, finding 1: rps = inf (OverflowError before), nesting, bad bytes in routes.toml
    are the file's error: shown, the previous table kept, and not forgotten by the next rescan."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    (plugins_dir / "routes.toml").write_text('[routes.alias]\nrunner = "add"\n')
    await registry.start()
    (plugins_dir / "routes.toml").write_bytes(data)
    assert await registry.sync_routes_file() == "invalid"
    assert message in (registry.routes_file_error or "")
    assert "alias" in registry.routes.entries and "x" not in registry.routes.entries
    assert await registry.sync_routes_file() == "unchanged"
    assert message in (registry.routes_file_error or "")
    assert (await registry.sync()).routes_file == "unchanged"
    assert await run(registry, "alias", 1.0) == 2.0


async def test_two_runners_claiming_one_route_is_reported(
    plugins_dir: Path, registry: Registry
) -> None:
    write_add_runner(plugins_dir, "a", "1.0.0", amount=1, route='[route]\nname = "shared"\n')
    write_add_runner(plugins_dir, "b", "1.0.0", amount=2, route='[route]\nname = "shared"\n')
    await registry.start()
    assert await run(registry, "shared", 0) == 1
    assert any("declared by runner b and by runner a" in e for e in registry.routes.errors)


async def test_reload_swaps_and_unload_releases_everything(
    plugins_dir: Path, registry: Registry
) -> None:
    folder = write_processor(plugins_dir, "preprocessor", "pre", "1.0.0", 1)
    write_add_runner(plugins_dir, "add", "1.0.0", amount=0, route='[route]\npreprocess = ["pre"]\n')
    await registry.start()
    first = registry.records[("preprocessor", "pre", "1.0.0")].current
    assert first is not None and await run(registry, "add", 0) == 1
    (folder / "plugin.toml").write_text((folder / "plugin.toml").read_text().replace("= 1", "= 5"))
    await registry.load(folder)
    assert await run(registry, "add", 0) == 5
    assert first.component is None  # the old instance was released
    assert not [m for m in sys.modules if first.package and m.startswith(first.package)]
    assert await registry.unload(("preprocessor", "pre", "1.0.0")) == "unloaded"
    assert registry.records[("preprocessor", "pre", "1.0.0")].state == "unloaded"
    with pytest.raises(
        Unavailable, match=r"preprocessor pre has no ready version \(1.0.0 unloaded\)"
    ):
        registry.routes.resolve("add")


async def test_failed_reload_keeps_the_serving_instance(
    plugins_dir: Path, registry: Registry
) -> None:
    folder = write_processor(plugins_dir, "preprocessor", "pre", "1.0.0", 1)
    write_add_runner(plugins_dir, "add", "1.0.0", amount=0, route='[route]\npreprocess = ["pre"]\n')
    await registry.start()
    (folder / "plugin.py").write_text("raise ImportError('half written')\n")
    assert await registry.load(folder) == "failed"
    record = registry.records[("preprocessor", "pre", "1.0.0")]
    assert record.state == "ready"
    assert "half written" in (record.last_error or "")
    assert await run(registry, "add", 0) == 1
    (folder / "plugin.py").write_text(textwrap.dedent(processor_source("preprocessor")))
    assert await registry.load(folder) == "reloaded"
    assert (record.state, record.last_error) == ("ready", None)


async def test_in_flight_request_finishes_on_the_instance_it_started_on(
    plugins_dir: Path, registry: Registry
) -> None:
    folder = write_processor(plugins_dir, "preprocessor", "pre", "1.0.0", 1)
    write_add_runner(plugins_dir, "add", "1.0.0", amount=0, route='[route]\npreprocess = ["pre"]\n')
    await registry.start()
    chain = registry.routes.resolve("add")
    chain.enter()
    old = chain.preprocess[0]
    assert registry.records[("preprocessor", "pre", "1.0.0")].as_json()["in_flight"] == 1
    reload = asyncio.create_task(registry.load(folder, force=True))
    await asyncio.sleep(0.3)
    assert not reload.done()  # draining: the old instance still has a request
    assert old.component is not None
    out = await chain.run({"x": np.zeros((1, 4), np.float32)}, ctx("add"))
    assert float(out["y"][0, 0]) == 1
    chain.leave()
    await asyncio.wait_for(reload, 5)
    assert old.component is None


async def test_symlinks_leading_out_of_the_plugins_dir_are_refused(
    plugins_dir: Path, registry: Registry, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    write_add_runner(outside, "add", "1.0.0")
    (plugins_dir / "runner" / "add").mkdir(parents=True)
    (plugins_dir / "runner" / "add" / "1.0.0").symlink_to(outside / "runner" / "add" / "1.0.0")
    folder = write_processor(plugins_dir, "preprocessor", "pre", "1.0.0", 1)
    secret = tmp_path / "secret.py"
    secret.write_text("X = 1\n")
    (folder / "helper.py").symlink_to(secret)
    inside = write_add_runner(plugins_dir, "ok", "1.0.0")
    (inside / "model.onnx").rename(plugins_dir / "shared.onnx")
    (inside / "model.onnx").symlink_to(plugins_dir / "shared.onnx")  # inside: fine
    await registry.start()
    runner = registry.records[("runner", "add", "1.0.0")]
    assert runner.state == "failed"
    assert "runner/add/1.0.0 leads outside the plugins dir" in (runner.last_error or "")
    pre = registry.records[("preprocessor", "pre", "1.0.0")]
    assert pre.state == "failed"
    assert "helper.py leads outside the plugins dir" in (pre.last_error or "")
    ok = registry.records[("runner", "ok", "1.0.0")]
    assert ok.state == "ready", ok.last_error


@pytest.mark.parametrize(
    "hostile",
    [
        "[route]\nrate_limit = { rps = inf }\n",  # OverflowError at fa78c15
        "[config]\nx = " + "[" * 500 + "]" * 500 + "\n",  # RecursionError at fa78c15
    ],
    ids=["inf", "deep"],
)
async def test_any_exception_while_loading_is_a_failed_load(
    plugins_dir: Path, registry: Registry, hostile: str
) -> None:
    """issue 12, class "any exception while loading becomes a failed load" (finding 1's
    symptom): never stuck in ``loading``, never raised out of a rescan."""
    write_add_runner(plugins_dir, "good", "1.0.0")
    folder = write_add_runner(plugins_dir, "bad", "1.0.0")
    manifest = folder / "plugin.toml"
    manifest.write_text(manifest.read_text() + hostile)
    await registry.start()
    bad = registry.records[("runner", "bad", "1.0.0")]
    assert bad.state == "failed"
    assert bad.last_error
    assert await run(registry, "good", 1) == 2
    report = await registry.sync(force=True)
    assert [f["plugin"] for f in report.failed] == ["runner/bad@1.0.0"]
    # a serving version whose manifest turns hostile keeps serving
    good = write_add_runner(plugins_dir, "good", "1.0.0")
    (good / "plugin.toml").write_text((good / "plugin.toml").read_text() + hostile)
    assert await registry.load(good) == "failed"
    record = registry.records[("runner", "good", "1.0.0")]
    assert (record.state, bool(record.last_error)) == ("ready", True)
    assert await run(registry, "good", 1) == 2


HANGING_CLOSE = """
    import asyncio, pathlib, time
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Pre:
        def process(self, data, ctx):
            return data

        {close}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Pre()
"""


@pytest.mark.parametrize(
    "close",
    [
        "def close(self):\n            while True:\n                time.sleep(1)",
        "async def close(self):\n            while True:\n                await asyncio.sleep(1)",
    ],
    ids=["sync", "async"],
)
async def test_a_close_that_never_returns_holds_no_reload_unload_or_close(
    plugins_dir: Path, models_dir: Path, close: str
) -> None:
    """issue 12, finding 4: a close() that never returns once hung that version's reload,
    then every later reload, unload and rescan."""
    source = HANGING_CLOSE.replace("{close}", close)
    folder = write_plugin(
        plugins_dir, "preprocessor", "stuck", "1.0.0", files={"plugin.py": source}
    )
    registry = Registry(plugins_dir, models_dir, drain_timeout=1, close_timeout=0.3)
    await registry.start()
    key = ("preprocessor", "stuck", "1.0.0")
    started = asyncio.get_running_loop().time()

    async def bounded(step: object) -> object:
        return await asyncio.wait_for(step, 5)  # type: ignore[arg-type]

    assert await bounded(registry.load(folder, force=True)) == "reloaded"
    assert await bounded(registry.load(folder, force=True)) == "reloaded"
    assert (await bounded(registry.sync(force=True))).reloaded == ["preprocessor/stuck@1.0.0"]
    assert await bounded(registry.unload(key)) == "unloaded"
    assert await bounded(registry.load(folder, explicit=True)) == "loaded"
    await bounded(registry.close())
    assert registry.records == {}
    # Each step waits out close_timeout at most (about 2 s in all); a loaded machine
    # stretches that, a close that held a step would take each step's 5 s bound.
    assert asyncio.get_running_loop().time() - started < 10


PINS_PRE = '[route]\npreprocess = ["pre@1.0.0"]\n'


async def test_a_version_whose_chain_is_not_whole_waits_on_every_kind_of_route(
    plugins_dir: Path, registry: Registry
) -> None:
    """Issue 29 finding 9, through the routes file: a declared route, a routes.toml alias
    floating on the runner and a weighted split all stay on 1.0.0 while 2.0.0 waits for
    ``pre@1.0.0``; 2.0.0 asked for by version says what it waits for; once the processor
    loads, every one of them takes 2.0.0 with no further step."""
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    write_add_runner(plugins_dir, "add", "2.0.0", amount=2, route=PINS_PRE)
    (plugins_dir / "routes.toml").write_text(
        '[routes.alias]\nrunner = "add"\n'
        '[routes.split]\nrunner = { "add@1.0.0" = 50, "add@2.0.0" = 50 }\n'
    )
    await registry.start()
    for route in ("add", "alias", "split"):
        assert [await run(registry, route, 0) for _ in range(20)] == [1] * 20
        with pytest.raises(Unavailable, match=r"add@2.0.0 waits for its chain: preprocessor pre@1"):
            registry.routes.resolve(route, "2.0.0")
        described = registry.routes.entries[route].describe()
        assert described["ready"] is True
        assert described["waiting"] == [
            {"runner": "add@2.0.0", "waiting_for": ["preprocessor pre@1.0.0 is not installed"]}
        ]
    assert registry.waiting.keys() == {(r, "add@2.0.0") for r in ("add", "alias", "split")}
    split = registry.routes.entries["split"].describe()["variants"]
    assert [(v["runner"], v["ready"], v["share"]) for v in split] == [
        ("add@2.0.0", False, 0.0),
        ("add@1.0.0", True, 1.0),
    ]

    assert await registry.load(write_processor(plugins_dir, "preprocessor", "pre", "1.0.0", 100))
    assert await run(registry, "add", 0) == await run(registry, "alias", 0) == 102
    split = registry.routes.entries["split"].describe()["variants"]
    assert [(v["runner"], v["ready"], v["share"]) for v in split] == [
        ("add@2.0.0", True, 0.5),
        ("add@1.0.0", True, 0.5),
    ]
    assert registry.waiting == {}
    assert all(e.waiting == {} for e in registry.routes.entries.values())


async def test_a_route_declared_by_a_waiting_version_keeps_the_eligible_version_s_name(
    plugins_dir: Path, registry: Registry
) -> None:
    """Issue 29 finding 9, a variant: runner 2.0.0 renames its route (``[route] name``) and
    pins a processor not installed; the route keeps the name 1.0.0 declares, served by
    1.0.0, until 2.0.0's chain is whole."""
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    write_add_runner(
        plugins_dir,
        "add",
        "2.0.0",
        amount=2,
        route='[route]\nname = "adder"\npreprocess = ["pre@1.0.0"]\n',
    )
    await registry.start()
    assert set(registry.routes.entries) == {"add"}
    assert await run(registry, "add", 0) == 1
    await registry.load(write_processor(plugins_dir, "preprocessor", "pre", "1.0.0", 100))
    assert set(registry.routes.entries) == {"adder"}
    assert await run(registry, "adder", 0) == 102


async def test_a_stage_unloaded_under_its_route_falls_back_to_a_whole_chain(
    plugins_dir: Path, registry: Registry
) -> None:
    """A processor of the serving chain unloaded: a request already on that chain finishes
    on it (the processor is released after it), new requests go to the highest version
    whose chain is still whole, and the unloaded one's version waits for it again."""
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    write_add_runner(plugins_dir, "add", "2.0.0", amount=2, route=PINS_PRE)
    write_processor(plugins_dir, "preprocessor", "pre", "1.0.0", 100)
    await registry.start()
    held = registry.routes.resolve("add")
    assert held.variant == "add@2.0.0"
    registry.drain_timeout = 60
    held.enter()
    unload = asyncio.create_task(registry.unload(("preprocessor", "pre", "1.0.0")))
    await asyncio.sleep(0)  # the unload runs up to its wait for the held request
    assert registry.records[("preprocessor", "pre", "1.0.0")].state == "draining"
    assert not unload.done()
    assert await run(registry, "add", 0) == 1
    assert registry.routes.entries["add"].waiting == {
        "2.0.0": ("preprocessor/pre@1.0.0 is draining",)
    }
    out = await held.run({"x": np.zeros((1, 4), np.float32)}, ctx("add"))
    assert float(out["y"][0, 0]) == 102
    held.leave()
    assert await unload == "unloaded"
    assert registry.routes.entries["add"].waiting == {
        "2.0.0": ("preprocessor/pre@1.0.0 is unloaded",)
    }


async def test_manifests_are_read_and_parsed_off_the_event_loop(
    plugins_dir: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest costs as much to read and parse as it is long: discovery, a rescan, an
    admin load and the watcher's sync each read them on a thread, never on the loop."""
    seen: list[tuple[str, str, bool]] = []

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    real_read, real_parse = checks.read_toml, manifest.parse_manifest

    def read(path: Path, *args: Any) -> dict[str, Any]:
        if path.name == manifest.MANIFEST_NAME:
            seen.append(("read", path.parent.name, on_loop()))
        return real_read(path, *args)

    def parse(raw: Mapping[str, Any], folder: Path, *args: Any) -> manifest.Manifest:
        seen.append(("parse", folder.name, on_loop()))
        return real_parse(raw, folder, *args)

    monkeypatch.setattr(checks, "read_toml", read)
    monkeypatch.setattr(manifest, "parse_manifest", parse)
    write_add_runner(plugins_dir, "add", "1.0.0")
    write_processor(plugins_dir, "preprocessor", "pre", "1.0.0", 1.0)
    await registry.start()  # discovery and the first loads
    assert await run(registry, "add", 1.0) == 2.0
    await registry.sync(force=True)  # POST /admin/reload?force=true, a rescan
    folder = write_add_runner(plugins_dir, "add", "1.1.0", amount=2.0)
    assert await registry.load(folder, explicit=True) == "loaded"  # an admin load
    assert await registry.sync_version(("runner", "add", "1.0.0")) == "unchanged"  # the watcher
    assert {(kind, version) for kind, version, _ in seen} >= {
        ("read", "1.0.0"), ("parse", "1.0.0"), ("read", "1.1.0"), ("parse", "1.1.0"),
    }  # fmt: skip
    assert [call for call in seen if call[2]] == []  # none on the event loop
