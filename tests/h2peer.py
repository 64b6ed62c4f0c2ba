"""An HTTP/2 peer built from independent implementations: frames by ``hyperframe``, header
blocks by ``hpack`` (the packages the ``h2`` library is made of), never the server's own
``plugserve.server.transport.h2frames``. The conformance and attack tests, and the hostile
soak (``tests/benchmarks/hostile_h2.py``), speak to real servers through it, frame by frame,
as a hostile or careless client would; :class:`Attacker` reads in a thread while its owner
writes."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import hpack
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

INITIAL_WINDOW_SIZE = SettingsFrame.INITIAL_WINDOW_SIZE
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
SERVER_LIVE = "/inference.GRPCInferenceService/ServerLive"

# Error codes (RFC 9113 §7), as the tests name them.
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB

Headers = Sequence[tuple[str | bytes, str | bytes]]


def grpc_headers(
    path: str = MODEL_INFER, extra: Headers = ()
) -> list[tuple[str | bytes, str | bytes]]:
    """The request headers of a gRPC call, as a gRPC client sends them."""
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *extra,
    ]


def message(body: bytes, compressed: bool = False) -> bytes:
    """A gRPC length-prefixed message."""
    return bytes((1 if compressed else 0,)) + len(body).to_bytes(4, "big") + body


class Peer:
    """One HTTP/2 connection to ``port``, spoken frame by frame.

    Frames received are parsed as they are read (:meth:`read`); what a test asks about
    (GOAWAY, resets, header blocks, data) is collected as it comes.
    """

    def __init__(
        self,
        port: int,
        settings: dict[int, int] | None = None,
        preface: bool = True,
        timeout: float = 10.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.buffer = bytearray()
        self.next_stream = 1
        self.frames: list[Frame] = []
        self.goaway: GoAwayFrame | None = None
        self.resets: dict[int, int] = {}
        """Stream id to the error code of the RST_STREAM the server sent on it."""
        self.blocks: dict[int, list[list[tuple[bytes, bytes]]]] = {}
        """Stream id to the header blocks the server sent on it, decoded."""
        self.data: dict[int, bytearray] = {}
        self.ended: set[int] = set()
        """Streams the server ended (END_STREAM)."""
        self.closed = False
        self._continuing: tuple[int, bytearray, bool] | None = None
        if preface:
            frame = SettingsFrame(0, settings=settings or {})
            self.sock.sendall(PREFACE + frame.serialize())

    # -- out ------------------------------------------------------------------------------

    def send(self, *frames: Frame | bytes) -> None:
        """Send frames (or raw bytes) in one write; a server that has closed is noted."""
        out = b"".join(f if isinstance(f, bytes) else f.serialize() for f in frames)
        try:
            self.sock.sendall(out)
        except OSError:
            self.closed = True

    def open(self) -> int:
        stream = self.next_stream
        self.next_stream += 2
        return stream

    def block(self, headers: Headers) -> bytes:
        return self.encoder.encode(list(headers))

    def headers(
        self, stream: int, headers: Headers | None = None, end_stream: bool = False, **kw: object
    ) -> HeadersFrame:
        flags = ["END_HEADERS"] + (["END_STREAM"] if end_stream else [])
        frame = HeadersFrame(stream, self.block(headers or grpc_headers()), flags=flags)
        for key, value in kw.items():
            setattr(frame, key, value)
        return frame

    def call(self, body: bytes, path: str = MODEL_INFER, extra: Headers = ()) -> int:
        """A unary call in one HEADERS and one DATA frame; its stream id."""
        stream = self.open()
        self.send(
            self.headers(stream, grpc_headers(path, extra)),
            DataFrame(stream, message(body), flags=["END_STREAM"]),
        )
        return stream

    def settings(self, values: dict[int, int]) -> SettingsFrame:
        return SettingsFrame(0, settings=values)

    def ack_settings(self) -> None:
        self.send(SettingsFrame(0, flags=["ACK"]))

    def window_update(self, stream: int, increment: int) -> WindowUpdateFrame:
        return WindowUpdateFrame(stream, window_increment=increment)

    def ping(self, payload: bytes = b"12345678", ack: bool = False) -> PingFrame:
        return PingFrame(0, opaque_data=payload, flags=["ACK"] if ack else [])

    def rst(self, stream: int, code: int = CANCEL) -> RstStreamFrame:
        return RstStreamFrame(stream, error_code=code)

    def continuation(self, stream: int, block: bytes, end: bool = False) -> ContinuationFrame:
        return ContinuationFrame(stream, block, flags=["END_HEADERS"] if end else [])

    # -- in -------------------------------------------------------------------------------

    def read(self, seconds: float = 1.0, until: object = None) -> list[Frame]:
        """Read frames for up to ``seconds`` (stopping early once ``until(self)`` is true, or
        the server closes); the frames read."""
        deadline = time.monotonic() + seconds
        got: list[Frame] = []
        while not self.closed:
            if until is not None and until(self):  # type: ignore[operator]
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.sock.settimeout(min(left, 0.25))
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                self.closed = True
                break
            if not chunk:
                self.closed = True
                break
            self.buffer += chunk
            got += self._parse()
        return got

    def _parse(self) -> list[Frame]:
        got = []
        while len(self.buffer) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(bytes(self.buffer[:9])))
            if len(self.buffer) < 9 + length:
                break
            frame.parse_body(memoryview(bytes(self.buffer[9 : 9 + length])))
            del self.buffer[: 9 + length]
            self._note(frame)
            got.append(frame)
        self.frames += got
        return got

    def _note(self, frame: Frame) -> None:
        if isinstance(frame, GoAwayFrame):
            self.goaway = frame
        elif isinstance(frame, RstStreamFrame):
            self.resets[frame.stream_id] = frame.error_code
        elif isinstance(frame, HeadersFrame):
            self._continuing = (frame.stream_id, bytearray(frame.data), "END_STREAM" in frame.flags)
            if "END_HEADERS" in frame.flags:
                self._headers_done()
        elif isinstance(frame, ContinuationFrame) and self._continuing is not None:
            self._continuing[1].extend(frame.data)
            if "END_HEADERS" in frame.flags:
                self._headers_done()
        elif isinstance(frame, DataFrame):
            self.data.setdefault(frame.stream_id, bytearray()).extend(frame.data)
            if "END_STREAM" in frame.flags:
                self.ended.add(frame.stream_id)
        elif isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            self.ack_settings()

    def _headers_done(self) -> None:
        assert self._continuing is not None
        stream, block, end = self._continuing
        self._continuing = None
        decoded = [(bytes(n), bytes(v)) for n, v in self.decoder.decode(bytes(block), raw=True)]
        self.blocks.setdefault(stream, []).append(decoded)
        if end:
            self.ended.add(stream)

    # -- what the server said -----------------------------------------------------------

    def status(self, stream: int) -> int | None:
        """The grpc-status the server ended ``stream`` with (``None``: none yet)."""
        for block in self.blocks.get(stream, []):
            for name, value in block:
                if name == b"grpc-status":
                    return int(value)
        return None

    def header(self, stream: int, name: bytes) -> bytes | None:
        for block in self.blocks.get(stream, []):
            for key, value in block:
                if key == name:
                    return value
        return None

    def wait_goaway(self, seconds: float = 5.0) -> int | None:
        """The error code of the server's GOAWAY, read for up to ``seconds``."""
        self.read(seconds, until=lambda p: p.goaway is not None)
        return None if self.goaway is None else self.goaway.error_code

    def wait_closed(self, seconds: float = 5.0) -> bool:
        self.read(seconds, until=lambda p: p.closed)
        return self.closed

    def wait_stream(self, stream: int, seconds: float = 5.0) -> None:
        """Read until the server has ended or reset ``stream`` (or closed, or time is up)."""
        self.read(
            seconds,
            until=lambda p: stream in p.ended or stream in p.resets or p.goaway is not None,
        )

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def sent(frames: Iterable[Frame]) -> bytes:
    return b"".join(f.serialize() for f in frames)


