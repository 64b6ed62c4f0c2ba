"""A call of the native gRPC engine (``front.py``) on its HTTP/2 stream, which is also the
context its servicer method gets: the request read, the behaviour run, the answer and the
status written through the stream's connection."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog

from plugserve.server.grpc_api.admission import CURRENT_CALL, TrackedCall
from plugserve.server.grpc_api.calls import MAX_DETAILS
from plugserve.server.grpc_api.handlers import Method, Reader, Undecodable, Unparsed, parsed
from plugserve.server.grpc_api.wire import RESPONSE_START, STATUS_OK, message_frame, trailers
from plugserve.server.transport.h2calls import H2Stream, WriteWatch
from plugserve.server.transport.h2connection import H2Connection
from plugserve.server.transport.h2flow import STREAM_WINDOW
from plugserve.server.transport.h2frames import END_HEADERS, Frame, frame

log = structlog.get_logger("plugserve.grpc")

UNAVAILABLE_STOPPING = "the server is stopping"
DEADLINE_SLACK_S = 0.002
"""How near its deadline a call whose handler stopped counts as ended by it (as grpc.aio's,
``service.DEADLINE_SLACK_S``)."""


class Aborted(grpc.aio.AbortError):  # type: ignore[misc]
    """A call's status, set by :meth:`Stream.abort`."""


