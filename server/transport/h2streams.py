"""A connection's streams and their states (RFC 9113 §5.1): the frames that open, feed,
reset and end them, closed streams remembered to answer their late frames, and stream
errors (§5.4.2). A stream's events go to the connection's :class:`CallHandler`.

A malformed request resets its own stream; a reset the server sends for a client's frame
counts, as a client's own reset does, against the connection's flood bound.
"""

from __future__ import annotations

import asyncio

import structlog

from plugserve.server.transport.h2calls import CallHandler, S
from plugserve.server.transport.h2flow import FlowControl, wake
from plugserve.server.transport.h2frames import (
    END_HEADERS,
    END_STREAM,
    MAX_WINDOW,
    PRIORITY,
    ConnectionError_,
    Error,
    depends_on,
    rst_stream,
    unpadded,
)
from plugserve.server.transport.h2heads import MAX_HEADER_LIST, HeadDecoder

log = structlog.get_logger("plugserve.grpc")

MAX_STREAMS = 4096
"""``MAX_CONCURRENT_STREAMS``; admission refuses calls past ``max_connections`` first."""
REFUSED_HEAD_BYTES = 512
"""Header-list bytes (RFC 9113 §6.5.2's count, 32 a field) a refused block weighs as one
more frame of the flood count: about sixteen decoded fields."""
CLOSED_KEPT = 1024
"""Closed streams whose way of closing is remembered, to answer their late frames."""
CLIENT_ENDED, CLIENT_RESET, SERVER_ENDED = 1, 2, 3
"""How a stream closed: the client sent all of it, the client reset it, the server ended it."""


