"""What the HTTP/2 engine (``h2connection.py``) hands the protocol over it: each stream as an
:class:`H2Stream` (the protocol's call subclasses it), and each stream's events to the
connection's :class:`CallHandler`."""

from __future__ import annotations

import asyncio
from typing import Protocol, TypeVar

from plugserve.server.transport.h2heads import Head


class WriteWatch(Protocol):
    """What bounds an answer's wait for the client's window: told when the wait begins, and
    when it ends (enough of the answer sent, or the answer over)."""

    @property
    def writing_since(self) -> float | None: ...

    def write_began(self) -> None: ...

    def write_ended(self) -> None: ...


class H2Stream:
    """One stream as HTTP/2 sees it: its id, how its sides are closed, its send window and
    its answer's writer waiting for window."""

    __slots__ = (
        "credit",
        "expected",
        "id",
        "remote_closed",
        "reset",
        "starved",
        "status_sent",
        "waiter",
    )

    def __init__(self, stream_id: int) -> None:
        self.id = stream_id
        self.expected: int | None = None
        """The DATA bytes still to come, as ``content-length`` declared (``None``: none did)."""
        self.credit = 0
        """The stream's send window less the client's ``INITIAL_WINDOW_SIZE`` (the window
        is :meth:`FlowControl.window_of`): a change of that setting is one assignment, not a
        change to every open stream."""
        self.waiter: asyncio.Future[None] | None = None
        """The answer's writer waiting for window, if it waits."""
        self.starved = 0
        """Nonzero while the writer waits for the stream's own window: its entry in the
        connection's queue of such streams (``FlowControl.starved``)."""
        self.remote_closed = False
        self.reset = False
        self.status_sent = False
        """The server has ended its side of the stream."""

    def write_watch(self) -> WriteWatch | None:
        """What bounds the answer's wait for window, if anything does."""
        return None


S = TypeVar("S", bound=H2Stream)
S_contra = TypeVar("S_contra", bound=H2Stream, contravariant=True)


class CallHandler(Protocol[S_contra]):
    """The protocol over one HTTP/2 connection: what it is told of its streams. It opens a
    stream (:meth:`H2Connection.add`) for the request heads it serves, and answers through
    the connection (``write_headers``, ``send``, ``done``)."""

    def open(self, stream_id: int, flags: int, head: Head) -> None:
        """A well-formed request head on a new stream the connection can take."""

    def receive(self, stream: S_contra, data: bytes, size: int, end: bool) -> None:
        """DATA on an open stream (``data`` unpadded, ``size`` as the window counts it);
        ``end``: the client's side ends with it."""

    def remote_end(self, stream: S_contra) -> None:
        """The client has sent all of the stream (its trailers)."""

    def reset(self, stream: S_contra) -> None:
        """The stream was reset (by either side): its work stops."""

    def forget(self, stream: S_contra) -> None:
        """The stream is closed and no longer the connection's: what it holds is let go."""

    def drop(self, stream: S_contra) -> None:
        """The connection is gone or ends for an error: the stream ends at once."""
