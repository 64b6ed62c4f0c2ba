"""Bounded calls into plugin code: sync on a thread, async as a task, never waited for past the bound."""

import asyncio
import threading
import time

import pytest

from plugserve.registry.plugins.calls import call_plugin
from plugserve.registry.errors import PluginCallTimeout


async def test_results_and_errors_come_back_from_sync_and_async_calls() -> None:
    async def answer() -> int:
        return 42

    def fails() -> None:
        raise ValueError("bad")

    assert await call_plugin(lambda: 41, 5, "p", "create", "load_timeout_s") == 41
    assert await call_plugin(answer, 5, "p", "warmup", "load_timeout_s") == 42
    assert await call_plugin(lambda: answer(), 5, "p", "warmup", "load_timeout_s") == 42
    with pytest.raises(ValueError, match="bad"):
        await call_plugin(fails, 5, "p", "close", "close_timeout_s")


async def test_a_sync_call_that_never_returns_is_abandoned_at_its_bound() -> None:
    """issue 12, finding 4: a hung sync call is not waited for past its bound; its thread
    is a daemon, so it cannot keep the process up either."""
    release = threading.Event()
    seen: list[threading.Thread] = []

    def hang() -> None:
        seen.append(threading.current_thread())
        release.wait()

    started = time.monotonic()
    with pytest.raises(PluginCallTimeout, match=r"p: close\(\) did not return within 0.3 s"):
        await call_plugin(hang, 0.3, "p", "close", "close_timeout_s")
    assert time.monotonic() - started < 2
    assert seen and seen[0].daemon and seen[0] is not threading.main_thread()
    release.set()


@pytest.mark.parametrize("swallows_cancel", [False, True])
async def test_an_async_call_that_never_returns_is_abandoned_at_its_bound(
    swallows_cancel: bool,
) -> None:
    """issue 12, finding 4: an async close() that never returns, even one that ignores
    cancellation, is not waited for past its bound."""
    stop = asyncio.Event()

    async def hang() -> None:
        while not stop.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                if not swallows_cancel:
                    raise

    started = time.monotonic()
    with pytest.raises(PluginCallTimeout):
        await call_plugin(hang, 0.3, "p", "close", "close_timeout_s")
    assert time.monotonic() - started < 2
    stop.set()
    await asyncio.sleep(0.1)


@pytest.mark.parametrize("where", ["sync", "async"])
async def test_system_exit_from_plugin_code_cannot_stop_the_server(where: str) -> None:
    """issue 12, class "any exception while loading becomes a failed load": even SystemExit."""

    def sync_exit() -> None:
        raise SystemExit(3)

    async def async_exit() -> None:
        raise SystemExit(3)

    with pytest.raises(RuntimeError, match="SystemExit"):
        await call_plugin(sync_exit if where == "sync" else async_exit, 5, "p", "close", "x")