class StreamStates(FlowControl[S]):
    """The streams of one connection, from the HEADERS that open them to their close."""

    calls: CallHandler[S]
    peer: str
    going_away: bool
    timer: asyncio.TimerHandle | None

    def __init__(self, connection_window: int) -> None:
        super().__init__(connection_window)
        self.streams: dict[int, S] = {}
        self.last_stream = 0
        self.heads = HeadDecoder()
        self.continuing: tuple[int, int, bytearray] | None = None  # stream, flags, block
        self.ended_streams: dict[int, int] = {}
        """How the last ``CLOSED_KEPT`` streams closed, by id (RFC 9113 §5.1's closed state)."""
        self.forgotten = 0
        """The highest id of a closed stream no longer remembered: one not open above it
        and not remembered was never opened."""
        self.self_dependent = 0
        """A stream whose HEADERS made it depend on itself (its block is decoded first)."""

    def _idle(self) -> None:
        raise NotImplementedError  # what the connection does with no stream open

    # -- frames in ----------------------------------------------------------------------

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id % 2:
            raise ConnectionError_(Error.PROTOCOL_ERROR, "HEADERS on an even stream")
        block = unpadded(flags, payload)
        if flags & PRIORITY:
            if len(block) < 5:
                raise ConnectionError_(Error.PROTOCOL_ERROR, "bad HEADERS priority")
            if depends_on(block) == stream_id:
                self.self_dependent = stream_id  # a stream error, once its block is decoded
            block = block[5:]
        if not flags & END_HEADERS:
            self.continuing = (stream_id, flags, bytearray(block))
            return
        self._header_block(stream_id, flags, block)

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self.continuing is None or self.continuing[0] != stream_id:
            raise ConnectionError_(Error.PROTOCOL_ERROR, "CONTINUATION out of place")
        _, first_flags, block = self.continuing
        self.flooding()  # an empty CONTINUATION carries nothing: counted, as any such frame
        block += payload
        if len(block) > 2 * MAX_HEADER_LIST:
            raise ConnectionError_(Error.ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            self.continuing = None
            self._header_block(stream_id, first_flags, bytes(block))

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        head = self.heads.decode(block)  # always: the connection's table must follow the client's
        if self.self_dependent == stream_id:
            self.self_dependent = 0
            if stream_id > self.last_stream:
                self.last_stream = stream_id
            self.stream_error(stream_id, Error.PROTOCOL_ERROR)  # RFC 9113 §5.3.1
            return
        stream = self.streams.get(stream_id)
        if stream is not None:  # the client's trailers: they end its side
            if not flags & END_STREAM:
                raise ConnectionError_(Error.PROTOCOL_ERROR, "trailers must end the stream")
            if stream.remote_closed:
                self._reset(stream, Error.STREAM_CLOSED)
            elif head.as_trailers is not None or stream.expected:
                self._malformed(stream, head.as_trailers or "DATA short of content-length")
            else:
                self.calls.remote_end(stream)
            return
        if stream_id <= self.last_stream:
            self._on_closed(stream_id, "HEADERS")
            return
        self.last_stream = stream_id
        if self.going_away or len(self.streams) >= MAX_STREAMS:
            self.stream_error(stream_id, Error.REFUSED_STREAM)
            return
        if head.malformed is not None:
            log.debug("grpc_malformed_request", peer=self.peer, reason=head.malformed)
            self.stream_error(stream_id, Error.PROTOCOL_ERROR, head.size // REFUSED_HEAD_BYTES)
            return
        self.calls.open(stream_id, flags, head)

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise ConnectionError_(Error.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        if not size and not flags & END_STREAM:
            self.flooding()  # an empty DATA frame carries nothing
        self.receive_window -= size
        if self.receive_window < 0:
            raise ConnectionError_(Error.FLOW_CONTROL_ERROR, "the client overran its window")
        data = unpadded(flags, payload)
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:
            self.give_back(size)
            if stream_id > self.last_stream:
                raise ConnectionError_(Error.PROTOCOL_ERROR, "DATA on an idle stream")
            if stream is not None:
                self._reset(stream, Error.STREAM_CLOSED)
            else:
                self._on_closed(stream_id, "DATA")
            return
        if stream.expected is not None:  # content-length, which DATA must match (§8.1.1)
            stream.expected -= len(data)
            if stream.expected < 0 or (flags & END_STREAM and stream.expected):
                self.give_back(size)
                self._malformed(stream, "DATA that does not match content-length")
                return
        self.calls.receive(stream, data, size, bool(flags & END_STREAM))

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(Error.FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if self.earned:
            self.earned -= 1  # an update for an answer sent
        else:
            self.flooding()
        if not stream_id:
            if not increment:
                raise ConnectionError_(Error.PROTOCOL_ERROR, "a window update of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ConnectionError_(Error.FLOW_CONTROL_ERROR, "window past 2^31-1")
            self._wake_next()
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream:
                raise ConnectionError_(Error.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
            return  # a closed stream's: allowed for a while (RFC 9113 §5.1)
        window = self.window_of(stream) + increment
        if not increment or window > MAX_WINDOW:
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

    # -- stream states ------------------------------------------------------------------

    def stream_error(self, stream_id: int, code: Error, weight: int = 0) -> None:
        """A stream error (RFC 9113 §5.4.2): the stream reset with ``code``, the connection
        and its other calls going on; counted as a reset the client made the server send,
        and ``weight`` more."""
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._reset(stream, code)
            return
        self.flooding(1 + weight)
        self.write(rst_stream(stream_id, code))
        self.remember_closed(stream_id, SERVER_ENDED)

    def _on_closed(self, stream_id: int, kind: str) -> None:
        """A DATA or HEADERS frame on a stream at or below the last one opened, not open
        (RFC 9113 §5.1): after the client's END_STREAM a connection error, after its reset a
        stream error, both ``STREAM_CLOSED``; ignored after the server ended the stream (the
        client may have sent it before it knew); HEADERS on an id never opened is a
        connection error ``PROTOCOL_ERROR`` (§5.1.1), as far back as closed streams are
        remembered."""
        how = self.ended_streams.get(stream_id)
        if how == CLIENT_ENDED:
            raise ConnectionError_(Error.STREAM_CLOSED, f"{kind} on a closed stream")
        if how == CLIENT_RESET:
            self.stream_error(stream_id, Error.STREAM_CLOSED)
        elif how is None and kind == "HEADERS" and stream_id > self.forgotten:
            raise ConnectionError_(Error.PROTOCOL_ERROR, "a stream id lower than one used")

    def remember_closed(self, stream_id: int, how: int) -> None:
        """Remember how a stream closed (the last ``CLOSED_KEPT`` of them)."""
        closed = self.ended_streams
        closed[stream_id] = how
        if len(closed) > CLOSED_KEPT:
            oldest = next(iter(closed))
            del closed[oldest]
            self.forgotten = max(self.forgotten, oldest)

    def _malformed(self, stream: S, reason: str) -> None:
        """End a call whose request is malformed (RFC 9113 §8.1.1): its stream reset
        ``PROTOCOL_ERROR``."""
        log.debug("grpc_malformed_request", peer=self.peer, reason=reason)
        self._reset(stream, Error.PROTOCOL_ERROR)

    def add(self, stream: S) -> None:
        """The stream is open: the connection's idle timeout stops."""
        self.streams[stream.id] = stream
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def done(self, stream: S) -> None:
        """The server's side of the stream has ended (its last frame written): the stream
        closes, reset ``NO_ERROR`` if the client's side is still open."""
        stream.status_sent = True
        if not stream.remote_closed:
            self.write(rst_stream(stream.id, Error.NO_ERROR))
            self.remember_closed(stream.id, SERVER_ENDED)
        else:
            self.remember_closed(stream.id, CLIENT_ENDED)
        self._forget(stream)

    def _reset(self, stream: S, code: Error) -> None:
        """Reset a stream for a frame the client should not have sent on it: counted, as a
        client's own reset is, against ``FLOOD_PER_S`` (a client that makes the server reset
        its calls, "MadeYouReset", is ended as a reset flood is)."""
        self.flooding()
        self.write(rst_stream(stream.id, code))
        stream.reset = True
        self.calls.reset(stream)
        self.remember_closed(stream.id, SERVER_ENDED)
        self._forget(stream)

    def _client_reset(self, stream: S) -> None:
        stream.reset = True
        self.calls.reset(stream)
        self.remember_closed(stream.id, CLIENT_RESET)
        self._forget(stream)

    def _forget(self, stream: S) -> None:
        if self.streams.pop(stream.id, None) is None:
            return
        wake(stream)  # a writer waiting for window: the stream is over
        self.calls.forget(stream)
        if not self.streams:
            self._idle()
