"""An HTTP/1.1 connection on the fast path: bytes in, framed requests out to its
:class:`FastFront`, answers written back; anything the front does not take, from its first
byte on, handed over to another protocol that keeps the connection from then on.

The connection frames each request itself: the head up to its blank line
(:mod:`~plugserve.server.transport.h1framing` says which heads are taken), then exactly
``Content-Length`` bytes. Its front serves each request as the request's own task, one at
a time; a client sending ahead of its answers is paused past ``PAUSE_BYTES``, and no next
request is framed while the transport asks for no more writes. A subclass says what the
connection's owner keeps of it (:meth:`H1Connection.resting`,
:meth:`H1Connection.stopping`).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import structlog
from multidict import CIMultiDictProxy

from plugserve.server.runtime.logs import REQUEST_CHAIN, REQUEST_ID
from plugserve.server.transport.h1framing import (
    MAX_HEAD_BYTES,
    FastRequest,
    Route,
    Taken,
    could_be_taken,
)

log = structlog.get_logger("plugserve.server")

PAUSE_BYTES = 1024 * 1024
"""Fast path: past this much received ahead of its answer, a connection stops reading."""


class FastFront(Protocol):
    """What a connection needs of the fast path that serves its requests
    (:class:`~plugserve.server.http.fastpath.FastPath`)."""

    keepalive_timeout_s: float

    def take(self, head: bytes) -> Taken | None: ...

    async def serve(self, route: Route, request: FastRequest) -> tuple[bytes, bool] | None: ...


@dataclass(slots=True)
class Framed:
    """A fast-path request whose head is in: where it goes and how long its body is."""

    route: Route
    path: str
    segment: str
    headers: CIMultiDictProxy[str]
    length: int
    head: bytes
    """The head as it came, up to its blank line (put back if the request is declined)."""


class H1Connection(asyncio.Protocol):
    """One client connection: on the fast path while its requests are ones the fast path
    takes, else the protocol ``make()`` gives (``inner``), which it hands every event."""

    __slots__ = (
        "buffer",
        "fast",
        "framed",
        "inner",
        "loop",
        "make",
        "paused",
        "remote",
        "served",
        "since",
        "task",
        "transport",
        "waiting_since",
        "write_paused",
    )

    def __init__(self, make: Callable[[], asyncio.Protocol], fast: FastFront | None) -> None:
        self.make = make
        self.fast = fast
        self.inner: asyncio.Protocol | None = None if fast is not None else make()
        """The protocol the connection is handed over to (aiohttp's, in the server); ``None``
        while the connection is on the fast path."""
        self.buffer = bytearray()
        """Fast path: bytes received and not yet framed into a request."""
        self.framed: Framed | None = None
        """Fast path: the request whose head is in, until it is answered."""
        self.paused = False
        self.write_paused = False
        """Fast path: the transport asked for no more writes until its buffer drains."""
        self.remote: str | None = None
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.waiting_since: float | None = None
        """Since when the next request's headers are awaited (``None``: idle keep-alive)."""
        self.since = 0.0
        """When the current request's headers were complete (or, between requests, when
        the last one ended)."""
        self.task: asyncio.Task[Any] | None = None
        self.served = 0

    def resting(self) -> None:
        """Told when an answer is written and no byte of the next request has come."""
        raise NotImplementedError

    def stopping(self) -> bool:
        """Whether the server stops: then the connection closes instead of a hand-over."""
        raise NotImplementedError

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.loop = asyncio.get_running_loop()
        self.waiting_since = time.monotonic()
        if self.inner is not None:
            self.inner.connection_made(transport)
        else:
            peer = transport.get_extra_info("peername")
            self.remote = str(peer[0]) if isinstance(peer, tuple) and peer else None

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)
            return
        self.buffer += data
        if self.task is None and not self.write_paused:
            self._frame()
        elif len(self.buffer) > PAUSE_BYTES and not self.paused and self.transport is not None:
            self.paused = True  # a client sending ahead of its answers: wait for them
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None  # gone: the end of a request it was serving keeps it out of idle
        if self.inner is None:
            if self.task is not None:
                self.task.cancel()  # a fast-path request: its client hung up
            return
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()
        else:  # no next request is framed until the client has taken its answers
            self.write_paused = True

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()
            return
        self.write_paused = False
        if self.task is None and self.buffer and self.transport is not None:
            self._frame()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _frame(self) -> None:
        """Take the next request from the buffer: served on the fast path once whole, or
        the connection handed to aiohttp when it is not one the fast path takes."""
        fast, buffer = self.fast, self.buffer
        assert fast is not None
        framed = self.framed
        if framed is None:
            end = buffer.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES or not could_be_taken(buffer):
                    self._hand_over()
                else:
                    self._read_on()
                return
            head = bytes(buffer[: end + 4])
            taken = fast.take(head[:end])
            if taken is None:
                self._hand_over()
                return
            if len(buffer) < end + 4 + taken[4] and not taken[0].known(taken[2]):
                self._hand_over()  # aiohttp answers 404 now, not once the body is in
                return
            del buffer[: end + 4]
            self.framed = framed = Framed(*taken, head)
            self.since = time.monotonic()
            self.waiting_since = None
        length = framed.length
        if len(buffer) < length:
            self._read_on()
            return  # the body is on its way (body_timeout_s bounds it)
        if len(buffer) == length:  # nothing of a next request behind it: one copy
            body = bytes(buffer)
            buffer.clear()
        else:
            with memoryview(buffer) as view:
                body = bytes(view[:length])
            del buffer[:length]
        if len(buffer) < PAUSE_BYTES:
            self._read_on()
        request = FastRequest(framed.path, framed.segment, framed.headers, body, self.remote)
        assert self.loop is not None
        self.task = self.loop.create_task(self._serve(framed, request))

    async def _serve(self, framed: Framed, request: FastRequest) -> None:
        assert self.fast is not None
        try:
            answer = await self.fast.serve(framed.route, request)
        except Exception:  # the fast path's own fault: the connection cannot go on
            log.exception("fast_path_failed", path=request.path)
            self.close()
            return
        transport = self.transport
        if transport is None:
            return  # the client hung up
        if answer is None:  # the handler declined it: aiohttp's, from its first byte on
            self.buffer[:0] = framed.head + request.body
            self.framed = None
            self._hand_over()
            return
        response, closes = answer
        self.framed = None
        self.task = None
        self.served += 1
        try:
            transport.write(response)  # may pause writing: the next request then waits
            if closes:
                transport.close()
                return
            self.since = time.monotonic()
            if self.buffer:
                self.waiting_since = self.since  # the next request came meanwhile
                if not self.write_paused:
                    self._frame()
            else:
                self.resting()
        except Exception:
            log.exception("fast_path_failed", path=request.path)
            self.close()

    def _read_on(self) -> None:
        """Read from the client again, if a full buffer had paused it: only once what it
        sent ahead is below ``PAUSE_BYTES`` (or the next request needs more of it)."""
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def _hand_over(self) -> None:
        """aiohttp's protocol takes the connection from here on, with what came of it.
        Its request task starts without the fast-path request's id and chain (which its
        log lines would otherwise carry). Once the server stops, nothing is
        handed over: the connection closes."""
        transport = self.transport
        if transport is None or self.stopping():
            self.close()
            return
        inner = self.inner = self.make()
        framed = self.framed  # a head taken, its body still coming: aiohttp's from the head
        data = bytes(self.buffer) if framed is None else framed.head + self.buffer
        self.buffer.clear()
        self.framed = None
        self.task = None
        self.waiting_since = self.waiting_since or time.monotonic()
        if self.paused:
            self.paused = False
            transport.resume_reading()
        contextvars.copy_context().run(self._start_inner, inner, transport, data)

    def _start_inner(
        self, inner: asyncio.Protocol, transport: asyncio.Transport, data: bytes
    ) -> None:
        REQUEST_ID.set(None)  # a fast-path request's, when handed over from its task
        REQUEST_CHAIN.set(None)
        inner.connection_made(transport)
        if self.write_paused:
            inner.pause_writing()
        if data:
            inner.data_received(data)
