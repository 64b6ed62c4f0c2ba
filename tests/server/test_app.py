"""The application's lifetime: admin calls that always answer, and a bounded shutdown."""

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
import structlog.testing

from plugserve.registry.plugins import calls
from plugserve.server.app import create_app
from plugserve.server.config import Settings
from tests.helpers import write_add_runner, write_plugin

HANGING_CLOSE = """
    import asyncio, time
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Pre:
        def process(self, data, ctx):
            return data

        {close}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Pre()

    @hookimpl
    async def plugserve_shutdown(app):
        await asyncio.sleep(3600)
"""
CLOSES = {
    "sync": "def close(self):\n            while True:\n                time.sleep(1)",
    "async": "async def close(self):\n            await asyncio.Event().wait()",
}


def write_hanging(plugins_dir: Path, close: str) -> Path:
    source = HANGING_CLOSE.replace("{close}", CLOSES[close])
    return write_plugin(plugins_dir, "preprocessor", "stuck", "1.0.0", files={"plugin.py": source})


@pytest.mark.parametrize("close", ["sync", "async"])
async def test_admin_calls_answer_whatever_a_plugin_close_does(
    plugins_dir: Path, client: Callable[..., object], close: str
) -> None:
    """issue 12, finding 4: a close() that never returns once hung the version's reload, then
    every later reload, unload and rescan: each admin call must answer, and in time."""
    write_hanging(plugins_dir, close)
    cli = await client(close_timeout_s=0.3)  # type: ignore[operator]
    path = "/admin/plugins/preprocessor/stuck/1.0.0"
    started = time.monotonic()
    for _ in range(2):
        resp = await asyncio.wait_for(cli.post(f"{path}/reload"), 10)
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["outcome"] == "reloaded"
    resp = await asyncio.wait_for(cli.post("/admin/reload?force=true"), 10)
    assert resp.status == 200
    assert (await resp.json())["reloaded"] == ["preprocessor/stuck@1.0.0"]
    resp = await asyncio.wait_for(cli.post(f"{path}/unload"), 10)
    assert resp.status == 200
    assert (await resp.json())["plugin"]["state"] == "unloaded"
    assert time.monotonic() - started < 8


@pytest.mark.parametrize(
    "hostile",
    ["[route]\nrate_limit = { rps = inf }\n", "[config]\nx = " + "[" * 500 + "]" * 500 + "\n"],
    ids=["inf", "deep"],
)
async def test_admin_reload_never_answers_500_for_a_version_that_cannot_load(
    plugins_dir: Path, client: Callable[..., object], hostile: str
) -> None:
    """issue 12, class "any exception while loading becomes a failed load": a version dropped
    in while running never sticks in ``loading``; the rescan answers 200 listing it."""
    write_add_runner(plugins_dir, "good", "1.0.0")
    cli = await client()  # type: ignore[operator]
    folder = write_add_runner(plugins_dir, "bad", "1.0.0")
    (folder / "plugin.toml").write_text((folder / "plugin.toml").read_text() + hostile)
    resp = await cli.post("/admin/reload")
    assert resp.status == 200, await resp.text()
    assert [f["plugin"] for f in (await resp.json())["failed"]] == ["runner/bad@1.0.0"]
    resp = await cli.post("/admin/plugins/runner/bad/1.0.0/reload")
    assert resp.status == 400
    plugins = {p["name"]: p for p in (await (await cli.get("/admin/plugins")).json())["plugins"]}
    assert plugins["bad"]["state"] == "failed"
    assert plugins["bad"]["last_error"]
    assert plugins["good"]["state"] == "ready"


@pytest.mark.parametrize("close", ["sync", "async"])
async def test_shutdown_closes_within_its_budget_whatever_plugins_do(
    plugins_dir: Path, settings: Settings, close: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 12, class "shutdown finishes within its bound whatever plugins do": a close() and
    a shutdown hook that never return; the app's cleanup still ends within close_timeout_s."""
    write_hanging(plugins_dir, close)
    write_add_runner(plugins_dir, "good", "1.0.0")
    app = create_app(Settings(**{**settings.model_dump(), "close_timeout_s": 0.5}))
    from aiohttp.test_utils import TestServer

    server = TestServer(app)
    await server.start_server()
    started = time.monotonic()
    # A logger of its own: the module's may be cached (cache_logger_on_first_use) by an
    # earlier test in this process, and a cached logger writes past capture_logs.
    monkeypatch.setattr(calls, "log", structlog.get_logger("plugserve.registry"))
    with structlog.testing.capture_logs() as events:
        await asyncio.wait_for(server.close(), 10)
    assert time.monotonic() - started < 3
    timeouts = {(e["plugin"], e["call"]) for e in events if e["event"] == "plugin_call_timeout"}
    assert timeouts == {
        ("preprocessor/stuck@1.0.0", "plugserve_shutdown"),
        ("preprocessor/stuck@1.0.0", "close"),
    }


SLOW_RUNNER = """
    import time
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Slow:
        def __init__(self, log):
            self.log = log

        def infer(self, inputs):
            with open(self.log, "a") as out:
                out.write(f"start {time.monotonic()}\\n")
            time.sleep(0.6)
            with open(self.log, "a") as out:
                out.write(f"end {time.monotonic()}\\n")
            return {"y": inputs["x"]}

        def close(self):
            with open(self.log, "a") as out:
                out.write(f"close {time.monotonic()}\\n")

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Slow(config["log"])
"""


async def test_a_cancelled_request_keeps_its_instance_busy_until_its_thread_returns(
    plugins_dir: Path, tmp_path: Path, client: Callable[..., object]
) -> None:
    """Review of issue 12: a request whose deadline passed (or whose client hung up) left the
    instance's count while its call still ran on a thread, so an unload closed the runner
    mid-inference and the next request ran beside the abandoned one."""
    log = tmp_path / "calls.log"
    write_plugin(plugins_dir, "runner", "slow", "1.0.0",
                 f'[config]\nlog = "{log}"\n[runner]\nmax_batch_size = 0\ninline_budget_us = 0\n',
                 {"plugin.py": SLOW_RUNNER})  # fmt: skip
    cli = await client(drain_timeout_s=5)  # type: ignore[operator]
    x = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    late = await cli.post("/v2/models/slow/infer", json=x, headers={"X-Request-Timeout": "0.1"})
    assert late.status == 504
    # The next request waits for the abandoned call to return instead of running beside it.
    assert (await cli.post("/v2/models/slow/infer", json=x)).status == 200
    late = await cli.post("/v2/models/slow/infer", json=x, headers={"X-Request-Timeout": "0.1"})
    assert late.status == 504
    # An unload drains the abandoned call before close() runs.
    assert (await cli.post("/admin/plugins/runner/slow/1.0.0/unload")).status == 200
    events = [line.split() for line in log.read_text().splitlines()]
    kinds = [kind for kind, _ in events]
    assert kinds == ["start", "end", "start", "end", "start", "end", "close"], kinds
