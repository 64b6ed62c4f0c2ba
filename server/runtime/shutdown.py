"""Graceful shutdown: on SIGTERM or SIGINT, drain before stopping, all of it bounded.

The drain: readiness turns false and new inference requests get 503 at once,
requests already running finish (up to ``drain_timeout_s``, logged when it runs
out), then aiohttp's own shutdown stops the listener and the plugins are closed
within what is left of ``drain_timeout_s`` (at most ``close_timeout_s``, at
least ``CLOSE_FLOOR_S``); the process exits 0. A second signal stops without
waiting. Whatever plugins do, the process is gone ``SHUTDOWN_MARGIN_S`` after
the drain's bound: a watchdog thread ends it then (exit code 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable

import structlog
from aiohttp.web_runner import GracefulExit

from plugserve.registry.errors import Unavailable
from plugserve.server.runtime.stdio import flush_std_streams

log = structlog.get_logger("plugserve.server")

CLOSE_FLOOR_S = 1.0
"""The least time plugin closes get at shutdown, even when requests used the whole drain."""
STREAM_GOODBYE_S = 0.5
"""How long streams ended at the drain's bound get to send their last event."""
SHUTDOWN_MARGIN_S = 5.0
"""After the first signal the process is gone within ``drain_timeout_s`` plus this."""


class Drain:
    """Counts inference requests in and out, and runs the shutdown drain."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.active = 0
        self.deadline: float | None = None
        """``time.monotonic()`` when the drain's bound runs out, once it has begun."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.at_timeout: Callable[[], int] | None = None
        """Called when the drain runs out with requests in flight: it ends what can still be
        told (open streams get a last 503 event); a moment is left for them to be sent."""
        self.before_stop: Callable[[], Awaitable[None]] | None = None
        """Awaited once drained, within the drain's bound: a worker among several waits
        there until every worker has drained, so they stop listening together."""

    def enter(self) -> None:
        """Count a request in; refuse it with 503 once the drain has begun."""
        if self.draining:
            raise Unavailable("the server is shutting down")
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def idle(self) -> None:
        """Once no request is in flight."""
        await self._idle.wait()

    def install(self) -> None:
        """Take SIGTERM and SIGINT over from aiohttp (which stops without draining)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.begin)

    def begin(self) -> None:
        # Act first, log after: nothing a log line does may keep the server from stopping.
        if self.draining:
            self._stop_once()
            log.warning("shutdown_forced", in_flight=self.active)
            return
        self.draining = True
        self.deadline = time.monotonic() + self.timeout_s
        self._task = asyncio.create_task(self._finish())
        _watchdog(self.timeout_s + SHUTDOWN_MARGIN_S)
        log.info("draining", in_flight=self.active, timeout_s=self.timeout_s)

    def closing_budget(self, close_timeout_s: float) -> float:
        """Seconds the shutdown hooks and plugin closes may take now.

        ``close_timeout_s``; after a signal, no more than the drain's bound
        leaves, but at least ``CLOSE_FLOOR_S``.
        """
        if self.deadline is None:
            return close_timeout_s
        return min(close_timeout_s, max(CLOSE_FLOOR_S, self.deadline - time.monotonic()))

    async def _finish(self) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), self.timeout_s)
        except TimeoutError:
            log.warning("drain_timeout", in_flight=self.active, timeout_s=self.timeout_s)
            if self.at_timeout is not None and self.at_timeout():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), STREAM_GOODBYE_S)
        if self.before_stop is not None and self.deadline is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.before_stop(), self.deadline - time.monotonic())
        self._stop_once()

    def _stop_once(self) -> None:
        # Once only: a second GracefulExit, raised while aiohttp is already shutting
        # down, would cut that shutdown short (the plugins never closed, exit code 1).
        if not self._stopping:
            self._stopping = True
            asyncio.get_running_loop().call_soon(_stop)


def _stop() -> None:
    # Raised from a loop callback it leaves run_app's loop, which then shuts down cleanly,
    # exactly as aiohttp's own signal handler does.
    raise GracefulExit()


def _watchdog(after_s: float) -> None:
    """End the process ``after_s`` seconds from now if it is still there.

    The last resort for what no bound can reach: a plugin blocking the event
    loop, or a coroutine that refuses to be cancelled.
    """

    def expire() -> None:
        time.sleep(after_s)
        log.error("shutdown_overdue", seconds=after_s)
        flush_std_streams()
        os._exit(1)

    threading.Thread(target=expire, name="plugserve-shutdown-watchdog", daemon=True).start()


async def within(step: Awaitable[object], seconds: float, name: str) -> None:
    """Await one shutdown step for at most ``seconds``; past that, or if it fails, log and go on."""
    task = asyncio.ensure_future(step)
    done, _ = await asyncio.wait({task}, timeout=max(seconds, 0.0))
    if not done:
        task.cancel()
        log.error("shutdown_step_timeout", step=name, timeout_s=round(seconds, 2))
    elif not task.cancelled() and task.exception() is not None:
        log.error("shutdown_step_failed", step=name, exc_info=task.exception())
