"""The native gRPC engine (``grpc_engine = "native"``, the default): HTTP/2 on the event loop's
own thread.

grpc.aio runs each call through gRPC's C core, its poller thread and several
Cython coroutines: about 200 µs of CPU a call here before any of plugserve's
code (docs/performance.md). This server reads the HTTP/2 frames of its
connections itself (an :class:`asyncio.Protocol`, as the HTTP fast path does) and
calls the same servicer methods (``service.py``) with each call's :class:`Stream` as the
context (it offers what they use of grpc.aio's), under the same call admission
(:class:`plugserve.server.grpc_api.admission.Admission`): a unary call runs as one
task once its message is in, and its answer leaves in one write.

What it keeps of the protocol (RFC 9113, gRPC over HTTP/2): the preface and
settings within ``header_timeout_s``; flow control both ways (a stream's window
is given back as its messages are taken, so a client that floods a stream waits);
``grpc-timeout`` as the call's deadline; gzip and deflate request messages; HPACK
with its dynamic table (the ``hpack`` package; a header block seen before under the
same table is looked up, not decoded again); ``PING``, ``GOAWAY`` and
``RST_STREAM`` both ways; ``GOAWAY`` to a connection with no call for
``grpc_idle_timeout_s``. A malformed request (``heads.py``) resets its own stream.

What a client can make it do is bounded by what it sends, not by the connection's
state: a window change is one assignment and wakes only the answers it unblocks; frames
that ask work but carry no call, and resets the server sends for a client's frames, count
against one flood bound (``FLOOD_PER_S``); messages are read off the event loop when large
or compressed, within the process's byte budget (``server/http/budget.py``). Floods and
frames that break the protocol end the connection with ``GOAWAY``
(docs/security.md, "The protocol layers under attack").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
import socket
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
import hpack
import structlog

from plugserve.server.grpc_api import heads, wire
from plugserve.server.grpc_api.admission import CURRENT_CALL, Admission, TrackedCall
from plugserve.server.grpc_api.calls import MAX_DETAILS
from plugserve.server.grpc_api.handlers import Method, Reader, Undecodable, Unparsed, parsed
from plugserve.server.grpc_api.heads import Head
from plugserve.server.grpc_api.wire import END_HEADERS, END_STREAM, Error, Frame, Setting
from plugserve.server.http.connections import bind

log = structlog.get_logger("plugserve.grpc")

STREAM_WINDOW = 1 << 20
"""Each stream's receive window (``INITIAL_WINDOW_SIZE``)."""
CONNECTION_WINDOW = 16 << 20
"""The connection's receive window, at least: a message of ``max_body_bytes`` fits it."""
MAX_STREAMS = 4096
"""``MAX_CONCURRENT_STREAMS``; admission refuses calls past ``max_connections`` first."""
MAX_HEADER_LIST = 16 << 10
"""``MAX_HEADER_LIST_SIZE``, as gRPC's core: larger metadata is refused."""
HPACK_BOMB_BYTES = 4 * MAX_HEADER_LIST
"""A header block that decodes to more than this ends its connection ``ENHANCE_YOUR_CALM`` (an
HPACK bomb: its decoding stops there, so the connection's table is lost); one over
``MAX_HEADER_LIST`` and within this refuses its call alone."""
BLOCKS_KEPT = 64
BLOCK_KEPT_BYTES = 1024
"""Header blocks remembered per connection, and the largest remembered."""
FLOOD_PER_S = 1000
"""Frames that ask work but carry no call (pings, settings, stream resets, priorities,
empty DATA, frames of unknown types), resets the server sends for a client's frames, and
answers woken for a window the client took back, a connection may cause in a second before
it is ended with ``ENHANCE_YOUR_CALM`` (a reset flood is the "rapid reset" attack; resets
the client makes the server send, "MadeYouReset"). A refused header block counts once per
``REFUSED_HEAD_BYTES`` of its header list besides: decoding it was the work."""
REFUSED_HEAD_BYTES = 512
"""Header-list bytes (RFC 9113 §6.5.2's count, 32 a field) a refused block weighs as one
more frame of the flood count: about sixteen decoded fields."""
CLOSED_KEPT = 1024
"""Closed streams whose way of closing is remembered, to answer their late frames."""
CLIENT_ENDED, CLIENT_RESET, SERVER_ENDED = 1, 2, 3
"""How a stream closed: the client sent all of it, the client reset it, the server ended it."""
SLICE_S = 0.005
"""How long one connection's frames may hold the event loop before others' turn."""
LINGER_S = 2.0
"""How long a connection ended for an error reads (and drops) what its client still sends."""
CLOSE_WAIT_S = 10.0
"""How long a closing connection's last bytes may wait for its client to read them."""
UNAVAILABLE_STOPPING = "the server is stopping"
ANSWER_PROGRESS_BYTES = 16 << 10
"""How much of an answer that waits for the client's window must be sent for the wait's
bound (``body_timeout_s``) to start again."""
DEADLINE_SLACK_S = 0.002
"""How near its deadline a call whose handler stopped counts as ended by it (as grpc.aio's,
``service.DEADLINE_SLACK_S``)."""


class Aborted(grpc.aio.AbortError):  # type: ignore[misc]
    """A call's status, set by :meth:`Context.abort`."""


