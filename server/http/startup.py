"""Serving the app on its sockets: bound before they listen, the open-files limit raised and
the connection caps made from it, and ``web.run_app`` rewritten so that each socket's
connections are behind its :class:`~plugserve.server.http.connections.Listener`, and are
answered while the app starts (:class:`Starting`).
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
import socket
from collections.abc import Callable
from typing import Any, cast

import orjson
from aiohttp import web
from aiohttp.web_runner import GracefulExit

from plugserve.registry.errors import ConfigError
from plugserve.server.http.connections import (
    MAX_REFUSING,
    MIN_REFUSING,
    ConnectionLimits,
    Listener,
    Refusal,
)
from plugserve.server.transport.h1framing import raw_answer, raw_error

FD_HEADROOM = 256
"""Open files kept for everything else (plugins, models, logs, etcd) below the limit."""
DEFAULT_MAX_CONNECTIONS = 4096

STARTING_HEAD_BYTES = 16 * 1024
"""What a connection accepted while the server starts may send before it is answered."""
LIVE = raw_answer("200 OK", orjson.dumps({"live": True}))
STARTING = raw_error(
    "503 Service Unavailable",
    "the server is starting: plugins are still loading",
    "Retry-After: 1\r\n",
)


class Starting(asyncio.Protocol):
    """A connection accepted while the app starts (its plugins loading): ``/v2/health/live``
    answers 200, anything else 503 with ``Retry-After``; then closed, as it is when its
    request's headers do not arrive within ``header_timeout_s``."""

    def __init__(self, limits: ConnectionLimits, open_now: set[Starting]) -> None:
        self.limits = limits
        self.open_now = open_now
        self.head: bytes | None = b""
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)
        self.open_now.add(self)
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.limits.header_timeout_s, transport.abort)

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or self.head is None:
            return  # answered: what else it sends is read, unused
        self.head += data
        if b"\r\n\r\n" not in self.head and len(self.head) < STARTING_HEAD_BYTES:
            return
        method, _, rest = self.head.split(b"\r\n", 1)[0].partition(b" ")
        self.head = None
        answer = LIVE if rest.split(b" ")[0].split(b"?")[0] == b"/v2/health/live" else STARTING
        transport.write(answer.split(b"\r\n\r\n")[0] + b"\r\n\r\n" if method == b"HEAD" else answer)
        if transport.can_write_eof():
            transport.write_eof()

    def eof_received(self) -> bool:
        return False  # the client is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        self.open_now.discard(self)
        if self.timer is not None:
            self.timer.cancel()


def raise_open_files_limit() -> int:
    """Raise the soft limit on open files to the hard one; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections(open_files: int) -> int:
    """The open-files limit less headroom, at most ``DEFAULT_MAX_CONNECTIONS``."""
    return max(16, min(DEFAULT_MAX_CONNECTIONS, open_files - FD_HEADROOM))


def refusing_budget(open_files: int, max_connections: int) -> int:
    """How many refused connections may read their 503 at once: the open files left."""
    spare = open_files - max_connections - FD_HEADROOM // 2
    return max(MIN_REFUSING, min(MAX_REFUSING, spare))


def bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to ``host:port``, not listening yet."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except (OSError, ValueError) as exc:
        sock.close()
        reason = exc.strerror if isinstance(exc, OSError) else exc
        raise ConfigError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


def run_app(
    app: web.Application,
    sockets: list[Any],
    listeners: list[Listener],
    loop: asyncio.AbstractEventLoop,
    **kwargs: Any,
) -> None:
    """Serve ``app`` on ``sockets`` until a signal stops it, as ``web.run_app`` does."""
    main = loop.create_task(serve_app(app, sockets, listeners, **kwargs))
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main)
    except (GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main.done():
                main.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    loop.run_until_complete(main)
        finally:
            rest = asyncio.all_tasks(loop)
            for task in rest:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()


async def serve_app(
    app: web.Application,
    sockets: list[Any],
    listeners: list[Listener],
    accept_while_starting: bool = True,
    listening: asyncio.Event | None = None,
    **kwargs: Any,
) -> None:
    """What ``web.run_app`` does, with each socket's connections behind its listener.

    The sockets answer from the start: while the app starts (the first load of
    every plugin), :class:`Starting` answers each connection. Without
    ``accept_while_starting`` (a worker among several) they are not accepted
    before the app has started; ``listening`` is set once they listen. ``kwargs`` go to aiohttp's
    :class:`~aiohttp.web.AppRunner` (and its protocol).
    """
    runner = web.AppRunner(app, **kwargs)
    servers: list[asyncio.AbstractServer] = []
    try:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            # While the app starts (the first load), a signal stops at once, exit 0; the
            # drain takes the signals over when the app has started (server/runtime/shutdown.py).
            loop.add_signal_handler(sig, _raise_graceful_exit)
        if not accept_while_starting:
            await runner.setup()
        for sock, listener in zip(sockets, listeners, strict=True):
            factory = _starting_or_serving(runner, listener)
            servers.append(await loop.create_server(factory, sock=sock, backlog=1024))
            listener.start()
        if listening is not None:
            listening.set()
        if accept_while_starting:
            await runner.setup()
        await asyncio.Event().wait()  # until cancelled (a signal's GracefulExit)
    finally:
        for server in servers:
            server.close()
        for listener in listeners:
            await listener.stop()
            listener.close_fast()
        await runner.cleanup()


def _raise_graceful_exit() -> None:
    raise GracefulExit()


def _starting_or_serving(
    runner: web.AppRunner, listener: Listener
) -> Callable[[], asyncio.Protocol]:
    """A protocol factory: :class:`Starting` until the app has started (within the
    listener's ``max_connections``, refused past it), then the listener's."""
    serving = listener.factory(lambda: _handler(runner))
    starting: set[Starting] = set()

    def protocol() -> asyncio.Protocol:
        if runner.server is not None:
            return serving()
        if len(starting) < listener.limits.max_connections:
            return Starting(listener.limits, starting)
        listener.refused += 1
        return Refusal(listener, reset=len(listener.refusing) >= listener.limits.max_refusing)

    return protocol


def _handler(runner: web.AppRunner) -> asyncio.Protocol:
    assert runner.server is not None
    return runner.server()
