"""What the native engine keeps per call and does per frame, read inside its process: an
in-process :class:`NativeServer` on a loopback port, a method that answers at once, and a
client whose frames are built by ``hyperframe`` and ``hpack`` (tests/h2peer.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from typing import Any

import hpack
import pytest
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from plugserve.server.grpc_api.admission import Admission, CallLimits
from plugserve.server.grpc_api.front import NativeServer
from plugserve.server.grpc_api.handlers import Method, Reader
from plugserve.server.grpc_api.stream import Stream
from plugserve.server.http.budget import ByteBudget
from plugserve.server.transport.h2connection import H2Connection as Connection
from tests import h2peer

PATH = "/test.Echo/Call"
LARGE = "/test.Echo/Large"
ANSWER = b"a" * 4096


async def _answer(request: Any, context: Any) -> bytes:
    return ANSWER


async def _large(request: Any, context: Any) -> bytes:
    return b"b" * 100_000


@pytest.fixture
async def native() -> AsyncIterator[NativeServer]:
    async with serving(ByteBudget(8 << 20)) as server:
        yield server


@contextlib.asynccontextmanager
async def serving(budget: ByteBudget) -> AsyncIterator[NativeServer]:
    methods = [
        Method(path, "Bytes", lambda b: b, lambda m: m, behaviour, False, False)
        for path, behaviour in ((PATH, _answer), (LARGE, _large))
    ]
    admission = Admission(CallLimits(max_calls=10_000, idle_timeout_s=60, send_timeout_s=60))

    async def offload(work: Any) -> Any:
        return work()

    server = NativeServer(methods, admission, 1 << 20, 10.0, 60.0, Reader(1 << 20, offload, budget))
    await server.start("127.0.0.1", 0, False)
    try:
        yield server
    finally:
        await server.stop(0.1)


def port_of(server: NativeServer) -> int:
    assert server.listener is not None
    return int(server.listener.sockets[0].getsockname()[1])


class Client:
    """An asyncio client of one connection, its frames built by ``hyperframe`` and ``hpack``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = hpack.Encoder()
        self.next_stream = 1

    @classmethod
    async def connect(cls, port: int, settings: dict[int, int] | None = None) -> Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        settings = {4: 1 << 30, **(settings or {})}  # INITIAL_WINDOW_SIZE: answers flow
        writer.write(
            h2peer.PREFACE
            + SettingsFrame(0, settings=settings).serialize()
            + WindowUpdateFrame(0, window_increment=1 << 30).serialize()
        )
        return cls(reader, writer)

    def send(self, *frames: Frame) -> None:
        self.writer.write(b"".join(f.serialize() for f in frames))

    def call(self, *more: Frame, path: str = PATH) -> int:
        """A whole call (and ``more`` frames after it); its stream id."""
        stream = self.next_stream
        self.next_stream += 2
        block = self.encoder.encode(h2peer.grpc_headers(path))
        self.send(
            HeadersFrame(stream, block, flags=["END_HEADERS"]),
            DataFrame(stream, h2peer.message(b"x"), flags=["END_STREAM"]),
            *(DataFrame(stream, f.data) for f in more),
        )
        return stream

    def made_you_reset(self) -> int:
        """A whole call, then one DATA frame more on it: the server must reset the stream."""
        return self.call(DataFrame(1, b"y"))

    async def read(self, seconds: float) -> list[Frame]:
        """The frames the server sends within ``seconds`` (or until it closes)."""
        data = b""
        try:
            async with asyncio.timeout(seconds):
                while chunk := await self.reader.read(1 << 16):
                    data += chunk
        except (TimeoutError, ConnectionError):
            pass
        return h2peer.frames_in(data)


def alive(kind: type) -> int:
    return sum(isinstance(o, kind) for o in gc.get_objects())


async def test_an_ended_call_leaves_nothing_for_the_cycle_collector(
    native: NativeServer,
) -> None:
    """Calls reset by the server (MadeYouReset's frames, below the flood bound) and calls
    answered: once over, their streams are freed by reference counting alone."""
    client = await Client.connect(port_of(native))
    gc.collect()
    gc.disable()
    try:
        for _ in range(200):
            client.made_you_reset()
            client.call()
            await asyncio.sleep(0)
        await client.read(0.5)
        (connection,) = native.connections
        assert not connection.streams
        assert alive(Stream) == 0
    finally:
        gc.enable()
        client.writer.close()


