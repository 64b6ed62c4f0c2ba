"""One client's HTTP/2 connection (RFC 9113) on the event loop's own thread: HTTP/2 bytes in,
calls out. An :class:`asyncio.Protocol` that reads the frames itself and hands each stream's
events to the protocol over it (a :class:`CallHandler`: gRPC's, ``grpc_api/front.py``).

What it keeps of the protocol: the preface and settings within the handshake timeout; flow
control both ways (``h2flow.py``); HPACK with its dynamic table (``h2heads.py``: a header
block seen before under the same table is looked up, not decoded again); ``PING``,
``GOAWAY`` and ``RST_STREAM`` both ways (``h2streams.py``); ``GOAWAY`` to a connection with
no stream open for the idle timeout.

What a client can make it do is bounded by what it sends, not by the connection's state:
frames that ask work but carry no call, and resets the server sends for a client's frames,
count against one flood bound (``FLOOD_PER_S``); one connection's frames hold the event loop
``SLICE_S`` at a time. Floods and frames that break the protocol end the connection with
``GOAWAY`` (docs/security.md, "The protocol layers under attack").
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import structlog

from plugserve.server.transport.h2calls import CallHandler, S
from plugserve.server.transport.h2flow import STREAM_WINDOW, wake
from plugserve.server.transport.h2frames import (
    ACK,
    DEFAULT_FRAME_SIZE,
    DEFAULT_WINDOW,
    FRAME_HEADER,
    PREFACE,
    ConnectionError_,
    Error,
    Frame,
    Setting,
    depends_on,
    frame,
    goaway,
    settings,
    window_update,
)
from plugserve.server.transport.h2heads import MAX_HEADER_LIST
from plugserve.server.transport.h2streams import MAX_STREAMS, StreamStates

log = structlog.get_logger("plugserve.grpc")

FLOOD_PER_S = 1000
"""Frames that ask work but carry no call (pings, settings, stream resets, priorities,
empty DATA, frames of unknown types), resets the server sends for a client's frames, and
answers woken for a window the client took back, a connection may cause in a second before
it is ended with ``ENHANCE_YOUR_CALM`` (a reset flood is the "rapid reset" attack; resets
the client makes the server send, "MadeYouReset"). A refused header block counts once per
``REFUSED_HEAD_BYTES`` of its header list besides: decoding it was the work."""
SLICE_S = 0.005
"""How long one connection's frames may hold the event loop before others' turn."""
LINGER_S = 2.0
"""How long a connection ended for an error reads (and drops) what its client still sends."""
CLOSE_WAIT_S = 10.0
"""How long a closing connection's last bytes may wait for its client to read them."""


@dataclass(frozen=True, slots=True)
class H2Limits:
    """What bounds a server's HTTP/2 connections."""

    connection_window: int
    """The connection's receive window."""
    handshake_timeout_s: float
    """The preface and the client's first ``SETTINGS`` come within this, or it is closed."""
    idle_timeout_s: float
    """``GOAWAY`` to a connection with no stream open for this long (0: never)."""