def raw_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    """A frame written byte by byte (RFC 9113 §4.1), for what ``hyperframe`` will not build:
    a SETTINGS frame whose keys repeat, a frame of a type or length it refuses."""
    return (
        len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload
    )


def data_frames(
    stream: int, payload: bytes, end: bool = True, size: int = 16_384
) -> list[DataFrame]:
    """``payload`` in DATA frames of at most ``size`` bytes (the default largest frame), the
    last with END_STREAM if ``end``."""
    pieces = [payload[i : i + size] for i in range(0, len(payload), size)] or [b""]
    return [
        DataFrame(stream, piece, flags=["END_STREAM"] if end and i == len(pieces) - 1 else [])
        for i, piece in enumerate(pieces)
    ]


def frames_in(data: bytes) -> list[Frame]:
    """The whole frames in ``data``, parsed."""
    frames, view, position = [], memoryview(data), 0
    while len(data) - position >= 9:
        frame, length = Frame.parse_frame_header(view[position : position + 9])
        if len(data) - position - 9 < length:
            break
        frame.parse_body(view[position + 9 : position + 9 + length])
        frames.append(frame)
        position += 9 + length
    return frames


# -- attacking connections ----------------------------------------------------------------


def wait(until: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not until():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Attacker:
    """A :class:`Peer` whose frames are read in a thread (as a client reads what it is sent)
    while the test writes on a copy of its socket, so that a write never waits on a read."""

    def __init__(self, port: int, settings: dict[int, int] | None = None) -> None:
        self.peer = Peer(port, settings=settings)
        # The server's SETTINGS first: the peer acknowledges them from the reading thread.
        self.peer.read(5, until=lambda p: any(isinstance(f, SettingsFrame) for f in p.frames))
        self.out = self.peer.sock.dup()
        self.out.settimeout(5)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        self.peer.read(600, until=lambda p: self.done.is_set())

    def send(self, *frames: Frame | bytes) -> bool:
        """Frames (or bytes) in one write; false once the server has closed or stopped reading."""
        try:
            self.out.sendall(b"".join(f if isinstance(f, bytes) else f.serialize() for f in frames))
        except OSError:
            return False
        return True

    @property
    def over(self) -> bool:
        return self.peer.goaway is not None or self.peer.closed

    def ended(self, stream: int) -> bool:
        """Whether the server has ended ``stream`` (status, reset or GOAWAY)."""
        peer = self.peer
        return stream in peer.ended or stream in peer.resets or self.over

    def goaway(self, seconds: float = 5.0) -> int | None:
        """The error code of the server's GOAWAY, waited for ``seconds``."""
        wait(lambda: self.over, seconds)
        return None if self.peer.goaway is None else self.peer.goaway.error_code

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.out.close()
        self.peer.close()


def call_block(peer: Peer, path: str = MODEL_INFER, extra: Iterable[tuple[str, str]] = ()) -> bytes:
    """A call's header block, as the peer's encoder writes the next one."""
    return peer.block(grpc_headers(path, tuple(extra)))


def repeated_block(peer: Peer) -> bytes:
    """The header block of a ModelInfer call once its headers are in the dynamic table: the
    same few bytes for every call after (the first block is sent on a stream here)."""
    first = call_block(peer)
    peer.send(HeadersFrame(peer.open(), first, flags=["END_HEADERS"]))
    return call_block(peer)


def whole_call(stream: int, block: bytes, body: bytes, end: bool = True) -> bytes:
    """A call in one HEADERS and one DATA frame (END_STREAM if ``end``), serialized."""
    flags = ["END_STREAM"] if end else []
    headers = HeadersFrame(stream, block, flags=["END_HEADERS"])
    return headers.serialize() + DataFrame(stream, body, flags=flags).serialize()


class Window:
    """The server's flow-control windows toward an attacker's peer (its SETTINGS and
    WINDOW_UPDATE frames, as read), to upload large messages without overrunning them."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.seen = 0
        self.connection = 65_535
        self.initial = 65_535
        self.streams: dict[int, int] = {}

    def room(self, stream: int) -> int:
        for frame in self.peer.frames[self.seen :]:
            if isinstance(frame, SettingsFrame) and INITIAL_WINDOW_SIZE in frame.settings:
                value = frame.settings[INITIAL_WINDOW_SIZE]
                self.streams = {s: w + value - self.initial for s, w in self.streams.items()}
                self.initial = value
            elif isinstance(frame, WindowUpdateFrame):
                if frame.stream_id:
                    self.streams[frame.stream_id] = (
                        self.streams.get(frame.stream_id, self.initial) + frame.window_increment
                    )
                else:
                    self.connection += frame.window_increment
        self.seen = len(self.peer.frames)
        return min(self.connection, self.streams.setdefault(stream, self.initial))


def upload(attacker: Attacker, bodies: dict[int, memoryview], end: bool, deadline: float) -> None:
    """Each stream's body in DATA frames of at most 16 KiB as the server's windows allow, the
    streams in turn (one the server ends is dropped), until all is sent or ``deadline``."""
    window = Window(attacker.peer)
    sent = dict.fromkeys(bodies, 0)
    while sent and time.monotonic() < deadline and not attacker.over:
        moved = False
        for stream in list(sent):
            body = bodies[stream]
            if attacker.ended(stream):
                del sent[stream]
                continue
            size = min(window.room(stream), 16_384, len(body) - sent[stream])
            if size <= 0:
                continue
            last = end and sent[stream] + size == len(body)
            chunk = body[sent[stream] : sent[stream] + size]
            if not attacker.send(DataFrame(stream, chunk, flags=["END_STREAM"] if last else [])):
                return
            window.connection -= size
            window.streams[stream] -= size
            sent[stream] += size
            moved = True
            if sent[stream] == len(body):
                del sent[stream]
        if not moved:
            time.sleep(0.005)


def silent_calls(attacker: Attacker, count: int) -> list[int]:
    """``count`` ModelInfer calls opened (HEADERS without END_STREAM) that send nothing more."""
    block = repeated_block(attacker.peer)
    streams = [attacker.peer.open() for _ in range(count)]
    attacker.send(*[HeadersFrame(s, block, flags=["END_HEADERS"]) for s in streams])
    return streams
