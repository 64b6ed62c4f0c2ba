"""HTTP/2 flow control both ways (RFC 9113 §5.2, §6.9), and answers written within it.

Received DATA takes the connection's receive window, given back in halves as it is read
(:meth:`FlowControl.give_back`; a stream's own window is the protocol over it to give back,
as its handler keeps up). Answers wait for the client's windows: a window change is one
assignment and wakes only the writers it unblocks, first come first (:attr:`waiting`, for
the connection's window; :attr:`starved`, by credit, for a stream's own), and a writer woken
for a window the client took back meanwhile counts against the flood bound.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
from typing import Generic

from plugserve.server.transport.h2calls import S, WriteWatch
from plugserve.server.transport.h2frames import (
    ACK,
    DEFAULT_FRAME_SIZE,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    MAX_WINDOW,
    ConnectionError_,
    Error,
    Frame,
    Setting,
    frame,
    window_update,
)

STREAM_WINDOW = 1 << 20
"""Each stream's receive window (``INITIAL_WINDOW_SIZE``)."""
CONNECTION_WINDOW = 16 << 20
"""The connection's receive window, at least: a message of ``max_body_bytes`` fits it."""
ANSWER_PROGRESS_BYTES = 16 << 10
"""How much of an answer that waits for the client's window must be sent for the wait's
bound (``body_timeout_s``) to start again."""