class Stream(H2Stream):
    """One call: its request bytes, its task, its windows and its status; and what the
    servicer methods use of grpc.aio's ``ServicerContext`` (the stream is the call's context,
    so that an ended call leaves no reference cycle for the collector to find)."""

    __slots__ = (
        "code",
        "connection",
        "data",
        "deadline",
        "deadline_timer",
        "details",
        "encoding",
        "headers_sent",
        "held",
        "messages",
        "metadata",
        "method",
        "owed",
        "queued",
        "reader",
        "task",
        "tracked",
        "trailing",
    )

    def __init__(
        self, connection: H2Connection[Stream], stream_id: int, method: Method, reader: Reader
    ) -> None:
        super().__init__(stream_id)
        self.connection = connection
        self.method = method
        self.reader = reader
        """Reads large and compressed messages off the event loop (the body threads)."""
        self.metadata: tuple[tuple[str, str | bytes], ...] = ()
        self.deadline: float | None = None
        self.deadline_timer: asyncio.TimerHandle | None = None
        self.encoding = "identity"
        self.data = bytearray()
        self.held = 0
        """Bytes of ``data`` counted against the process's byte budget."""
        self.messages: asyncio.Queue[Any] | None = None
        self.queued = 0
        """Bytes of a streaming call's messages that its handler has not taken yet."""
        self.owed = 0
        """Bytes received on the stream whose window is not given back yet."""
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
            self.finish(ended.code, ended.message)
        return True

    def write_watch(self) -> WriteWatch | None:
        """Admission's record of the call: it bounds the answer's wait for window."""
        return self.tracked

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
        await self.send_message(self.method.serialize(message))

    def done(self) -> bool:
        return self.status_sent or self.reset

    # -- the call ----------------------------------------------------------------------

    async def serve(self, request: Any) -> None:
        """Run the call's behaviour; send its answer, or its status."""
        CURRENT_CALL.set(self.tracked)
        method = self.method
        code, details = grpc.StatusCode.OK, ""
        answer = None
        try:
            if isinstance(request, Unparsed | Undecodable):
                request = await parsed(method, request, self, self.reader)
            if self.messages is None:
                self.unhold()  # the message is parsed: its bytes are the request's now
            answer = await method.behaviour(request, self)
        except Aborted:
            code, details = self.code or grpc.StatusCode.UNKNOWN, self.details
        except asyncio.CancelledError:
            if self.reset or self.status_sent:
                return
            ended = self.tracked.ended if self.tracked is not None else None
            if ended is not None:
                code, details = ended.code, ended.message
            elif (remaining := self.time_remaining()) is not None and remaining < DEADLINE_SLACK_S:
                code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
            else:
                code, details = grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_STOPPING
        except Exception as exc:
            log.exception("grpc_handler_failed", method=method.path, error=type(exc).__name__)
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected error: {type(exc).__name__}"
        if self.reset or self.status_sent:
            return
        if code is grpc.StatusCode.OK and not method.server_streaming:
            try:
                message = method.serialize(answer)
            except Exception as exc:
                log.exception("grpc_answer_not_serialized", method=method.path)
                self.finish(grpc.StatusCode.INTERNAL, f"the answer: {type(exc).__name__}")
                return
            try:
                await self.send_message(message, last=True)
            except ConnectionResetError:
                pass  # the call ended meanwhile
            except asyncio.CancelledError:
                # Ended by admission's sweep: its client read none of the answer for
                # body_timeout_s. The status is not flow-controlled: it goes at once.
                ended = self.tracked.ended if self.tracked is not None else None
                if ended is None or self.reset or self.status_sent:
                    raise
                self.finish(ended.code, ended.message)
            return
        self.finish(code, details)

    async def send_message(self, message: bytes, last: bool = False) -> None:
        """One message on the stream (its headers first, if not yet sent); with ``last``, the
        OK status after it. Waits for the client's windows, and for the transport."""
        connection = self.connection
        data = message_frame(message)
        head = b""
        if not self.headers_sent:
            head = frame(Frame.HEADERS, END_HEADERS, self.id, connection.block(RESPONSE_START))
            self.headers_sent = True
        if self.reset or self.status_sent or connection.closed():
            raise ConnectionResetError("the call is over")
        await connection.send(self, data, head, self._status_block(0, "") if last else None)
        if last:
            connection.done(self)

    def _status_block(self, code: int, details: str) -> bytes:
        trailing = self.trailing
        if code == 0 and not trailing:
            return STATUS_OK
        if len(details) > MAX_DETAILS:
            details = details[: MAX_DETAILS - 3] + "..."
        return trailers(code, details, trailing)

    def finish(self, code: grpc.StatusCode, details: str) -> None:
        """Send the call's status (in a trailers-only answer if nothing was sent) and end it."""
        if self.status_sent or self.reset:
            return
        block = self._status_block(code.value[0], details)
        if not self.headers_sent:
            block = RESPONSE_START + block
            self.headers_sent = True
        self.connection.write_headers(self.id, block, True)
        task = self.task
        self.connection.done(self)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    # -- what the call holds ------------------------------------------------------------

    def hold(self) -> bool:
        """Count what the stream holds of requests (a message still arriving, messages its
        handler has not taken) against the process's byte budget; ``False``, the call ended
        ``RESOURCE_EXHAUSTED``, past it."""
        held = len(self.data) + self.queued
        more = held - self.held
        budget = self.reader.budget
        if more > 0 and not budget.take("grpc", more):
            self.finish(grpc.StatusCode.RESOURCE_EXHAUSTED, budget.refusal())
            return False
        if more < 0:
            budget.give("grpc", -more)
        self.held = held
        return True

    def unhold(self) -> None:
        if self.held:
            self.reader.budget.give("grpc", self.held)
            self.held = 0

    def consumed(self, size: int) -> None:
        """A streaming call's handler took a message of ``size`` bytes."""
        self.queued -= size
        if self.id in self.connection.streams:
            self.hold()
        self.settle()

    def settle(self) -> None:
        """A streaming call's window back to its client while its handler keeps up (at most
        a stream window of messages waiting for it); held back while it does not, so that
        a client that floods a stream waits. A message in pieces always gets its window:
        its size is bounded by ``max_body_bytes``."""
        if (
            self.owed >= STREAM_WINDOW // 4
            and self.queued <= STREAM_WINDOW
            and self.id in self.connection.streams
        ):
            owed, self.owed = self.owed, 0
            self.connection.give_back(owed, None if self.remote_closed else self)

    def release(self) -> None:
        tracked = self.tracked
        if tracked is not None:
            tracked.release()
            self.tracked = None  # it refers to the stream (its task): no cycle left behind


async def requests(stream: Stream) -> AsyncIterator[Any]:
    """A streaming call's request messages as they come; ``INVALID_ARGUMENT`` for one that
    does not parse."""
    queue = stream.messages
    assert queue is not None
    while True:
        item = await queue.get()
        if item is None:
            return
        message, size = item
        stream.consumed(size)
        if isinstance(message, Unparsed | Undecodable):
            message = await parsed(stream.method, message, stream, stream.reader)
        yield message


def drop_buffers(stream: Stream) -> None:
    """What an ended stream received and nobody will read: freed now, not when its handler's
    task lets go of the stream."""
    stream.data.clear()
    queue = stream.messages
    if queue is not None:
        while not queue.empty():
            queue.get_nowait()
        queue.put_nowait(None)  # a handler still reading finds the end
