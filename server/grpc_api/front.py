"""The native gRPC engine (``grpc_engine = "native"``, the default): gRPC calls over the
HTTP/2 engine of ``plugserve.server.transport`` (``h2connection.py``), on the event loop's
own thread.

grpc.aio runs each call through gRPC's C core, its poller thread and several
Cython coroutines: about 200 µs of CPU a call here before any of plugserve's
code (docs/performance.md). This server reads the HTTP/2 frames of its
connections itself (an :class:`asyncio.Protocol`, as the HTTP fast path does) and
calls the same servicer methods (``service.py``) with each call's :class:`Stream` as the
context (it offers what they use of grpc.aio's, ``stream.py``), under the same call admission
(:class:`plugserve.server.grpc_api.admission.Admission`): a unary call runs as one
task once its message is in, and its answer leaves in one write.

What it keeps of gRPC over HTTP/2: ``grpc-timeout`` as the call's deadline; gzip and deflate
request messages; a stream's window given back as its messages are taken, so a client that
floods a stream waits; ``grpc-status`` trailers; metadata past ``MAX_HEADER_LIST_SIZE``
refused ``RESOURCE_EXHAUSTED``. The connection (RFC 9113: settings, flow control, HPACK,
``PING``, ``GOAWAY``, ``RST_STREAM``, the flood bound, a malformed request resetting its own
stream, ``GOAWAY`` to a connection with no call for ``grpc_idle_timeout_s``) is the
transport's. Messages are read off the event loop when large or compressed, within the
process's byte budget (``server/http/budget.py``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from plugserve.server.grpc_api.admission import Admission
from plugserve.server.grpc_api.handlers import Method, Reader, Unparsed
from plugserve.server.grpc_api.stream import UNAVAILABLE_STOPPING, Stream, drop_buffers, requests
from plugserve.server.grpc_api.wire import RESPONSE_START, timeout_seconds, trailers
from plugserve.server.http.startup import bind
from plugserve.server.transport.h2connection import H2Connection, H2Limits
from plugserve.server.transport.h2flow import CONNECTION_WINDOW, STREAM_WINDOW
from plugserve.server.transport.h2frames import END_STREAM, Error, rst_stream, window_update
from plugserve.server.transport.h2heads import MAX_HEADER_LIST, Head
from plugserve.server.transport.h2streams import CLIENT_ENDED, REFUSED_HEAD_BYTES, SERVER_ENDED


class Calls:
    """The gRPC calls of one HTTP/2 connection (its :class:`CallHandler`): each request head
    opened as a call, its messages read, its behaviour started, and what it holds let go."""

    __slots__ = ("connection", "server")

    def __init__(self, connection: H2Connection[Stream], server: NativeServer) -> None:
        self.connection = connection
        self.server = server

    def open(self, stream_id: int, flags: int, head: Head) -> None:
        connection = self.connection
        ended = CLIENT_ENDED if flags & END_STREAM else SERVER_ENDED
        if head.size > MAX_HEADER_LIST:
            connection.flooding(1 + head.size // REFUSED_HEAD_BYTES)
            connection.write_headers(
                stream_id,
                RESPONSE_START
                + trailers(
                    grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                    f"the call's metadata is {head.size} bytes, more than "
                    f"MAX_HEADER_LIST_SIZE = {MAX_HEADER_LIST}",
                    (),
                ),
                True,
            )
            if not flags & END_STREAM:
                connection.write(rst_stream(stream_id, Error.NO_ERROR))
            connection.remember_closed(stream_id, ended)
            return
        if head.method != b"POST":
            connection.write_headers(stream_id, b"\x08\x03405", True)  # :status 405, indexed name
            connection.remember_closed(stream_id, ended)
            return
        content_type = head.content_type
        if content_type is None or not content_type.startswith(b"application/grpc"):
            connection.write_headers(stream_id, b"\x08\x03415", True)  # :status 415, indexed name
            connection.remember_closed(stream_id, ended)
            return
        self._call(stream_id, flags, head)

    def _call(self, stream_id: int, flags: int, head: Head) -> None:
        path, timeout, encoding = head.path, head.timeout, head.encoding
        assert path is not None  # a well-formed head has one
        server = self.server
        served = server.methods.get(path.decode("latin-1"))
        if served is None:
            served = server.unknown
        stream = Stream(self.connection, stream_id, served, server.reader)
        stream.remote_closed = bool(flags & END_STREAM)  # a refusal below sends no reset
        stream.metadata = head.metadata
        stream.expected = head.length
        self.connection.add(stream)
        if timeout is not None:
            seconds = timeout_seconds(timeout.decode("latin-1"))
            if seconds is None:
                stream.finish(grpc.StatusCode.INTERNAL, "malformed grpc-timeout")
                return
            stream.deadline = time.monotonic() + seconds
            stream.deadline_timer = asyncio.get_running_loop().call_later(
                seconds, self._deadline, stream
            )
        if encoding is not None and encoding != b"identity":
            if encoding not in (b"gzip", b"deflate"):
                stream.finish(
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"grpc-encoding {encoding.decode('latin-1')!r} is not supported",
                )
                return
            stream.encoding = encoding.decode("latin-1")
        if served is server.unknown:
            stream.finish(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            return
        tracked = server.admission.admit(
            served.path, stream, served.client_streaming, served.server_streaming
        )
        if isinstance(tracked, str):
            stream.trailing = (("retry-after", "1"),)
            stream.finish(grpc.StatusCode.RESOURCE_EXHAUSTED, tracked)
            return
        stream.tracked = tracked
        if served.client_streaming:
            stream.messages = asyncio.Queue()
            self._start(stream, requests(stream))
        if flags & END_STREAM:
            self.remote_end(stream)

    def _deadline(self, stream: Stream) -> None:
        stream.deadline_timer = None
        if stream.id in self.connection.streams and not stream.status_sent:
            stream.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def receive(self, stream: Stream, data: bytes, size: int, end: bool) -> None:
        connection = self.connection
        stream.data += data
        if stream.messages is None:  # unary: the message is bounded by max_body_bytes
            received = len(stream.data)
            declared = int.from_bytes(stream.data[1:5], "big") if received >= 5 else 0
            if declared > self.server.max_message or received > self.server.max_message + 5:
                connection.give_back(size)
                self._too_large(stream, max(declared, received - 5))
                return
            connection.give_back(size)
            if not end and not stream.hold():
                return
            stream.owed += size  # the stream's window, given back for a large message
            if stream.owed >= STREAM_WINDOW // 2:
                connection.write(window_update(stream.id, stream.owed))
                stream.owed = 0
        else:
            stream.owed += size
            self._parse_messages(stream)
            if stream.id not in connection.streams or not stream.hold():
                return
            stream.settle()
        if end:
            self.remote_end(stream)

    def _too_large(self, stream: Stream, size: int) -> None:
        limit = self.server.max_message
        stream.finish(
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
            stream.finish(grpc.StatusCode.INTERNAL, "a compressed message without grpc-encoding")
            return None
        return Unparsed(body, stream.encoding)

    def remote_end(self, stream: Stream) -> None:
        """The client has sent all of the call."""
        stream.remote_closed = True
        if stream.messages is not None:
            stream.messages.put_nowait(None)
            return
        if stream.status_sent or stream.task is not None:
            return
        data = stream.data
        if not data:
            stream.finish(grpc.StatusCode.INVALID_ARGUMENT, "the call sent no request")
            return
        if len(data) < 5 or int.from_bytes(data[1:5], "big") != len(data) - 5:
            stream.finish(grpc.StatusCode.INTERNAL, "the request is not one whole message")
            return
        request = self._message(stream, data[0], bytes(data[5:]))
        data.clear()
        if request is None:
            return
        if stream.tracked is not None:
            stream.tracked.request_arrived()
        self._start(stream, request)

    def _start(self, stream: Stream, request: Any) -> None:
        stream.task = asyncio.get_running_loop().create_task(stream.serve(request))

    def reset(self, stream: Stream) -> None:
        if stream.task is not None:
            stream.task.cancel()

    def forget(self, stream: Stream) -> None:
        drop_buffers(stream)
        stream.unhold()
        if stream.deadline_timer is not None:
            stream.deadline_timer.cancel()
        if stream.messages is not None and stream.owed:
            self.connection.give_back(stream.owed)  # the connection's share; the stream is gone
        stream.release()
        stream.task = None  # its frames refer to the stream: no cycle left behind

    def drop(self, stream: Stream) -> None:
        if stream.deadline_timer is not None:
            stream.deadline_timer.cancel()
        drop_buffers(stream)
        stream.unhold()
        stream.release()
        if stream.task is not None:
            stream.task.cancel()
            stream.task = None


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
        self.limits = H2Limits(self.connection_window, handshake_timeout_s, idle_timeout_s)
        self.connections: set[H2Connection[Stream]] = set()
        self.listener: asyncio.AbstractServer | None = None

    def _connection(self) -> H2Connection[Stream]:
        return H2Connection(self.limits, self.connections, lambda c: Calls(c, self))

    async def start(self, host: str, port: int, shared: bool) -> None:
        """Listen on ``host:port``, the port ``shared`` with the other workers or not
        (:class:`ConfigError` if it cannot be had)."""
        sock = bind(host, port, reuse_port=shared)
        sock.listen(1024)
        loop = asyncio.get_running_loop()
        self.listener = await loop.create_server(self._connection, sock=sock)

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
                stream.finish(grpc.StatusCode.UNAVAILABLE, UNAVAILABLE_STOPPING)
            connection.close()
        if self.listener is not None:
            await self.listener.wait_closed()