async def test_made_you_reset_past_the_flood_bound_ends_the_connection(
    native: NativeServer,
) -> None:
    """Resets the server sends for the client's frames count as the client's own resets."""
    client = await Client.connect(port_of(native))
    for _ in range(1500):
        client.made_you_reset()
    frames = await client.read(5)
    goaways = [f for f in frames if isinstance(f, GoAwayFrame)]
    # A reset flood; or, once a call is answered before its late frame is read, a frame on a
    # closed stream (RFC 9113 §5.1): the connection ends either way.
    assert [f.error_code for f in goaways] in ([h2peer.ENHANCE_YOUR_CALM], [h2peer.STREAM_CLOSED])


async def test_a_window_update_wakes_only_the_writers_it_unblocks(
    native: NativeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 answers waiting for a window of 0: a one-byte connection update resumes one
    writer, an update on one stream resumes that stream's writer, and a larger
    INITIAL_WINDOW_SIZE resumes the writers it unblocks, not all of them each time."""
    resumed = 0
    wait = Connection._window

    async def counted(self: Connection, stream: Stream, again: bool) -> None:
        nonlocal resumed
        await wait(self, stream, again)
        resumed += 1

    monkeypatch.setattr(Connection, "_window", counted)
    client = await Client.connect(port_of(native), {4: 0})  # INITIAL_WINDOW_SIZE 0
    streams = [client.call() for _ in range(200)]
    await asyncio.sleep(0.3)
    (connection,) = native.connections
    assert len(connection.starved) == 200 and resumed == 0
    client.send(WindowUpdateFrame(0, window_increment=1))  # no stream has window: no writer
    await asyncio.sleep(0.1)
    assert resumed == 0
    client.send(WindowUpdateFrame(streams[7], window_increment=100))
    await asyncio.sleep(0.1)
    assert resumed == 1
    client.send(SettingsFrame(0, settings={4: 1}))  # each stream one byte: all unblocked
    await asyncio.sleep(0.1)
    # The connection's window (65,535 less what went) lets them through one after another.
    assert 199 <= resumed - 1 <= 400
    before = resumed
    for _ in range(50):
        client.send(SettingsFrame(0, settings={4: 1}))  # no change: nobody wakes
    await asyncio.sleep(0.1)
    assert resumed == before
    client.writer.close()


async def test_calls_refused_for_the_byte_budget_give_the_connection_window_back() -> None:
    """Messages past the byte budget end their calls RESOURCE_EXHAUSTED; what their frames
    took of the connection's receive window is given back, so the connection goes on."""
    async with serving(ByteBudget(64 << 10)) as server:  # gRPC's share: 48 KiB
        client = await Client.connect(port_of(server))
        message = h2peer.message(bytes(200_000))
        for _ in range(20):
            stream = client.next_stream
            client.next_stream += 2
            client.send(
                HeadersFrame(stream, client.encoder.encode(h2peer.grpc_headers(PATH)),
                             flags=["END_HEADERS"]),
                *h2peer.data_frames(stream, message[:100_000], end=False),
            )  # fmt: skip
        frames = await client.read(0.5)
        statuses = [f for f in frames if isinstance(f, HeadersFrame)]
        assert len(statuses) == 20  # each refused (trailers-only)
        (connection,) = server.connections
        assert connection.receive_window + connection.receive_owed == server.connection_window
        assert server.budget.held["grpc"] == 0
        client.writer.close()


async def test_a_larger_window_wakes_a_writer_whose_credit_changed_while_it_waited() -> None:
    """A writer waits with its stream's window at 0; the client lowers INITIAL_WINDOW_SIZE to
    0 (window -65,535), gives the stream 40,000 (-25,535), then raises the setting to 30,000:
    the window is 4,465 and the writer sends that much."""
    async with serving(ByteBudget(8 << 20)) as server:
        client = await Client.connect(port_of(server), {4: 65_535})
        stream = client.call(path=LARGE)
        sent = sum(len(f.data) for f in await client.read(0.3) if isinstance(f, DataFrame))
        assert sent == 65_535
        client.send(SettingsFrame(0, settings={4: 0}))
        client.send(WindowUpdateFrame(stream, window_increment=40_000))
        await asyncio.sleep(0.1)
        client.send(SettingsFrame(0, settings={4: 30_000}))
        more = sum(len(f.data) for f in await client.read(0.3) if isinstance(f, DataFrame))
        assert more == 4_465
        client.writer.close()