class Stream:
    """One call: its request bytes, its task, its windows and its status; and what the
    servicer methods use of grpc.aio's ``ServicerContext`` (the stream is the call's context,
    so that an ended call leaves no reference cycle for the collector to find)."""

    __slots__ = (
        "code",
        "connection",
        "credit",
        "data",
        "deadline",
        "deadline_timer",
        "details",
        "encoding",
        "expected",
        "headers_sent",
        "held",
        "id",
        "messages",
        "metadata",
        "method",
        "owed",
        "queued",
        "remote_closed",
        "reset",
        "starved",
        "status_sent",
        "task",
        "tracked",
        "trailing",
        "waiter",
    )

    def __init__(self, connection: Connection, stream_id: int, method: Method) -> None:
        self.connection = connection
        self.id = stream_id
        self.method = method
        self.metadata: tuple[tuple[str, str | bytes], ...] = ()
        self.deadline: float | None = None
        self.deadline_timer: asyncio.TimerHandle | None = None
        self.encoding = "identity"
        self.expected: int | None = None
        """The DATA bytes still to come, as ``content-length`` declared (``None``: none did)."""
        self.data = bytearray()
        self.held = 0
        """Bytes of ``data`` counted against the process's byte budget."""
        self.messages: asyncio.Queue[Any] | None = None
        self.queued = 0
        """Bytes of a streaming call's messages that its handler has not taken yet."""
        self.owed = 0
        """Bytes received on the stream whose window is not given back yet."""
        self.credit = 0
        """The stream's send window less the client's ``INITIAL_WINDOW_SIZE`` (the window
        is :meth:`Connection.window_of`): a change of that setting is one assignment, not a
        change to every open stream."""
        self.waiter: asyncio.Future[None] | None = None
        """The answer's writer waiting for window, if it waits."""
        self.starved = 0
        """Nonzero while the writer waits for the stream's own window: its entry in the
        connection's queue of such streams (``Connection.starved``)."""
        self.remote_closed = False
        self.reset = False
        self.status_sent = False
        self.headers_sent = False
        self.task: asyncio.Task[None] | None = None
        self.tracked: TrackedCall | None = None
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: tuple[tuple[str, str], ...] = ()

    def cancel(self, msg: Any = None) -> bool:
        """End the call (admission's sweep or eviction, with ``tracked.ended`` set): its task
        is cancelled and sends the status; a call whose message has not come sends it now."""
        if self.task is not None:
            return self.task.cancel(msg)
        ended = self.tracked.ended if self.tracked is not None else None
        if ended is not None:
            self.connection.finish(self, ended.code, ended.message)
        return True

    # -- what the servicer methods use of grpc.aio's ServicerContext -------------------

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self.metadata

    def peer(self) -> str:
        return self.connection.peer

    def time_remaining(self) -> float | None:
        deadline = self.deadline
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = tuple((str(k), str(v)) for k, v in metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        if self.status_sent:
            raise Aborted("the call's status was already sent")
        self.code, self.details = code, details
        raise Aborted(details)

    async def write(self, message: Any) -> None:
        if self.status_sent or self.reset:
            raise ConnectionResetError("the call is over")
        await self.connection.send_message(self, self.method.serialize(message))

    def done(self) -> bool:
        return self.status_sent or self.reset


class Connection(asyncio.Protocol):
    """One client's HTTP/2 connection to the native gRPC server."""

    def __init__(self, server: NativeServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.buffer = bytearray()
        self.preface = False
        self.settled = False
        self.streams: dict[int, Stream] = {}
        self.last_stream = 0
        self.decoder = hpack.Decoder(max_header_list_size=HPACK_BOMB_BYTES)
        self.blocks: dict[bytes, Head] = {}
        self.continuing: tuple[int, int, bytearray] | None = None  # stream, flags, block
        self.peer_initial_window = wire.DEFAULT_WINDOW
        self.peer_max_frame = wire.DEFAULT_FRAME_SIZE
        self.send_window = wire.DEFAULT_WINDOW
        self.receive_window = server.connection_window
        self.receive_owed = 0
        self.waiting: collections.deque[Stream] = collections.deque()
        """Streams whose answer waits for the connection's window, first come first."""
        self.starved: list[tuple[int, int, Stream]] = []
        """Streams whose answer waits for the stream's own window: a heap by their credit
        (the largest first), so that a larger ``INITIAL_WINDOW_SIZE`` wakes exactly the
        writers it unblocks. Entries whose stream moved on are dropped as they surface."""
        self.starving = itertools.count(1)
        self.writable = asyncio.Event()
        self.writable.set()
        self.going_away = False
        self.yielding = False
        """The frames received wait for the event loop's next round (:meth:`_frames`)."""
        self.ended_streams: dict[int, int] = {}
        """How the last ``CLOSED_KEPT`` streams closed, by id (RFC 9113 §5.1's closed state)."""
        self.forgotten = 0
        """The highest id of a closed stream no longer remembered: one not open above it
        and not remembered was never opened."""
        self.self_dependent = 0
        """A stream whose HEADERS made it depend on itself (its block is decoded first)."""
        self.ending = False
        """The connection ends for an error (:meth:`_end`)."""
        self.timer: asyncio.TimerHandle | None = None
        self.flood = (0.0, 0)
        self.earned = 0
        self.table_update = b""
        """A table size update for the next header block written (:meth:`_block`)."""
        """Window updates the client may send for DATA frames sent to it, uncounted."""
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Done once the connection is closed."""

    # -- the connection ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = self.transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            host, port = peer[0], peer[1]
            self.peer = f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
        else:
            self.peer = "unix:"
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)
        self.transport.write(
            wire.settings(
                {
                    Setting.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
                    Setting.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                    Setting.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
                    Setting.ENABLE_PUSH: 0,
                }
            )
            + wire.window_update(0, self.receive_window - wire.DEFAULT_WINDOW)
        )
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.server.handshake_timeout_s, self._handshake_late)

    def _handshake_late(self) -> None:
        if not self.settled:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        self._drop_streams()
        if not self.finished.done():
            self.finished.set_result(None)

    def _drop_streams(self) -> None:
        """End every call at once: the connection is gone, or ends for an error."""
        for stream in list(self.streams.values()):
            stream.reset = True
            if stream.deadline_timer is not None:
                stream.deadline_timer.cancel()
            _drop_buffers(stream)
            self._unhold(stream)
            self._release(stream)
            if stream.task is not None:
                stream.task.cancel()
                stream.task = None
        self.streams.clear()
        self.writable.set()
        for stream in self.waiting:
            _wake(stream)
        for _, _, stream in self.starved:
            _wake(stream)
        self.waiting.clear()
        self.starved.clear()

    def pause_writing(self) -> None:
        """The client reads slower than answers come: nothing more is read from it (what
        is not flow-controlled, statuses and acknowledgements, cannot pile up) until it
        catches up."""
        self.writable.clear()
        if self.transport is not None and not self.closed():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.writable.set()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def close(self) -> None:
        """Close once what is written is sent; a client that reads none of it for
        ``CLOSE_WAIT_S`` is cut off."""
        transport = self.transport
        if transport is not None and not transport.is_closing() and not self.ending:
            transport.close()
            asyncio.get_running_loop().call_later(CLOSE_WAIT_S, transport.abort)

    def go_away(self, code: Error = Error.NO_ERROR, reason: str = "") -> None:
        """Take no new calls: ``GOAWAY``, and the connection closes once its calls are done
        (for an error, its calls end at once: :meth:`_end`)."""
        transport = self.transport
        if transport is None or self.closed():
            return
        if not self.going_away or code != Error.NO_ERROR:
            transport.write(wire.goaway(self.last_stream, code, reason))
        self.going_away = True
        if code != Error.NO_ERROR:
            self._end(transport)
        elif not self.streams:
            self.close()

    def _end(self, transport: asyncio.Transport) -> None:
        """End the connection for an error, its ``GOAWAY`` written: every call ends, the
        server's side closes after what is written, and what the client still sends is
        read and dropped for up to ``LINGER_S``, so that the client reads the ``GOAWAY``
        (closing with its bytes unread would reset the connection, and its kernel would
        drop the ``GOAWAY`` unread)."""
        self.ending = True
        self.buffer.clear()
        self._drop_streams()
        self.writable.set()
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()
        asyncio.get_running_loop().call_later(LINGER_S, transport.abort)

    def _idle(self) -> None:
        """No call open: the idle timeout starts (``grpc_idle_timeout_s``)."""
        if self.going_away:
            self.close()
            return
        if self.timer is not None:
            self.timer.cancel()
        idle = self.server.idle_timeout_s
        if idle > 0:
            self.timer = asyncio.get_running_loop().call_later(idle, self.go_away)

    # -- frames in --------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.ending:
            return  # the connection ends for an error: what still comes is dropped
        self.buffer += data
        if not self.yielding:
            self._read()

    def _read(self) -> None:
        """Handle the frames received, a slice of time at a time (:meth:`_frames`)."""
        buffer = self.buffer
        try:
            if not self.preface:
                if len(buffer) < len(wire.PREFACE):
                    if not wire.PREFACE.startswith(bytes(buffer)):
                        raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "not HTTP/2")
                    return
                if not buffer.startswith(wire.PREFACE):
                    raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "not HTTP/2")
                del buffer[: len(wire.PREFACE)]
                self.preface = True
            self._frames()
        except wire.ConnectionError_ as exc:
            log.debug(
                "grpc_connection_error", peer=self.peer, code=exc.code.name, reason=exc.reason
            )
            self.go_away(exc.code, exc.reason)

    def _frames(self) -> None:
        """Handle the whole frames in the buffer; after ``SLICE_S`` of them, the rest waits
        for the event loop's next round (reading paused meanwhile), so that a client whose
        frames cost much (large header blocks) holds the loop a slice at a time."""
        buffer = self.buffer
        position, size = 0, len(buffer)
        limit = wire.DEFAULT_FRAME_SIZE
        started = time.perf_counter()
        try:
            while size - position >= wire.FRAME_HEADER and not self.closed():
                if time.perf_counter() - started > SLICE_S:
                    self._yield()
                    return
                length = int.from_bytes(buffer[position : position + 3], "big")
                if length > limit:
                    raise wire.ConnectionError_(Error.FRAME_SIZE_ERROR, "frame too large")
                end = position + wire.FRAME_HEADER + length
                if end > size:
                    break
                kind, flags = buffer[position + 3], buffer[position + 4]
                stream_id = int.from_bytes(buffer[position + 5 : position + 9], "big") & 0x7FFFFFFF
                payload = bytes(buffer[position + wire.FRAME_HEADER : end])
                position = end
                self._frame(kind, flags, stream_id, payload)
        finally:
            del buffer[:position]

    def _yield(self) -> None:
        """Let the event loop go round before the next frames are handled."""
        transport = self.transport
        if self.yielding or transport is None:
            return
        self.yielding = True
        transport.pause_reading()
        asyncio.get_running_loop().call_soon(self._go_on)

    def _go_on(self) -> None:
        self.yielding = False
        transport = self.transport
        if transport is None or self.closed():
            return
        self._read()
        if not self.yielding and self.writable.is_set():
            transport.resume_reading()

    def closed(self) -> bool:
        return self.ending or self.transport is None or self.transport.is_closing()

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.continuing is not None and kind != Frame.CONTINUATION:
            raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "headers interrupted")
        if not self.settled:
            if kind != Frame.SETTINGS or flags & wire.ACK:
                raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "SETTINGS must come first")
            self.settled = True
            self._idle()
        if kind == Frame.DATA:
            self._data(flags, stream_id, payload)
        elif kind == Frame.HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == Frame.CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == Frame.SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == Frame.WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == Frame.PING:
            if stream_id:
                raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise wire.ConnectionError_(Error.FRAME_SIZE_ERROR, "a PING not of 8 octets")
            if not flags & wire.ACK:
                self._flooding()
                self._write(wire.frame(Frame.PING, wire.ACK, 0, payload))
        elif kind == Frame.RST_STREAM:
            if not stream_id:
                raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "RST_STREAM on stream 0")
            if len(payload) != 4:
                raise wire.ConnectionError_(Error.FRAME_SIZE_ERROR, "an RST_STREAM not of 4 octets")
            self._flooding()
            stream = self.streams.get(stream_id)
            if stream is not None:
                self._client_reset(stream)
            elif stream_id > self.last_stream:
                raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        elif kind == Frame.GOAWAY:
            if stream_id:
                raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "GOAWAY on a stream")
            if len(payload) < 8:
                raise wire.ConnectionError_(Error.FRAME_SIZE_ERROR, "a GOAWAY under 8 octets")
            self.going_away = True
            if not self.streams:
                self.close()
        elif kind == Frame.PRIORITY:
            if not stream_id:
                raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "PRIORITY on stream 0")
            self._flooding()
            if len(payload) != 5:
                self._stream_error(stream_id, Error.FRAME_SIZE_ERROR)
            elif _depends_on(payload) == stream_id:
                self._stream_error(stream_id, Error.PROTOCOL_ERROR)
        elif kind == Frame.PUSH_PROMISE:
            raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "a client may not push")
        else:  # other frame types are ignored, as HTTP/2 says, but not without end
            self._flooding()

    def _flooding(self, weight: int = 1) -> None:
        now = time.monotonic()
        since, count = self.flood
        if now - since > 1.0:
            since, count = now, 0
        self.flood = (since, count + weight)
        if count + weight > FLOOD_PER_S:
            raise wire.ConnectionError_(Error.ENHANCE_YOUR_CALM, "too many control frames")

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & wire.ACK:
            if payload:
                raise wire.ConnectionError_(Error.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise wire.ConnectionError_(Error.FRAME_SIZE_ERROR, "bad SETTINGS")
        self._flooding()
        initial_window = None
        for offset in range(0, len(payload), 6):
            key = int.from_bytes(payload[offset : offset + 2], "big")
            value = int.from_bytes(payload[offset + 2 : offset + 6], "big")
            if key == Setting.INITIAL_WINDOW_SIZE:
                if value > wire.MAX_WINDOW:
                    raise wire.ConnectionError_(Error.FLOW_CONTROL_ERROR, "window too large")
                initial_window = value  # the last one counts: applied once, below
            elif key == Setting.HEADER_TABLE_SIZE:
                self.table_update = b"\x20"  # dynamic table size update: 0
            elif key == Setting.MAX_FRAME_SIZE:
                if not wire.DEFAULT_FRAME_SIZE <= value <= 2**24 - 1:
                    raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "bad MAX_FRAME_SIZE")
                self.peer_max_frame = value
            elif key == Setting.ENABLE_PUSH and value > 1:
                raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "bad ENABLE_PUSH")
        if initial_window is not None:
            self._initial_window(initial_window)
        self._write(wire.frame(Frame.SETTINGS, wire.ACK, 0))

    def _initial_window(self, value: int) -> None:
        """The client's new ``INITIAL_WINDOW_SIZE``: every stream's window moves by the
        change at once (each is the setting plus its own credit); the writers a larger one
        unblocks, and only those, are queued for the connection's window."""
        self.peer_initial_window = value
        starved = self.starved
        while starved and value - starved[0][0] > 0:
            _, entry, stream = heapq.heappop(starved)
            if stream.starved == entry:
                stream.starved = 0
                self._queue(stream)
        self._wake_next()

    def window_of(self, stream: Stream) -> int:
        """The stream's send window."""
        return self.peer_initial_window + stream.credit

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise wire.ConnectionError_(Error.FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if self.earned:
            self.earned -= 1  # an update for an answer sent
        else:
            self._flooding()
        if not stream_id:
            if not increment:
                raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "a window update of 0")
            self.send_window += increment
            if self.send_window > wire.MAX_WINDOW:
                raise wire.ConnectionError_(Error.FLOW_CONTROL_ERROR, "window past 2^31-1")
            self._wake_next()
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream:
                raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            return  # a closed stream's: allowed for a while (RFC 9113 §5.1)
        window = self.window_of(stream) + increment
        if not increment or window > wire.MAX_WINDOW:
            self._reset(stream, Error.PROTOCOL_ERROR if not increment else Error.FLOW_CONTROL_ERROR)
            return
        stream.credit += increment
        if not stream.starved:
            return
        if window > 0:  # its writer can go on, once the connection can
            stream.starved = 0
            self._queue(stream)
            self._wake_next()
        else:
            self._starve(stream)  # still short: queued again under its new credit

    def _wake_next(self) -> None:
        """Wake the writer first in line for the connection's window, while there is any:
        one a window change, each writer waking the next as it stops. A writer whose stream
        has no window (the client lowered ``INITIAL_WINDOW_SIZE`` meanwhile) goes back to
        wait for it, counted as a frame that asks work for nothing."""
        waiting = self.waiting
        while waiting and self.send_window > 0:
            stream = waiting.popleft()
            waiter = stream.waiter
            if waiter is None or waiter.done():
                continue
            if self.window_of(stream) <= 0:
                self._starve(stream)
                if not self._charged():
                    return
                continue
            waiter.set_result(None)
            return

    def _starve(self, stream: Stream) -> None:
        """Queue the stream's writer to wait for the stream's own window."""
        stream.starved = entry = next(self.starving)
        starved = self.starved
        if len(starved) > 2 * len(self.streams) + 64:  # entries of streams that moved on
            starved[:] = [e for e in starved if e[2].starved == e[1]]
            heapq.heapify(starved)
        heapq.heappush(starved, (-stream.credit, entry, stream))

    def _charged(self) -> bool:
        """Count work a client caused outside a frame's handling against its flood bound;
        ``False`` once that ended the connection."""
        try:
            self._flooding()
        except wire.ConnectionError_ as exc:
            self.go_away(exc.code, exc.reason)
            return False
        return True

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id % 2:
            raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "HEADERS on an even stream")
        block = _unpadded(flags, payload)
        if flags & wire.PRIORITY:
            if len(block) < 5:
                raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "bad HEADERS priority")
            if _depends_on(block) == stream_id:
                self.self_dependent = stream_id  # a stream error, once its block is decoded
            block = block[5:]
        if not flags & END_HEADERS:
            self.continuing = (stream_id, flags, bytearray(block))
            return
        self._header_block(stream_id, flags, block)

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self.continuing is None or self.continuing[0] != stream_id:
            raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "CONTINUATION out of place")
        _, first_flags, block = self.continuing
        self._flooding()  # an empty CONTINUATION carries nothing: counted, as any such frame
        block += payload
        if len(block) > 2 * MAX_HEADER_LIST:
            raise wire.ConnectionError_(Error.ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            self.continuing = None
            self._header_block(stream_id, first_flags, bytes(block))

    def _decode(self, block: bytes) -> Head:
        """The block's head: looked up when the same bytes came under the same table."""
        known = self.blocks.get(block)
        if known is not None:
            return known
        table = self.decoder.header_table
        before = (table.maxsize, tuple(table.dynamic_entries))
        try:
            headers = [(bytes(n), bytes(v)) for n, v in self.decoder.decode(block, raw=True)]
        except hpack.OversizedHeaderListError:
            raise wire.ConnectionError_(Error.ENHANCE_YOUR_CALM, "header list too large") from None
        except hpack.HPACKError as exc:
            raise wire.ConnectionError_(Error.COMPRESSION_ERROR, type(exc).__name__) from None
        head = heads.read(headers)
        if (table.maxsize, tuple(table.dynamic_entries)) != before:
            self.blocks.clear()  # entries kept meant what they meant under the old table
        elif len(block) <= BLOCK_KEPT_BYTES:
            if len(self.blocks) >= BLOCKS_KEPT:
                del self.blocks[next(iter(self.blocks))]
            self.blocks[block] = head
        return head

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        head = self._decode(block)  # always: the connection's table must follow the client's
        if self.self_dependent == stream_id:
            self.self_dependent = 0
            if stream_id > self.last_stream:
                self.last_stream = stream_id
            self._stream_error(stream_id, Error.PROTOCOL_ERROR)  # RFC 9113 §5.3.1
            return
        stream = self.streams.get(stream_id)
        if stream is not None:  # the client's trailers: they end its side
            if not flags & END_STREAM:
                raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "trailers must end the stream")
            if stream.remote_closed:
                self._reset(stream, Error.STREAM_CLOSED)
            elif head.as_trailers is not None or stream.expected:
                self._malformed(stream, head.as_trailers or "DATA short of content-length")
            else:
                self._remote_end(stream)
            return
        if stream_id <= self.last_stream:
            self._on_closed(stream_id, "HEADERS")
            return
        self.last_stream = stream_id
        if self.going_away or len(self.streams) >= MAX_STREAMS:
            self._stream_error(stream_id, Error.REFUSED_STREAM)
            return
        if head.malformed is not None:
            log.debug("grpc_malformed_request", peer=self.peer, reason=head.malformed)
            self._stream_error(stream_id, Error.PROTOCOL_ERROR, head.size // REFUSED_HEAD_BYTES)
            return
        if head.size > MAX_HEADER_LIST:
            self._flooding(1 + head.size // REFUSED_HEAD_BYTES)
            self._write_headers(
                stream_id,
                wire.RESPONSE_START
                + wire.trailers(
                    grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                    f"the call's metadata is {head.size} bytes, more than "
                    f"MAX_HEADER_LIST_SIZE = {MAX_HEADER_LIST}",
                    (),
                ),
                True,
            )
            if not flags & END_STREAM:
                self._write(wire.rst_stream(stream_id, Error.NO_ERROR))
            self._closed(stream_id, CLIENT_ENDED if flags & END_STREAM else SERVER_ENDED)
            return
        self._open(stream_id, flags, head)

    def _stream_error(self, stream_id: int, code: Error, weight: int = 0) -> None:
        """A stream error (RFC 9113 §5.4.2): the stream reset with ``code``, the connection
        and its other calls going on; counted as a reset the client made the server send,
        and ``weight`` more."""
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._reset(stream, code)
            return
        self._flooding(1 + weight)
        self._write(wire.rst_stream(stream_id, code))
        self._closed(stream_id, SERVER_ENDED)

    def _on_closed(self, stream_id: int, kind: str) -> None:
        """A DATA or HEADERS frame on a stream at or below the last one opened, not open
        (RFC 9113 §5.1): after the client's END_STREAM a connection error, after its reset a
        stream error, both ``STREAM_CLOSED``; ignored after the server ended the stream (the
        client may have sent it before it knew); HEADERS on an id never opened is a
        connection error ``PROTOCOL_ERROR`` (§5.1.1), as far back as closed streams are
        remembered."""
        how = self.ended_streams.get(stream_id)
        if how == CLIENT_ENDED:
            raise wire.ConnectionError_(Error.STREAM_CLOSED, f"{kind} on a closed stream")
        if how == CLIENT_RESET:
            self._stream_error(stream_id, Error.STREAM_CLOSED)
        elif how is None and kind == "HEADERS" and stream_id > self.forgotten:
            raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "a stream id lower than one used")

    def _closed(self, stream_id: int, how: int) -> None:
        """Remember how a stream closed (the last ``CLOSED_KEPT`` of them)."""
        closed = self.ended_streams
        closed[stream_id] = how
        if len(closed) > CLOSED_KEPT:
            oldest = next(iter(closed))
            del closed[oldest]
            self.forgotten = max(self.forgotten, oldest)

    def _malformed(self, stream: Stream, reason: str) -> None:
        """End a call whose request is malformed (RFC 9113 §8.1.1): its stream reset
        ``PROTOCOL_ERROR``."""
        log.debug("grpc_malformed_request", peer=self.peer, reason=reason)
        self._reset(stream, Error.PROTOCOL_ERROR)

    def _open(self, stream_id: int, flags: int, head: Head) -> None:
        if head.method != b"POST":
            self._write_headers(stream_id, b"\x08\x03405", True)  # :status 405 (indexed name)
            self._closed(stream_id, CLIENT_ENDED if flags & END_STREAM else SERVER_ENDED)
            return
        content_type = head.content_type
        if content_type is None or not content_type.startswith(b"application/grpc"):
            self._write_headers(stream_id, b"\x08\x03415", True)  # :status 415, indexed name
            self._closed(stream_id, CLIENT_ENDED if flags & END_STREAM else SERVER_ENDED)
            return
        path, timeout, encoding = head.path, head.timeout, head.encoding
        assert path is not None  # a well-formed head has one
        served = self.server.methods.get(path.decode("latin-1"))
        if served is None:
            served = self.server.unknown
        stream = Stream(self, stream_id, served)
        stream.remote_closed = bool(flags & END_STREAM)  # a refusal below sends no reset
        stream.metadata = head.metadata
        stream.expected = head.length
        self.streams[stream_id] = stream
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if timeout is not None:
            seconds = wire.timeout_seconds(timeout.decode("latin-1"))
            if seconds is None:
                self.finish(stream, grpc.StatusCode.INTERNAL, "malformed grpc-timeout")
                return
            stream.deadline = time.monotonic() + seconds
            stream.deadline_timer = asyncio.get_running_loop().call_later(
                seconds, self._deadline, stream
            )
        if encoding is not None and encoding != b"identity":
            if encoding not in (b"gzip", b"deflate"):
                self.finish(
                    stream,
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"grpc-encoding {encoding.decode('latin-1')!r} is not supported",
                )
                return
            stream.encoding = encoding.decode("latin-1")
        if served is self.server.unknown:
            self.finish(stream, grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            return
        tracked = self.server.admission.admit(
            served.path, stream, served.client_streaming, served.server_streaming
        )
        if isinstance(tracked, str):
            stream.trailing = (("retry-after", "1"),)
            self.finish(stream, grpc.StatusCode.RESOURCE_EXHAUSTED, tracked)
            return
        stream.tracked = tracked
        if served.client_streaming:
            stream.messages = asyncio.Queue()
            self._start(stream, _requests(stream))
        if flags & END_STREAM:
            self._remote_end(stream)

    def _deadline(self, stream: Stream) -> None:
        stream.deadline_timer = None
        if stream.id in self.streams and not stream.status_sent:
            self.finish(stream, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        if not size and not flags & END_STREAM:
            self._flooding()  # an empty DATA frame carries nothing
        self.receive_window -= size
        if self.receive_window < 0:
            raise wire.ConnectionError_(Error.FLOW_CONTROL_ERROR, "the client overran its window")
        data = _unpadded(flags, payload)
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:
            self._give_back(size)
            if stream_id > self.last_stream:
                raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "DATA on an idle stream")
            if stream is not None:
                self._reset(stream, Error.STREAM_CLOSED)
            else:
                self._on_closed(stream_id, "DATA")
            return
        if stream.expected is not None:  # content-length, which DATA must match (§8.1.1)
            stream.expected -= len(data)
            if stream.expected < 0 or (flags & END_STREAM and stream.expected):
                self._give_back(size)
                self._malformed(stream, "DATA that does not match content-length")
                return
        stream.data += data
        if stream.messages is None:  # unary: the message is bounded by max_body_bytes
            received = len(stream.data)
            declared = int.from_bytes(stream.data[1:5], "big") if received >= 5 else 0
            if declared > self.server.max_message or received > self.server.max_message + 5:
                self._give_back(size)
                self._too_large(stream, max(declared, received - 5))
                return
            self._give_back(size)
            if not flags & END_STREAM and not self._hold(stream):
                return
            stream.owed += size  # the stream's window, given back for a large message
            if stream.owed >= STREAM_WINDOW // 2:
                self._write(wire.window_update(stream.id, stream.owed))
                stream.owed = 0
        else:
            stream.owed += size
            self._parse_messages(stream)
            if stream.id not in self.streams or not self._hold(stream):
                return
            self._settle(stream)
        if flags & END_STREAM:
            self._remote_end(stream)

    def _hold(self, stream: Stream) -> bool:
        """Count what the stream holds of requests (a message still arriving, messages its
        handler has not taken) against the process's byte budget; ``False``, the call ended
        ``RESOURCE_EXHAUSTED``, past it."""
        held = len(stream.data) + stream.queued
        more = held - stream.held
        budget = self.server.budget
        if more > 0 and not budget.take("grpc", more):
            self.finish(stream, grpc.StatusCode.RESOURCE_EXHAUSTED, budget.refusal())
            return False
        if more < 0:
            budget.give("grpc", -more)
        stream.held = held
        return True

    def _unhold(self, stream: Stream) -> None:
        if stream.held:
            self.server.budget.give("grpc", stream.held)
            stream.held = 0

    def _give_back(self, size: int, stream: Stream | None = None) -> None:
        """Window taken by ``size`` bytes that are read: given back to the client in halves."""
        self.receive_owed += size
        writes = []
        if self.receive_owed >= self.server.connection_window // 2:
            writes.append(wire.window_update(0, self.receive_owed))
            self.receive_window += self.receive_owed
            self.receive_owed = 0
        if stream is not None and size:
            writes.append(wire.window_update(stream.id, size))
        if writes:
            self._write(b"".join(writes))

    def _too_large(self, stream: Stream, size: int) -> None:
        limit = self.server.max_message
        self.finish(
            stream,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"Received message larger than max ({size} vs. {limit})",
        )

    def _parse_messages(self, stream: Stream) -> None:
        """Each whole message of a streaming call, to its handler's queue."""
        data = stream.data
        queue = stream.messages
        assert queue is not None
        while len(data) >= 5:
            size = int.from_bytes(data[1:5], "big")
            if size > self.server.max_message:
                self._too_large(stream, size)
                return
            if len(data) < 5 + size:
                return
            message = self._message(stream, data[0], bytes(data[5 : 5 + size]))
            del data[: 5 + size]
            if message is None:
                return
            queue.put_nowait((message, 5 + size))
            stream.queued += 5 + size

    def _message(self, stream: Stream, compressed: int, body: bytes) -> Any:
        """The request message of ``body``; a large or compressed one as :class:`Unparsed`,
        to be read off the event loop (``None``, with the call ended, if it cannot be)."""
        if not compressed:
            return self.server.reader.deferred(stream.method, body)
        if stream.encoding == "identity":
            self.finish(
                stream, grpc.StatusCode.INTERNAL, "a compressed message without grpc-encoding"
            )
            return None
        return Unparsed(body, stream.encoding)

    def _remote_end(self, stream: Stream) -> None:
        """The client has sent all of the call."""
        stream.remote_closed = True
        if stream.messages is not None:
            stream.messages.put_nowait(None)
            return
        if stream.status_sent or stream.task is not None:
            return
        data = stream.data
        if not data:
            self.finish(stream, grpc.StatusCode.INVALID_ARGUMENT, "the call sent no request")
            return
        if len(data) < 5 or int.from_bytes(data[1:5], "big") != len(data) - 5:
            self.finish(stream, grpc.StatusCode.INTERNAL, "the request is not one whole message")
            return
        request = self._message(stream, data[0], bytes(data[5:]))
        data.clear()
        if request is None:
            return
        if stream.tracked is not None:
            stream.tracked.request_arrived()
        self._start(stream, request)

    def _start(self, stream: Stream, request: Any) -> None:
        stream.task = asyncio.get_running_loop().create_task(self._serve(stream, request))

    async def _serve(self, stream: Stream, request: Any) -> None:
        """Run the call's behaviour; send its answer, or its status."""
        CURRENT_CALL.set(stream.tracked)
        method, context = stream.method, stream
        code, details = grpc.StatusCode.OK, ""
        answer = None
        try:
            if isinstance(request, Unparsed | Undecodable):
                request = await parsed(method, request, context, self.server.reader)
            if stream.messages is None:
                self._unhold(stream)  # the message is parsed: its bytes are the request's now
            answer = await method.behaviour(request, context)
        except Aborted:
            code, details = context.code or grpc.StatusCode.UNKNOWN, context.details
        except asyncio.CancelledError:
            if stream.reset or stream.status_sent:
                return
            ended = stream.tracked.ended if stream.tracked is not None else None
            if ended is not None:
                code, details = ended.code, ended.message
            elif (
                remaining := context.time_remaining()
            ) is not None and remaining < DEADLINE_SLACK_S:
                code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
            else:
                code, details = grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_STOPPING
        except Exception as exc:
            log.exception("grpc_handler_failed", method=method.path, error=type(exc).__name__)
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected error: {type(exc).__name__}"
        if stream.reset or stream.status_sent:
            return
        if code is grpc.StatusCode.OK and not method.server_streaming:
            try:
                message = method.serialize(answer)
            except Exception as exc:
                log.exception("grpc_answer_not_serialized", method=method.path)
                self.finish(stream, grpc.StatusCode.INTERNAL, f"the answer: {type(exc).__name__}")
                return
            try:
                await self.send_message(stream, message, last=True)
            except ConnectionResetError:
                pass  # the call ended meanwhile
            except asyncio.CancelledError:
                # Ended by admission's sweep: its client read none of the answer for
                # body_timeout_s. The status is not flow-controlled: it goes at once.
                ended = stream.tracked.ended if stream.tracked is not None else None
                if ended is None or stream.reset or stream.status_sent:
                    raise
                self.finish(stream, ended.code, ended.message)
            return
        self.finish(stream, code, details)

    # -- frames out -------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not self.ending and not transport.is_closing():
            transport.write(data)

    def _block(self, block: bytes) -> bytes:
        """A header block as the next one written: after the client lowered
        ``HEADER_TABLE_SIZE``, the first starts with a table size update (RFC 7541 §4.2; to 0:
        no block written here uses the table)."""
        if self.table_update:
            block, self.table_update = self.table_update + block, b""
        return block

    def _write_headers(self, stream_id: int, block: bytes, end: bool) -> None:
        block = self._block(block)
        flags = END_HEADERS | (END_STREAM if end else 0)
        limit = self.peer_max_frame
        if len(block) <= limit:
            self._write(wire.frame(Frame.HEADERS, flags, stream_id, block))
            return
        parts = [block[i : i + limit] for i in range(0, len(block), limit)]
        out = [wire.frame(Frame.HEADERS, flags & ~END_HEADERS, stream_id, parts[0])]
        for part in parts[1:-1]:
            out.append(wire.frame(Frame.CONTINUATION, 0, stream_id, part))
        out.append(wire.frame(Frame.CONTINUATION, END_HEADERS, stream_id, parts[-1]))
        self._write(b"".join(out))

    async def send_message(self, stream: Stream, message: bytes, last: bool = False) -> None:
        """One message on the stream (its headers first, if not yet sent); with ``last``, the
        OK status after it. Waits for the client's windows, and for the transport."""
        data = wire.message_frame(message)
        head = b""
        if not stream.headers_sent:
            head = wire.frame(
                Frame.HEADERS, END_HEADERS, stream.id, self._block(wire.RESPONSE_START)
            )
            stream.headers_sent = True
        if stream.reset or stream.status_sent or self.closed():
            raise ConnectionResetError("the call is over")
        if len(data) > min(self.window_of(stream), self.send_window, self.peer_max_frame):
            data, head = await self._send_within_windows(stream, data, head)
        size = len(data)
        stream.credit -= size
        self.send_window -= size
        out = head + wire.frame(Frame.DATA, 0, stream.id, data)
        self.earned += 2
        if last:
            out += wire.frame(
                Frame.HEADERS,
                END_HEADERS | END_STREAM,
                stream.id,
                self._block(self._status_block(stream, 0, "")),
            )
            self._write(out)
            self._done(stream)
            return
        self._write(out)
        if not self.writable.is_set():
            await self.writable.wait()

    async def _send_within_windows(
        self, stream: Stream, data: bytes, head: bytes
    ) -> tuple[bytes, bytes]:
        """Send ``data`` as the client's windows allow, waiting for them, up to a last piece
        that fits them; that piece, and ``head`` if it is still unsent.

        While the client reads too little of the answer, the call's write is bounded by
        ``body_timeout_s`` (admission's sweep), from the moment the writer first waits
        until ``ANSWER_PROGRESS_BYTES`` (or the rest) have been sent: a client that lets a
        byte through now and then does not keep the call open."""
        view = memoryview(data)
        began: TrackedCall | None = None
        progress = 0
        waited = False
        try:
            while True:
                if stream.reset or stream.status_sent or self.closed():
                    raise ConnectionResetError("the call is over")
                allowed = min(self.window_of(stream), self.send_window, self.peer_max_frame)
                if len(view) <= allowed:
                    return bytes(view), head
                if allowed > 0:
                    chunk = bytes(view[:allowed])
                    view = view[allowed:]
                    stream.credit -= allowed
                    self.send_window -= allowed
                    self._write(head + wire.frame(Frame.DATA, 0, stream.id, chunk))
                    self.earned += 2
                    head = b""
                    progress += allowed
                    if began is not None and progress >= ANSWER_PROGRESS_BYTES:
                        began.write_ended()
                        began = None
                    continue
                if head:
                    self._write(head)
                    head = b""
                tracked = stream.tracked
                if began is None and tracked is not None and tracked.writing_since is None:
                    began, progress = tracked, 0
                    began.write_began()
                await self._window(stream, waited)
                waited = True
        finally:
            if began is not None:
                began.write_ended()
            self._wake_next()  # what window is left is the next writer's

    async def _window(self, stream: Stream, again: bool) -> None:
        """Wait until the stream's writer is woken for window (``_wake_next``); a writer
        woken ``again`` keeps its place at the head of the line. Writers of one stream share
        its wait."""
        waiter = stream.waiter
        if waiter is None or waiter.done():
            waiter = stream.waiter = asyncio.get_running_loop().create_future()
            if self.window_of(stream) <= 0:
                self._starve(stream)
            elif again:
                self.waiting.appendleft(stream)
            else:
                self._queue(stream)
            self._wake_next()
        try:
            await waiter
        finally:
            if stream.waiter is waiter:
                stream.waiter = None
                stream.starved = 0

    def _queue(self, stream: Stream) -> None:
        """Queue the stream's writer for the connection's window."""
        waiting = self.waiting
        if len(waiting) > 2 * len(self.streams) + 64:  # entries of writers that moved on
            live = [s for s in waiting if s.waiter is not None and not s.waiter.done()]
            waiting.clear()
            waiting.extend(live)
        waiting.append(stream)

    def _status_block(self, stream: Stream, code: int, details: str) -> bytes:
        trailing = stream.trailing
        if code == 0 and not trailing:
            return wire.STATUS_OK
        if len(details) > MAX_DETAILS:
            details = details[: MAX_DETAILS - 3] + "..."
        return wire.trailers(code, details, trailing)

    def finish(self, stream: Stream, code: grpc.StatusCode, details: str) -> None:
        """Send the call's status (in a trailers-only answer if nothing was sent) and end it."""
        if stream.status_sent or stream.reset:
            return
        block = self._status_block(stream, code.value[0], details)
        if not stream.headers_sent:
            block = wire.RESPONSE_START + block
            stream.headers_sent = True
        self._write_headers(stream.id, block, True)
        task = stream.task
        self._done(stream)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def _done(self, stream: Stream) -> None:
        stream.status_sent = True
        if not stream.remote_closed:
            self._write(wire.rst_stream(stream.id, Error.NO_ERROR))
            self._closed(stream.id, SERVER_ENDED)
        else:
            self._closed(stream.id, CLIENT_ENDED)
        self._forget(stream)

    def _reset(self, stream: Stream, code: Error) -> None:
        """Reset a stream for a frame the client should not have sent on it: counted, as a
        client's own reset is, against ``FLOOD_PER_S`` (a client that makes the server reset
        its calls, "MadeYouReset", is ended as a reset flood is)."""
        self._flooding()
        self._write(wire.rst_stream(stream.id, code))
        stream.reset = True
        if stream.task is not None:
            stream.task.cancel()
        self._closed(stream.id, SERVER_ENDED)
        self._forget(stream)

    def _client_reset(self, stream: Stream) -> None:
        stream.reset = True
        if stream.task is not None:
            stream.task.cancel()
        self._closed(stream.id, CLIENT_RESET)
        self._forget(stream)

    def _forget(self, stream: Stream) -> None:
        if self.streams.pop(stream.id, None) is None:
            return
        _wake(stream)  # a writer waiting for window: the call is over
        _drop_buffers(stream)
        self._unhold(stream)
        if stream.deadline_timer is not None:
            stream.deadline_timer.cancel()
        if stream.messages is not None and stream.owed:
            self._give_back(stream.owed)  # the connection's share; the stream is gone
        self._release(stream)
        stream.task = None  # its frames refer to the stream: no cycle left behind
        if not self.streams:
            self._idle()

    def _release(self, stream: Stream) -> None:
        tracked = stream.tracked
        if tracked is not None:
            tracked.release()
            stream.tracked = None  # it refers to the stream (its task): no cycle left behind

    def consumed(self, stream: Stream, size: int) -> None:
        """A streaming call's handler took a message of ``size`` bytes."""
        stream.queued -= size
        if stream.id in self.streams:
            self._hold(stream)
        self._settle(stream)

    def _settle(self, stream: Stream) -> None:
        """A streaming call's window back to its client while its handler keeps up (at most
        a stream window of messages waiting for it); held back while it does not, so that
        a client that floods a stream waits. A message in pieces always gets its window:
        its size is bounded by ``max_body_bytes``."""
        if (
            stream.owed >= STREAM_WINDOW // 4
            and stream.queued <= STREAM_WINDOW
            and stream.id in self.streams
        ):
            owed, stream.owed = stream.owed, 0
            self._give_back(owed, None if stream.remote_closed else stream)


async def _requests(stream: Stream) -> AsyncIterator[Any]:
    """A streaming call's request messages as they come; ``INVALID_ARGUMENT`` for one that
    does not parse."""
    queue = stream.messages
    assert queue is not None
    while True:
        item = await queue.get()
        if item is None:
            return
        message, size = item
        stream.connection.consumed(stream, size)
        if isinstance(message, Unparsed | Undecodable):
            message = await parsed(stream.method, message, stream, stream.connection.server.reader)
        yield message


def _drop_buffers(stream: Stream) -> None:
    """What an ended stream received and nobody will read: freed now, not when its handler's
    task lets go of the stream."""
    stream.data.clear()
    queue = stream.messages
    if queue is not None:
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(None)  # a handler still reading finds the end


def _depends_on(priority: bytes) -> int:
    """The stream a priority block (RFC 9113 §5.3) says its stream depends on."""
    return int.from_bytes(priority[:4], "big") & 0x7FFFFFFF


def _wake(stream: Stream) -> None:
    waiter = stream.waiter
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def _unpadded(flags: int, payload: bytes) -> bytes:
    if not flags & wire.PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise wire.ConnectionError_(Error.PROTOCOL_ERROR, "bad padding")
    return payload[1 : len(payload) - payload[0]]


async def _unknown(request: Any, context: Any) -> None:  # pragma: no cover - never called
    raise AssertionError("unreachable")


class NativeServer:
    """The native gRPC server of one process: its listening socket and its connections."""

    def __init__(
        self,
        methods: list[Method],
        admission: Admission,
        max_message: int,
        handshake_timeout_s: float,
        idle_timeout_s: float,
        reader: Reader,
    ) -> None:
        self.methods = {m.path: m for m in methods}
        self.reader = reader
        """Reads large and compressed messages off the event loop (the body threads)."""
        self.budget = reader.budget
        self.unknown = Method("", "", lambda b: b, lambda m: b"", _unknown, False, False)
        self.admission = admission
        self.max_message = max_message
        self.connection_window = max(CONNECTION_WINDOW, 2 * (max_message + 5))
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.connections: set[Connection] = set()
        self.listener: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int, shared: bool) -> None:
        """Listen on ``host:port``, the port ``shared`` with the other workers or not
        (:class:`ConfigError` if it cannot be had)."""
        sock = bind(host, port, reuse_port=shared)
        sock.listen(1024)
        loop = asyncio.get_running_loop()
        self.listener = await loop.create_server(lambda: Connection(self), sock=sock)

    async def stop(self, grace_s: float) -> None:
        """No new connection; ``GOAWAY`` to each; calls still open after ``grace_s`` are
        ended ``UNAVAILABLE``, and the connections closed."""
        if self.listener is not None:
            self.listener.close()
        for connection in list(self.connections):
            connection.go_away()
        open_ = [c.finished for c in self.connections]
        if open_:
            await asyncio.wait(open_, timeout=grace_s)
        for connection in list(self.connections):
            for stream in list(connection.streams.values()):
                connection.finish(stream, grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_STOPPING)
            connection.close()
        if self.listener is not None:
            await self.listener.wait_closed()
