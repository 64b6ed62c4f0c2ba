"""Graceful shutdown: on SIGTERM or SIGINT, drain before stopping.

The drain: readiness turns false and new inference requests get 503 at once,
requests already running finish (up to ``drain_timeout_s``, logged when it runs
out), then aiohttp's own shutdown stops the listener and the registry closes
every plugin; the process exits 0. A second signal stops without waiting.
"""

from __future__ import annotations

import asyncio
import signal

import structlog
from aiohttp import web
from aiohttp.web_runner import GracefulExit

from registry.errors import Unavailable

log = structlog.get_logger("plugserve.server")


class Drain:
    """Counts inference requests in and out, and runs the shutdown drain."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

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

    def install(self) -> None:
        """Take SIGTERM and SIGINT over from aiohttp (which stops without draining)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.begin)

    def begin(self) -> None:
        if self.draining:
            log.warning("shutdown_forced", in_flight=self.active)
            asyncio.get_running_loop().call_soon(_stop)
            return
        self.draining = True
        log.info("draining", in_flight=self.active, timeout_s=self.timeout_s)
        self._task = asyncio.create_task(self._finish())

    async def _finish(self) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), self.timeout_s)
        except TimeoutError:
            log.warning("drain_timeout", in_flight=self.active, timeout_s=self.timeout_s)
        asyncio.get_running_loop().call_soon(_stop)


def _stop() -> None:
    # Raised from a loop callback it leaves run_app's loop, which then shuts down cleanly,
    # exactly as aiohttp's own signal handler does.
    raise GracefulExit()


async def install_signal_handlers(app: web.Application) -> None:
    from server.state import DRAIN

    app[DRAIN].install()
