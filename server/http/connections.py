"""Client connections: header and body read timeouts, a cap with a clear refusal, hang-ups.

Every accepted connection is a :class:`Connection` in front of aiohttp's own
protocol, which notes when the request it waits for began. A sweep once a second
closes, with a 408, a connection whose request headers are not complete
``header_timeout_s`` after it opened or after that request's first byte, and one
whose body has not fully arrived ``body_timeout_s`` after its headers. An idle
keep-alive connection (no byte of a next request) is aiohttp's: it closes after
its keep-alive timeout, or at once to make room for a new connection when
``max_connections`` are open. Past ``max_connections`` open connections on a
listener with none idle, a new one is answered 503 at once and closed. An
inference request is cancelled when its client hangs up
(:func:`cancel_on_hangup`), so it leaves its runner's queue instead of running
for nobody. On the fast path a connection reads HTTP/1.1 itself
(:class:`~plugserve.server.transport.h1connection.H1Connection`, which a
:class:`Connection` extends with what its listener keeps of it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import structlog
from aiohttp import web

from plugserve.server.transport.h1connection import FastFront, H1Connection
from plugserve.server.transport.h1framing import raw_error

log = structlog.get_logger("plugserve.server")

SWEEP_INTERVAL_S = 1.0
REFUSAL_LINGER_S = 2.0
"""How long a refused connection may stay open to read its 503 before it is closed."""
MIN_REFUSING, MAX_REFUSING = 64, 1024
"""Bounds on refused connections lingering at once; past it a refused connection is reset."""
IDLE_EVICTABLE_S = 1.0
"""At max_connections, a keep-alive connection idle this long may be closed for a new one."""
EVICTION_SCAN = 32
CANCEL_ON_HANGUP = web.RequestKey("cancel_on_hangup", bool)
KEEPALIVE_TIMEOUT_S = 75.0
"""An idle keep-alive connection is closed after this long (aiohttp's, as the server sets
it, and the fast path's)."""


@dataclass(frozen=True)
class ConnectionLimits:
    """The settings a listener's connections live by."""

    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    max_refusing: int = MIN_REFUSING
    """Refused connections reading their 503 at once; past it, refused ones are reset."""


class Swept:
    """What a sweep once every ``SWEEP_INTERVAL_S`` needs: :meth:`start` it on the running
    loop, :meth:`stop` it; a subclass says what one round does (:meth:`sweep`)."""

    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._sweep_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> None:
        raise NotImplementedError


class Listener(Swept):
    """The connections of one listening socket: counted, capped, swept."""

    def __init__(self, name: str, limits: ConnectionLimits) -> None:
        self.name = name
        self.limits = limits
        self.fast: FastFront | None = None
        """The app's fast path, where this listener's connections start."""
        self.closing = False
        """The server stops: connections on the fast path close, none is handed over."""
        self.open: set[Connection] = set()
        self.idle: set[Connection] = set()
        """Keep-alive connections between requests, no byte of the next one received."""
        self.refusing: set[Refusal] = set()
        self.refused = 0
        self.evicted = 0
        self.timed_out = {"headers": 0, "body": 0, "send": 0}
        self._reported = (0, 0, 0, 0)
        self.refusal = raw_error(
            "503 Service Unavailable",
            f"the server has {limits.max_connections} open connections, its limit "
            "(max_connections); try again shortly",
            "Retry-After: 1\r\n",
        )

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for ``loop.create_server``, around aiohttp's ``make``; with
        :attr:`fast`, each connection starts on the fast path (``server/http/fastpath.py``)."""

        def protocol() -> asyncio.Protocol:
            if len(self.open) < self.limits.max_connections or self._evict_idle():
                return Connection(self, make, self.fast)
            self.refused += 1
            return Refusal(self, reset=len(self.refusing) >= self.limits.max_refusing)

        return protocol

    def close_fast(self) -> None:
        """Close the connections still on the fast path, as the server stops (its drain has
        waited for their requests): aiohttp's cleanup closes only its own."""
        self.closing = True
        for conn in list(self.open):
            if conn.inner is None:
                conn.close()

    def _evict_idle(self) -> bool:
        """Close a keep-alive connection idle for a second or more, its answer all sent,
        to make room; ``False`` if there is none."""
        now = time.monotonic()
        for conn in itertools.islice(self.idle, EVICTION_SCAN):
            transport = conn.transport
            if transport is None or transport.is_closing():
                continue
            if now - conn.since >= IDLE_EVICTABLE_S and not transport.get_write_buffer_size():
                self.idle.discard(conn)
                transport.close()
                self.evicted += 1
                return True
        return False

    def sweep(self, now: float) -> None:
        """Close the connections past a timeout and the refused ones past their linger."""
        limits = self.limits
        for conn in list(self.open):
            phase = conn.overdue(now, limits)
            if phase == "idle":  # a fast-path keep-alive past its timeout, as aiohttp's
                conn.close()
            elif phase is not None:
                self.timed_out[phase] += 1
                conn.time_out()
        for refusal in list(self.refusing):
            if now - refusal.since > REFUSAL_LINGER_S:
                refusal.close()
        self._report()

    def _report(self) -> None:
        """One log line per sweep that saw refusals or timeouts, never one per connection."""
        timed_out = self.timed_out
        current = (self.refused, timed_out["headers"], timed_out["body"], timed_out["send"])
        refused, headers, body, send = (c - r for c, r in zip(current, self._reported, strict=True))
        self._reported = current
        if refused:
            log.warning(
                "connections_refused",
                listener=self.name,
                refused=refused,
                open=len(self.open),
                max_connections=self.limits.max_connections,
            )
        if headers or body or send:
            log.info(
                "connections_timed_out", listener=self.name, headers=headers, body=body, send=send
            )


class Connection(H1Connection):
    """One client connection: on the fast path while its requests are ones the fast path
    takes, else aiohttp's protocol (``inner``); with when its current request began."""

    __slots__ = ("listener", "request", "unsent", "unsent_since")

    def __init__(
        self,
        listener: Listener,
        make: Callable[[], asyncio.Protocol],
        fast: FastFront | None = None,
    ) -> None:
        self.listener = listener
        super().__init__(make, fast)
        self.request: web.BaseRequest | None = None
        """The request being handled; ``since`` is when its headers were complete (or,
        between requests, when the last one ended)."""
        self.unsent = 0
        """Answer bytes waiting to be sent, at the last sweep; since ``unsent_since``."""
        self.unsent_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.listener.open.add(self)
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.waiting_since is None and self.request is None and self.framed is None:
            self.waiting_since = time.monotonic()  # the first byte of the next request
            self.listener.idle.discard(self)
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.listener.open.discard(self)
        self.listener.idle.discard(self)
        request, task = self.request, self.task
        if (
            self.inner is not None
            and request is not None
            and task is not None
            and request.get(CANCEL_ON_HANGUP)
        ):
            task.cancel()  # an aiohttp request that asked for it (:func:`cancel_on_hangup`)
        super().connection_lost(exc)

    def resting(self) -> None:
        self.listener.idle.add(self)

    def stopping(self) -> bool:
        return self.listener.closing

    def begin(self, request: web.BaseRequest) -> None:
        self.request = request
        self.task = asyncio.current_task()
        self.since = time.monotonic()
        self.waiting_since = None
        self.listener.idle.discard(self)

    def end(self) -> None:
        self.request = self.task = None
        self.served += 1
        if self.waiting_since is None and self.transport is not None:
            self.since = time.monotonic()  # idle since
            self.listener.idle.add(self)

    def overdue(self, now: float, limits: ConnectionLimits) -> str | None:
        """``"headers"`` or ``"body"`` when that part has taken too long, ``"send"`` when
        the client has read nothing of its answer for ``body_timeout_s``, ``"idle"`` for a
        fast-path keep-alive connection idle past its timeout, else ``None``."""
        if self._stalled_send(now, limits.body_timeout_s):
            return "send"
        request = self.request
        if self.inner is None:  # the fast path: it frames requests itself
            if self.framed is not None:
                late = self.task is None and now - self.since > limits.body_timeout_s
                return "body" if late else None
            if self.waiting_since is None:
                assert self.fast is not None
                return "idle" if now - self.since > self.fast.keepalive_timeout_s else None
        if request is None:
            since = self.waiting_since
            late = since is not None and now - since > limits.header_timeout_s
            return "headers" if late else None
        if now - self.since > limits.body_timeout_s and not request.content.is_eof():
            return "body"
        return None

    def _stalled_send(self, now: float, limit: float) -> bool:
        """Whether answer bytes have waited, none taken by the client, for ``limit`` s."""
        transport = self.transport
        pending = transport.get_write_buffer_size() if transport is not None else 0
        if not pending or pending < self.unsent:
            self.unsent, self.unsent_since = pending, now  # nothing waits, or it moves
            return False
        self.unsent = pending
        return now - self.unsent_since > limit

    def time_out(self) -> None:
        """Answer 408 where no response has begun on this connection yet, and close."""
        transport = self.transport
        if transport is None:
            return
        if self.unsent:  # a client that does not read (closing or not): drop what waits
            transport.abort()
            return
        if transport.is_closing():
            return
        request = self.request
        body = f"body within body_timeout_s = {self.listener.limits.body_timeout_s:g} s"
        if self.inner is None and self.framed is not None:
            fresh, phase = True, body  # a fast-path answer is written whole, at its end
        elif request is None:
            fresh = self.served == 0
            phase = f"headers within header_timeout_s = {self.listener.limits.header_timeout_s:g} s"
        else:
            fresh, phase = request.writer.output_size == 0, body
        if fresh:
            message = f"the request's {phase} did not arrive"
            transport.write(raw_error("408 Request Timeout", message))
        transport.close()


class Refusal(asyncio.Protocol):
    """A connection over the cap: a 503 at once, then closed (reset when too many linger)."""

    def __init__(self, listener: Listener, reset: bool) -> None:
        self.listener = listener
        self.reset = reset
        self.since = time.monotonic()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)
        if self.reset:
            transport.abort()
            return
        self.listener.refusing.add(self)
        transport.write(self.listener.refusal)
        if transport.can_write_eof():
            transport.write_eof()  # the client still may send; what it sends is read, unused

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the client is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        self.listener.refusing.discard(self)

    def close(self) -> None:
        transport = self.transport
        if transport is None:
            return
        if transport.get_write_buffer_size():  # the 503 still unread: do not wait for it
            transport.abort()
        else:
            transport.close()


def begin_request(request: web.BaseRequest) -> Connection | None:
    """Tell the request's connection that a request is being handled (its headers are
    complete); the caller calls :meth:`Connection.end` when it is answered. ``None`` for
    a connection that is not behind a listener (an in-process test server)."""
    transport = request.transport
    conn = transport.get_protocol() if transport is not None else None
    if not isinstance(conn, Connection):
        return None
    conn.begin(request)
    return conn


def cancel_on_hangup(request: web.BaseRequest) -> None:
    """Cancel this request's handler if its client disconnects before it is answered."""
    request[CANCEL_ON_HANGUP] = True
