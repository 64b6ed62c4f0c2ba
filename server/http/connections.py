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
for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import resource
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import orjson
import structlog
from aiohttp import web
from aiohttp.web_runner import GracefulExit
from multidict import CIMultiDictProxy

from plugserve.registry.errors import ConfigError
from plugserve.server.http.framing import (
    MAX_HEAD_BYTES,
    FastFront,
    FastRequest,
    Route,
    could_be_taken,
)
from plugserve.server.runtime.logs import REQUEST_CHAIN, REQUEST_ID

log = structlog.get_logger("plugserve.server")

SWEEP_INTERVAL_S = 1.0
REFUSAL_LINGER_S = 2.0
"""How long a refused connection may stay open to read its 503 before it is closed."""
MIN_REFUSING, MAX_REFUSING = 64, 1024
"""Bounds on refused connections lingering at once; past it a refused connection is reset."""
FD_HEADROOM = 256
"""Open files kept for everything else (plugins, models, logs, etcd) below the limit."""
DEFAULT_MAX_CONNECTIONS = 4096
IDLE_EVICTABLE_S = 1.0
"""At max_connections, a keep-alive connection idle this long may be closed for a new one."""
EVICTION_SCAN = 32
CANCEL_ON_HANGUP = web.RequestKey("cancel_on_hangup", bool)
KEEPALIVE_TIMEOUT_S = 75.0
"""An idle keep-alive connection is closed after this long (aiohttp's, as the server sets
it, and the fast path's)."""
PAUSE_BYTES = 1024 * 1024
"""Fast path: past this much received ahead of its answer, a connection stops reading."""


def _response(status: str, message: str, extra: str = "") -> bytes:
    return _reply(status, orjson.dumps({"error": message}), extra)


def _reply(status: str, body: bytes, extra: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


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
        self.refusal = _response(
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


class Connection(asyncio.Protocol):
    """One client connection: on the fast path while its requests are ones the fast path
    takes, else aiohttp's protocol (``inner``); with when its current request began."""

    __slots__ = (
        "buffer",
        "fast",
        "framed",
        "inner",
        "listener",
        "loop",
        "make",
        "paused",
        "remote",
        "request",
        "served",
        "since",
        "task",
        "transport",
        "unsent",
        "unsent_since",
        "waiting_since",
        "write_paused",
    )

    def __init__(
        self,
        listener: Listener,
        make: Callable[[], asyncio.Protocol],
        fast: FastFront | None = None,
    ) -> None:
        self.listener = listener
        self.make = make
        self.fast = fast
        self.inner: asyncio.Protocol | None = None if fast is not None else make()
        """aiohttp's protocol; ``None`` while the connection is on the fast path."""
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
        self.request: web.BaseRequest | None = None
        """The request being handled; ``since`` is when its headers were complete (or,
        between requests, when the last one ended)."""
        self.since = 0.0
        self.task: asyncio.Task[Any] | None = None
        self.served = 0
        self.unsent = 0
        """Answer bytes waiting to be sent, at the last sweep; since ``unsent_since``."""
        self.unsent_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.loop = asyncio.get_running_loop()
        self.waiting_since = time.monotonic()
        self.listener.open.add(self)
        if self.inner is not None:
            self.inner.connection_made(transport)
        else:
            peer = transport.get_extra_info("peername")
            self.remote = str(peer[0]) if isinstance(peer, tuple) and peer else None

    def data_received(self, data: bytes) -> None:
        if self.waiting_since is None and self.request is None and self.framed is None:
            self.waiting_since = time.monotonic()  # the first byte of the next request
            self.listener.idle.discard(self)
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
        self.listener.open.discard(self)
        self.listener.idle.discard(self)
        self.transport = None  # gone: the end of a request it was serving keeps it out of idle
        request, task = self.request, self.task
        if self.inner is None:
            if task is not None:
                task.cancel()  # a fast-path request: its client hung up
            return
        if request is not None and task is not None and request.get(CANCEL_ON_HANGUP):
            task.cancel()
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

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- the fast path -------------------------------------------------------------------

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
                self.listener.idle.add(self)
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
        if transport is None or self.listener.closing:
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
            transport.write(_response("408 Request Timeout", message))
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


STARTING_HEAD_BYTES = 16 * 1024
"""What a connection accepted while the server starts may send before it is answered."""
LIVE = _reply("200 OK", orjson.dumps({"live": True}))
STARTING = _response(
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