class FlowControl(Generic[S]):
    """A connection's windows both ways, the client's settings that bear on what is written
    (``INITIAL_WINDOW_SIZE``, ``MAX_FRAME_SIZE``, ``HEADER_TABLE_SIZE``), and the writing of
    header blocks and DATA within them."""

    streams: dict[int, S]

    def __init__(self, connection_window: int) -> None:
        self.connection_window = connection_window
        """The connection's receive window, as its first ``WINDOW_UPDATE`` opens it."""
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME_SIZE
        self.send_window = DEFAULT_WINDOW
        self.receive_window = connection_window
        self.receive_owed = 0
        self.waiting: collections.deque[S] = collections.deque()
        """Streams whose answer waits for the connection's window, first come first."""
        self.starved: list[tuple[int, int, S]] = []
        """Streams whose answer waits for the stream's own window: a heap by their credit
        (the largest first), so that a larger ``INITIAL_WINDOW_SIZE`` wakes exactly the
        writers it unblocks. Entries whose stream moved on are dropped as they surface."""
        self.starving = itertools.count(1)
        self.writable = asyncio.Event()
        self.writable.set()
        self.earned = 0
        """Window updates the client may send for DATA frames sent to it, uncounted."""
        self.table_update = b""
        """A table size update for the next header block written (:meth:`block`)."""

    # -- what the connection provides (``H2Connection``) ---------------------------------

    def write(self, data: bytes) -> None:
        raise NotImplementedError

    def closed(self) -> bool:
        raise NotImplementedError

    def flooding(self, weight: int = 1) -> None:
        raise NotImplementedError

    def _charged(self) -> bool:
        raise NotImplementedError

    # -- the client's settings ----------------------------------------------------------

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ConnectionError_(Error.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ConnectionError_(Error.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ConnectionError_(Error.FRAME_SIZE_ERROR, "bad SETTINGS")
        self.flooding()
        initial_window = None
        for offset in range(0, len(payload), 6):
            key = int.from_bytes(payload[offset : offset + 2], "big")
            value = int.from_bytes(payload[offset + 2 : offset + 6], "big")
            if key == Setting.INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(Error.FLOW_CONTROL_ERROR, "window too large")
                initial_window = value  # the last one counts: applied once, below
            elif key == Setting.HEADER_TABLE_SIZE:
                self.table_update = b"\x20"  # dynamic table size update: 0
            elif key == Setting.MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= 2**24 - 1:
                    raise ConnectionError_(Error.PROTOCOL_ERROR, "bad MAX_FRAME_SIZE")
                self.peer_max_frame = value
            elif key == Setting.ENABLE_PUSH and value > 1:
                raise ConnectionError_(Error.PROTOCOL_ERROR, "bad ENABLE_PUSH")
        if initial_window is not None:
            self._initial_window(initial_window)
        self.write(frame(Frame.SETTINGS, ACK, 0))

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

    # -- windows ------------------------------------------------------------------------

    def window_of(self, stream: S) -> int:
        """The stream's send window."""
        return self.peer_initial_window + stream.credit

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

    def _starve(self, stream: S) -> None:
        """Queue the stream's writer to wait for the stream's own window."""
        stream.starved = entry = next(self.starving)
        starved = self.starved
        if len(starved) > 2 * len(self.streams) + 64:  # entries of streams that moved on
            starved[:] = [e for e in starved if e[2].starved == e[1]]
            heapq.heapify(starved)
        heapq.heappush(starved, (-stream.credit, entry, stream))

    def _queue(self, stream: S) -> None:
        """Queue the stream's writer for the connection's window."""
        waiting = self.waiting
        if len(waiting) > 2 * len(self.streams) + 64:  # entries of writers that moved on
            live = [s for s in waiting if s.waiter is not None and not s.waiter.done()]
            waiting.clear()
            waiting.extend(live)
        waiting.append(stream)

    async def _window(self, stream: S, again: bool) -> None:
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

    def give_back(self, size: int, stream: S | None = None) -> None:
        """Window taken by ``size`` bytes that are read: given back to the client in halves
        (the connection's); the stream's, if a ``stream`` is given, at once."""
        self.receive_owed += size
        writes = []
        if self.receive_owed >= self.connection_window // 2:
            writes.append(window_update(0, self.receive_owed))
            self.receive_window += self.receive_owed
            self.receive_owed = 0
        if stream is not None and size:
            writes.append(window_update(stream.id, size))
        if writes:
            self.write(b"".join(writes))

    # -- frames out ---------------------------------------------------------------------

    def block(self, block: bytes) -> bytes:
        """A header block as the next one written: after the client lowered
        ``HEADER_TABLE_SIZE``, the first starts with a table size update (RFC 7541 §4.2; to 0:
        no block written here uses the table)."""
        if self.table_update:
            block, self.table_update = self.table_update + block, b""
        return block

    def write_headers(self, stream_id: int, block: bytes, end: bool) -> None:
        """A header block on the stream, in frames of the client's ``MAX_FRAME_SIZE``; with
        ``end``, the server's side of the stream ends with it."""
        block = self.block(block)
        flags = END_HEADERS | (END_STREAM if end else 0)
        limit = self.peer_max_frame
        if len(block) <= limit:
            self.write(frame(Frame.HEADERS, flags, stream_id, block))
            return
        parts = [block[i : i + limit] for i in range(0, len(block), limit)]
        out = [frame(Frame.HEADERS, flags & ~END_HEADERS, stream_id, parts[0])]
        for part in parts[1:-1]:
            out.append(frame(Frame.CONTINUATION, 0, stream_id, part))
        out.append(frame(Frame.CONTINUATION, END_HEADERS, stream_id, parts[-1]))
        self.write(b"".join(out))

    async def send(
        self, stream: S, data: bytes, head: bytes = b"", trailers: bytes | None = None
    ) -> None:
        """``data`` on the stream, after ``head`` (frames not written yet); with ``trailers``,
        the header block that ends the server's side after it. Waits for the client's
        windows, and, unless it ends the stream, for the transport."""
        if len(data) > min(self.window_of(stream), self.send_window, self.peer_max_frame):
            data, head = await self._send_within_windows(stream, data, head)
        size = len(data)
        stream.credit -= size
        self.send_window -= size
        out = head + frame(Frame.DATA, 0, stream.id, data)
        self.earned += 2
        if trailers is not None:
            out += frame(Frame.HEADERS, END_HEADERS | END_STREAM, stream.id, self.block(trailers))
            self.write(out)
            return
        self.write(out)
        if not self.writable.is_set():
            await self.writable.wait()

    async def _send_within_windows(
        self, stream: S, data: bytes, head: bytes
    ) -> tuple[bytes, bytes]:
        """Send ``data`` as the client's windows allow, waiting for them, up to a last piece
        that fits them; that piece, and ``head`` if it is still unsent.

        While the client reads too little of the answer, the write is bounded by the
        stream's :class:`WriteWatch` (for gRPC, ``body_timeout_s``: admission's sweep), from
        the moment the writer first waits until ``ANSWER_PROGRESS_BYTES`` (or the rest) have
        been sent: a client that lets a byte through now and then does not keep the call
        open."""
        view = memoryview(data)
        began: WriteWatch | None = None
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
                    self.write(head + frame(Frame.DATA, 0, stream.id, chunk))
                    self.earned += 2
                    head = b""
                    progress += allowed
                    if began is not None and progress >= ANSWER_PROGRESS_BYTES:
                        began.write_ended()
                        began = None
                    continue
                if head:
                    self.write(head)
                    head = b""
                watch = stream.write_watch()
                if began is None and watch is not None and watch.writing_since is None:
                    began, progress = watch, 0
                    began.write_began()
                await self._window(stream, waited)
                waited = True
        finally:
            if began is not None:
                began.write_ended()
            self._wake_next()  # what window is left is the next writer's


def wake(stream: S) -> None:
    """Wake the stream's writer waiting for window, if one waits."""
    waiter = stream.waiter
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