class H2Connection(StreamStates[S], asyncio.Protocol):
    """One client's HTTP/2 connection: its lifetime, and the frames read off it."""

    def __init__(
        self,
        limits: H2Limits,
        connections: set[H2Connection[S]],
        calls: Callable[[H2Connection[S]], CallHandler[S]],
    ) -> None:
        super().__init__(limits.connection_window)
        self.limits = limits
        self.connections = connections
        """The server's open connections: this one among them while it is open."""
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.buffer = bytearray()
        self.preface = False
        self.settled = False
        self.going_away = False
        self.yielding = False
        """The frames received wait for the event loop's next round (:meth:`_frames`)."""
        self.ending = False
        """The connection ends for an error (:meth:`_end`)."""
        self.timer: asyncio.TimerHandle | None = None
        self.flood = (0.0, 0)
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Done once the connection is closed."""
        self.calls = calls(self)

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
        self.connections.add(self)
        self.transport.write(
            settings(
                {
                    Setting.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
                    Setting.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                    Setting.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
                    Setting.ENABLE_PUSH: 0,
                }
            )
            + window_update(0, self.receive_window - DEFAULT_WINDOW)
        )
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.limits.handshake_timeout_s, self._handshake_late)

    def _handshake_late(self) -> None:
        if not self.settled:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        self._drop_streams()
        if not self.finished.done():
            self.finished.set_result(None)

    def _drop_streams(self) -> None:
        """End every stream at once: the connection is gone, or ends for an error."""
        for stream in list(self.streams.values()):
            stream.reset = True
            self.calls.drop(stream)
        self.streams.clear()
        self.writable.set()
        for stream in self.waiting:
            wake(stream)
        for _, _, stream in self.starved:
            wake(stream)
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
        """Take no new streams: ``GOAWAY``, and the connection closes once its streams are
        done (for an error, its streams end at once: :meth:`_end`)."""
        transport = self.transport
        if transport is None or self.closed():
            return
        if not self.going_away or code != Error.NO_ERROR:
            transport.write(goaway(self.last_stream, code, reason))
        self.going_away = True
        if code != Error.NO_ERROR:
            self._end(transport)
        elif not self.streams:
            self.close()

    def _end(self, transport: asyncio.Transport) -> None:
        """End the connection for an error, its ``GOAWAY`` written: every stream ends, the
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
        """No stream open: the idle timeout starts."""
        if self.going_away:
            self.close()
            return
        if self.timer is not None:
            self.timer.cancel()
        idle = self.limits.idle_timeout_s
        if idle > 0:
            self.timer = asyncio.get_running_loop().call_later(idle, self.go_away)

    def closed(self) -> bool:
        return self.ending or self.transport is None or self.transport.is_closing()

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not self.ending and not transport.is_closing():
            transport.write(data)

    def flooding(self, weight: int = 1) -> None:
        """Count work the client asked for nothing (``weight`` frames' worth) against
        ``FLOOD_PER_S``: past it, :class:`ConnectionError_` ``ENHANCE_YOUR_CALM``."""
        now = time.monotonic()
        since, count = self.flood
        if now - since > 1.0:
            since, count = now, 0
        self.flood = (since, count + weight)
        if count + weight > FLOOD_PER_S:
            raise ConnectionError_(Error.ENHANCE_YOUR_CALM, "too many control frames")

    def _charged(self) -> bool:
        """Count work a client caused outside a frame's handling against its flood bound;
        ``False`` once that ended the connection."""
        try:
            self.flooding()
        except ConnectionError_ as exc:
            self.go_away(exc.code, exc.reason)
            return False
        return True

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
                if len(buffer) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buffer)):
                        raise ConnectionError_(Error.PROTOCOL_ERROR, "not HTTP/2")
                    return
                if not buffer.startswith(PREFACE):
                    raise ConnectionError_(Error.PROTOCOL_ERROR, "not HTTP/2")
                del buffer[: len(PREFACE)]
                self.preface = True
            self._frames()
        except ConnectionError_ as exc:
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
        limit = DEFAULT_FRAME_SIZE
        started = time.perf_counter()
        try:
            while size - position >= FRAME_HEADER and not self.closed():
                if time.perf_counter() - started > SLICE_S:
                    self._yield()
                    return
                length = int.from_bytes(buffer[position : position + 3], "big")
                if length > limit:
                    raise ConnectionError_(Error.FRAME_SIZE_ERROR, "frame too large")
                end = position + FRAME_HEADER + length
                if end > size:
                    break
                kind, flags = buffer[position + 3], buffer[position + 4]
                stream_id = int.from_bytes(buffer[position + 5 : position + 9], "big") & 0x7FFFFFFF
                payload = bytes(buffer[position + FRAME_HEADER : end])
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

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.continuing is not None and kind != Frame.CONTINUATION:
            raise ConnectionError_(Error.PROTOCOL_ERROR, "headers interrupted")
        if not self.settled:
            if kind != Frame.SETTINGS or flags & ACK:
                raise ConnectionError_(Error.PROTOCOL_ERROR, "SETTINGS must come first")
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
                raise ConnectionError_(Error.PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise ConnectionError_(Error.FRAME_SIZE_ERROR, "a PING not of 8 octets")
            if not flags & ACK:
                self.flooding()
                self.write(frame(Frame.PING, ACK, 0, payload))
        elif kind == Frame.RST_STREAM:
            if not stream_id:
                raise ConnectionError_(Error.PROTOCOL_ERROR, "RST_STREAM on stream 0")
            if len(payload) != 4:
                raise ConnectionError_(Error.FRAME_SIZE_ERROR, "an RST_STREAM not of 4 octets")
            self.flooding()
            stream = self.streams.get(stream_id)
            if stream is not None:
                self._client_reset(stream)
            elif stream_id > self.last_stream:
                raise ConnectionError_(Error.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        elif kind == Frame.GOAWAY:
            if stream_id:
                raise ConnectionError_(Error.PROTOCOL_ERROR, "GOAWAY on a stream")
            if len(payload) < 8:
                raise ConnectionError_(Error.FRAME_SIZE_ERROR, "a GOAWAY under 8 octets")
            self.going_away = True
            if not self.streams:
                self.close()
        elif kind == Frame.PRIORITY:
            if not stream_id:
                raise ConnectionError_(Error.PROTOCOL_ERROR, "PRIORITY on stream 0")
            self.flooding()
            if len(payload) != 5:
                self.stream_error(stream_id, Error.FRAME_SIZE_ERROR)
            elif depends_on(payload) == stream_id:
                self.stream_error(stream_id, Error.PROTOCOL_ERROR)
        elif kind == Frame.PUSH_PROMISE:
            raise ConnectionError_(Error.PROTOCOL_ERROR, "a client may not push")
        else:  # other frame types are ignored, as HTTP/2 says, but not without end
            self.flooding()
