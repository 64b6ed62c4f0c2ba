"""HTTP/2 conformance (RFC 9113), rule by rule as h2spec checks them, against a real server
on whichever gRPC engine the tests run (``PLUGSERVE_TEST_GRPC_ENGINE``). The client is made
of independent parts (``tests.h2peer``: hyperframe frames, hpack blocks); each test sends what
a rule is about, often wrong on purpose, and asserts what RFC 9113 requires in answer.

A stream error may come as a connection error (§5.4.1 allows it), but for malformed requests
(§8): their connection and its other calls live on. A connection error is a GOAWAY with its
code, or a close without one (GOAWAY is a SHOULD) but in §5.4.1's own test. Where gRPC's C core
(the grpcio engine) does otherwise, the test is skipped on that engine, saying what it does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hyperframe import frame as hf
from hyperframe.frame import DataFrame, SettingsFrame
from tritonclient.grpc import service_pb2

from tests.h2peer import MODEL_INFER, PREFACE, Headers, Peer, grpc_headers, message
from tests.helpers import ServerProcess, grpc_engine, write_add_runner

pytestmark = pytest.mark.slow

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PING, GOAWAY, WINDOW_UPDATE, CONTINUATION, UNKNOWN = 0x6, 0x7, 0x8, 0x9, 0x20
END_STREAM = ACK = 0x1
END_HEADERS, PADDED = 0x4, 0x8
PROTOCOL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR = 0x1, 0x3, 0x5, 0x6
REFUSED_STREAM, COMPRESSION_ERROR = 0x7, 0x9
INITIAL_WINDOW_SIZE = SettingsFrame.INITIAL_WINDOW_SIZE
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW, DEFAULT_FRAME_SIZE = 65_535, 16_384
CODES = {0: "NO_ERROR", 1: "PROTOCOL_ERROR", 2: "INTERNAL_ERROR", 3: "FLOW_CONTROL_ERROR",
         5: "STREAM_CLOSED", 6: "FRAME_SIZE_ERROR", 7: "REFUSED_STREAM", 8: "CANCEL",
         9: "COMPRESSION_ERROR", 11: "ENHANCE_YOUR_CALM"}  # fmt: skip
Connect = Callable[..., Peer]


def c_core(does: str) -> pytest.MarkDecorator:
    """Skipped on the grpcio engine, whose HTTP/2 is gRPC's C core: it ``does`` otherwise."""
    return pytest.mark.skipif(grpc_engine() == "grpcio", reason=f"gRPC's C core (grpcio) {does}")


C_CORE_PADDING = c_core("refuses padded DATA frames ('unsupported data flags'): RST_STREAM")
C_CORE_LENIENT = c_core("ignores the frame: no connection error")

# -- the server and its connections --------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the module, an ONNX ``add`` model on it (``y = x + 1``); calls are not
    capped below the advertised stream limit (``max_connections``)."""
    folder = tmp_path_factory.mktemp("conformance")
    write_add_runner(folder / "plugins", "add", "1.0.0")
    (folder / "models").mkdir()
    (folder / "plugserve.toml").write_text("max_connections = 10000\n")
    args = ("--plugins-dir", str(folder / "plugins"), "--models-dir", str(folder / "models"),
            "--config", str(folder / "plugserve.toml"))  # fmt: skip
    for attempt in range(3):  # front.py may be mid-change: a failed start is tried again
        proc = ServerProcess(*args, log=folder / f"server{attempt}.log")
        try:
            proc.wait_ready()
            break
        except (RuntimeError, TimeoutError):
            proc.stop()
            if attempt == 2:
                raise
    yield proc
    proc.stop()


@pytest.fixture
def connect(served: ServerProcess) -> Iterator[Connect]:
    """``connect(settings)``: a connection past the handshake (the server's SETTINGS read,
    ours acknowledged); ``connect(preface=False)``: a bare socket. Closed after the test."""
    peers: list[Peer] = []

    def open_(settings: dict[int, int] | None = None, preface: bool = True) -> Peer:
        peer = Peer(served.grpc_port, settings=settings, preface=preface, timeout=5.0)
        peers.append(peer)
        if preface:
            peer.read(3.0, until=lambda p: server_settings(p) is not None and acks(p) >= 1)
            assert server_settings(peer) is not None and acks(peer) >= 1, "no handshake"
        return peer

    yield open_
    for peer in peers:
        peer.close()


def raw(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """A frame as bytes, whatever its type, flags or length."""
    head = len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big")
    return head + payload


def server_settings(peer: Peer) -> dict[int, int] | None:
    frames = [f for f in peer.frames if isinstance(f, SettingsFrame) and "ACK" not in f.flags]
    return dict(frames[0].settings) if frames else None


def acks(peer: Peer) -> int:
    return sum(isinstance(f, SettingsFrame) and "ACK" in f.flags for f in peer.frames)


def pongs(peer: Peer) -> list[bytes]:
    return [bytes(f.opaque_data) for f in peer.frames if isinstance(f, hf.PingFrame) and "ACK" in f.flags]  # fmt: skip


def first_reset(peer: Peer, stream: int) -> int | None:
    codes = [f.error_code for f in peer.frames if isinstance(f, hf.RstStreamFrame) and f.stream_id == stream]  # fmt: skip
    return int(codes[0]) if codes else None


def name(code: int | None) -> str:
    return "none" if code is None else CODES.get(code, hex(code))


def seen(peer: Peer, stream: int | None = None) -> str:
    """What the server did, for a failure's message."""
    parts = [f"GOAWAY {name(peer.goaway.error_code)}" if peer.goaway else "no GOAWAY",
             "closed" if peer.closed else "open"]  # fmt: skip
    if stream is not None:
        parts += [f"stream {stream}: RST_STREAM {name(first_reset(peer, stream))}",
                  f"grpc-status {peer.status(stream)}", f":status {peer.header(stream, b':status')!r}"]  # fmt: skip
    return ", ".join(parts)


def connection_error(peer: Peer, code: int, seconds: float = 2.0) -> None:
    """§5.4.1: a GOAWAY with ``code`` (or, at least, the connection closed)."""
    peer.read(seconds, until=lambda p: p.goaway is not None or p.closed)
    if peer.goaway is not None:
        assert peer.goaway.error_code == code, f"expected GOAWAY {name(code)}; {seen(peer)}"
    else:
        assert peer.closed, f"expected a connection error {name(code)}; {seen(peer)}"


def stream_error(peer: Peer, stream: int, code: int) -> None:
    """§5.4.2: RST_STREAM ``code`` on ``stream``, or a connection error of that code (§5.4.1)."""
    peer.read(2.0, until=lambda p: first_reset(p, stream) is not None or p.goaway or p.closed)
    if first_reset(peer, stream) is None and (peer.goaway is not None or peer.closed):
        return connection_error(peer, code)
    assert first_reset(peer, stream) == code, f"expected RST_STREAM {name(code)}; {seen(peer, stream)}"  # fmt: skip


def alive(peer: Peer, payload: bytes = b"alive?!!") -> None:
    """The connection lives: a PING is answered, no GOAWAY came."""
    peer.send(raw(PING, 0, 0, payload))
    peer.read(3.0, until=lambda p: payload in pongs(p) or p.closed)
    assert payload in pongs(peer) and peer.goaway is None, f"connection gone; {seen(peer)}"


def add_message(rows: int = 1, request_id: str = "") -> bytes:
    request = service_pb2.ModelInferRequest(model_name="add", id=request_id)
    request.inputs.add(name="x", datatype="FP32", shape=[rows, 4])
    request.raw_input_contents.append(np.ones((rows, 4), np.float32).tobytes())
    return bytes(request.SerializeToString())


def answered(peer: Peer, stream: int | None = None) -> None:
    """A valid call (``stream``'s, or a new one on the connection) ends ``grpc-status: 0``."""
    if stream is None:
        stream = peer.call(add_message())
    peer.wait_stream(stream)
    assert peer.status(stream) == 0, f"the call was not answered; {seen(peer, stream)}"


def body(stream: int, payload: bytes | None = None, end: bool = True) -> list[DataFrame]:
    """``payload`` (default: an ``add`` message) in DATA frames of at most 16384 octets."""
    payload = message(add_message()) if payload is None else payload
    pieces = [payload[i : i + DEFAULT_FRAME_SIZE] for i in range(0, len(payload), DEFAULT_FRAME_SIZE)]  # fmt: skip
    return [DataFrame(stream, p, flags=["END_STREAM"] if end and i == len(pieces) - 1 else [])
            for i, p in enumerate(pieces)]  # fmt: skip


def open_stream(peer: Peer) -> int:
    """A stream opened (HEADERS, no END_STREAM): the server waits for its message."""
    stream = peer.open()
    peer.send(peer.headers(stream))
    return stream


def frame_limit(peer: Peer) -> int:
    """The server's SETTINGS_MAX_FRAME_SIZE; past the default window, not tried (too heavy)."""
    limit = (server_settings(peer) or {}).get(SettingsFrame.MAX_FRAME_SIZE, DEFAULT_FRAME_SIZE)
    if limit >= DEFAULT_WINDOW:
        pytest.skip(f"the server takes frames of {limit} octets: too large to send here")
    return limit


def received(peer: Peer, stream: int | None = None) -> int:
    """Flow-controlled octets of DATA received (on ``stream``, or on all)."""
    return sum(f.flow_controlled_length for f in peer.frames
               if isinstance(f, DataFrame) and stream in (None, f.stream_id))  # fmt: skip


# -- §3.4 the connection preface -----------------------------------------------------------


def test_server_preface_starts_with_settings(connect: Connect) -> None:
    """§3.4: the server's connection preface is a SETTINGS frame, the first it sends."""
    peer = connect()
    assert isinstance(peer.frames[0], SettingsFrame) and "ACK" not in peer.frames[0].flags


@pytest.mark.parametrize(
    "start",
    [b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n" + raw(SETTINGS, 0, 0), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
     PREFACE + raw(PING, 0, 0, b"12345678")],
    ids=["mangled-preface", "http1", "ping-before-settings"],
)  # fmt: skip
def test_invalid_preface_is_a_connection_error(connect: Connect, start: bytes) -> None:
    """§3.4: an invalid connection preface, or one not followed by a SETTINGS frame, is a
    connection error PROTOCOL_ERROR."""
    peer = connect(preface=False)
    peer.send(start)
    connection_error(peer, PROTOCOL_ERROR, seconds=3.0)


# -- §4 frames, §5.5 extensions ---------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [raw(UNKNOWN, 0, 0, b"extension"), raw(UNKNOWN, 0xFF, 1, b"x"),
     pytest.param(raw(PING, 0xFE, 0, b"flags..."), marks=c_core("closes the connection on a PING with flags it does not define")),
     raw(PING, 0, 0x80000000, b"reserved")],
    ids=["unknown-type", "unknown-type-on-idle-stream", "unknown-flags", "reserved-bit"],
)  # fmt: skip
def test_unknown_types_flags_and_reserved_bit_are_ignored(connect: Connect, frame: bytes) -> None:
    """§4.1, §5.5: frames of unknown types are ignored, so are flags a frame type does not
    define and the reserved bit of the stream identifier."""
    peer = connect()
    peer.send(frame)
    alive(peer)
    if frame[3] == PING:  # the PING itself is answered, with its own payload
        assert frame[9:] in pongs(peer), seen(peer)
    answered(peer)


def test_extension_frames_among_a_calls_frames_are_ignored(connect: Connect) -> None:
    """§5.5: frames of unknown types between a call's frames are ignored: it is answered."""
    peer = connect()
    stream = peer.open()
    peer.send(raw(UNKNOWN, 0, stream, b"x"), peer.headers(stream), raw(UNKNOWN, 0x3, stream),
              *body(stream), raw(UNKNOWN, 0, 0))  # fmt: skip
    answered(peer, stream)


def test_a_frame_of_max_frame_size_is_taken(connect: Connect) -> None:
    """§4.2: a frame of exactly SETTINGS_MAX_FRAME_SIZE's default, 16384 octets, is valid: a
    call whose message fills one such DATA frame is answered."""
    peer = connect()
    full = next(b for k in range(99) if len(b := message(add_message(1020, "i" * k))) == DEFAULT_FRAME_SIZE)  # fmt: skip
    stream = peer.open()
    peer.send(peer.headers(stream), DataFrame(stream, full, flags=["END_STREAM"]))
    answered(peer, stream)


def test_data_over_max_frame_size_is_a_frame_size_error(connect: Connect) -> None:
    """§4.2: a DATA frame over SETTINGS_MAX_FRAME_SIZE is a FRAME_SIZE_ERROR (stream or
    connection error)."""
    peer = connect()
    limit, stream = frame_limit(peer), open_stream(peer)
    peer.send(raw(DATA, END_STREAM, stream, bytes(limit + 1)))
    stream_error(peer, stream, FRAME_SIZE_ERROR)


def test_headers_over_max_frame_size_is_a_connection_error(connect: Connect) -> None:
    """§4.2: a frame carrying a field block, over SETTINGS_MAX_FRAME_SIZE, is a connection
    error FRAME_SIZE_ERROR."""
    peer = connect()
    limit = frame_limit(peer)
    block = peer.encoder.encode([*grpc_headers(), ("x-big", "a" * limit)], huffman=False)
    peer.send(raw(HEADERS, END_HEADERS | END_STREAM, 1, block))
    connection_error(peer, FRAME_SIZE_ERROR)


@pytest.mark.parametrize(
    "frame",
    [raw(SETTINGS, 0, 0, b"\x00\x03\x00"), raw(PING, 0, 0, b"1234567"), raw(PING, 0, 0, b"123456789"),
     raw(WINDOW_UPDATE, 0, 0, b"\x00\x00\x01"), raw(WINDOW_UPDATE, 0, 0, b"\x00\x00\x00\x01\x00"),
     raw(RST_STREAM, 0, 1, b"\x00\x00\x08")],
    ids=["settings-not-multiple-of-6", "ping-7", "ping-9", "window-update-3", "window-update-5", "rst-stream-3"],
)  # fmt: skip
def test_a_control_frame_of_wrong_length_is_a_frame_size_error(connect: Connect, frame: bytes) -> None:  # fmt: skip
    """§4.2, §6.4, §6.5, §6.7, §6.9: SETTINGS not a multiple of 6 octets, PING not 8,
    WINDOW_UPDATE or RST_STREAM not 4: a connection error FRAME_SIZE_ERROR."""
    peer = connect()
    if frame[3] == RST_STREAM:
        open_stream(peer)  # stream 1 is open: the length is what is wrong
    peer.send(frame)
    connection_error(peer, FRAME_SIZE_ERROR)


@c_core("ignores a PRIORITY frame of the wrong length")
def test_priority_of_wrong_length_is_a_frame_size_error(connect: Connect) -> None:
    """§6.3: a PRIORITY frame of a length other than 5 is a stream error FRAME_SIZE_ERROR."""
    peer = connect()
    stream = open_stream(peer)
    peer.send(raw(PRIORITY, 0, stream, bytes(4)))
    stream_error(peer, stream, FRAME_SIZE_ERROR)


@pytest.mark.parametrize(
    "block",
    [b"\x80", b"\xc6", b"\x3f\xe1\x7f"],  # index 0; index 70 (empty dynamic table); size 16384
    ids=["index-0", "index-past-table", "table-size-over-setting"],
)
def test_an_undecodable_header_block_is_a_compression_error(connect: Connect, block: bytes) -> None:
    """§4.3: a field block that cannot be decoded (RFC 7541: index 0, an index past the
    tables, a table size over SETTINGS_HEADER_TABLE_SIZE) is a connection error
    COMPRESSION_ERROR."""
    peer = connect()
    peer.send(raw(HEADERS, END_HEADERS | END_STREAM, 1, block))
    connection_error(peer, COMPRESSION_ERROR)


# -- §5.1 stream states, §5.1.1 identifiers, §5.1.2 concurrency -------------------------------


@pytest.mark.parametrize(
    "frame",
    [pytest.param(raw(DATA, END_STREAM, 1, b"x"), marks=C_CORE_LENIENT),
     pytest.param(raw(RST_STREAM, 0, 1, b"\x00\x00\x00\x08"), marks=C_CORE_LENIENT),
     pytest.param(raw(WINDOW_UPDATE, 0, 1, b"\x00\x00\x00\x01"), marks=C_CORE_LENIENT),
     raw(CONTINUATION, END_HEADERS, 1, b"\x82")],
    ids=["data", "rst-stream", "window-update", "continuation"],
)  # fmt: skip
def test_a_frame_on_an_idle_stream_is_a_protocol_error(connect: Connect, frame: bytes) -> None:
    """§5.1 (idle): a frame other than HEADERS or PRIORITY on an idle stream is a connection
    error PROTOCOL_ERROR."""
    peer = connect()
    peer.send(frame)
    connection_error(peer, PROTOCOL_ERROR)


@c_core("ignores frames after the client's END_STREAM or RST_STREAM: no STREAM_CLOSED")
@pytest.mark.parametrize("after", ["end-stream", "rst-stream"])
@pytest.mark.parametrize("kind", ["data", "headers"])
def test_a_frame_on_a_closed_side_is_stream_closed(connect: Connect, after: str, kind: str) -> None:  # fmt: skip
    """§5.1, §6.1: DATA or HEADERS after the client's END_STREAM (half-closed (remote), or
    closed once answered) or after its RST_STREAM (closed) is a stream (or connection) error
    STREAM_CLOSED."""
    peer = connect()
    stream = peer.open()
    late = (raw(DATA, END_STREAM, stream, b"late") if kind == "data"
            else peer.headers(stream, [("x-late", "1")], end_stream=True))  # fmt: skip
    first = [peer.headers(stream, end_stream=True)] if after == "end-stream" else [peer.headers(stream), peer.rst(stream)]  # fmt: skip
    peer.send(*first, late)
    stream_error(peer, stream, STREAM_CLOSED)


def test_window_update_on_a_half_closed_remote_stream_is_allowed(connect: Connect) -> None:
    """§5.1 (half-closed (remote)): WINDOW_UPDATE may still come: the call is answered."""
    peer = connect()
    stream = peer.open()
    peer.send(
        peer.headers(stream), *body(stream), hf.WindowUpdateFrame(stream, window_increment=1024)
    )
    answered(peer, stream)
    alive(peer)


@pytest.mark.parametrize(
    "streams",
    [pytest.param((2,), marks=c_core("ignores HEADERS on an even stream")),
     pytest.param((5, 3), marks=c_core("ignores HEADERS on a stream below one used"))],
    ids=["even", "lower-than-one-used"],
)  # fmt: skip
def test_a_bad_stream_id_is_a_protocol_error(connect: Connect, streams: tuple[int, ...]) -> None:
    """§5.1.1: streams a client opens have odd identifiers, each greater than all before it;
    HEADERS on stream 2, or on stream 3 after stream 5, is a connection error PROTOCOL_ERROR."""
    peer = connect()
    peer.send(*(peer.headers(s) for s in streams))
    connection_error(peer, PROTOCOL_ERROR)


def test_streams_past_max_concurrent_streams_are_refused(connect: Connect) -> None:
    """§5.1.2: a HEADERS frame that takes the open streams past the server's advertised
    SETTINGS_MAX_CONCURRENT_STREAMS is a stream error REFUSED_STREAM or PROTOCOL_ERROR."""
    peer = connect()
    limit = (server_settings(peer) or {}).get(SettingsFrame.MAX_CONCURRENT_STREAMS)
    if limit is None or limit > 10_000:
        pytest.skip(f"the server advertises no MAX_CONCURRENT_STREAMS up to 10000 ({limit})")
    streams = [peer.open() for _ in range(limit + 1)]
    peer.send(*(peer.headers(s) for s in streams))
    extra = streams[-1]
    peer.read(5.0, until=lambda p: extra in p.resets or extra in p.blocks or p.goaway or p.closed)
    freed = sorted({f.stream_id for f in peer.frames if isinstance(f, hf.RstStreamFrame)} - {extra})
    assert not freed, f"the server reset streams {freed[:5]}...: their room was free again"
    assert first_reset(peer, extra) in (REFUSED_STREAM, PROTOCOL_ERROR), seen(peer, extra)
    alive(peer)


# -- §5.3 priority, §5.4.1 connection errors --------------------------------------------------


@c_core("ignores priority: a stream depending on itself is served")
@pytest.mark.parametrize("frame", ["headers", "priority"])
def test_a_stream_depending_on_itself_is_a_protocol_error(connect: Connect, frame: str) -> None:
    """§5.3.1: a stream cannot depend on itself (HEADERS with priority, or PRIORITY): a
    stream error PROTOCOL_ERROR."""
    peer = connect()
    stream = peer.open()
    if frame == "headers":
        peer.send(hf.HeadersFrame(stream, peer.block(grpc_headers()), flags=["END_HEADERS", "PRIORITY"],
                       depends_on=stream, stream_weight=15), *body(stream))  # fmt: skip
    else:
        peer.send(
            peer.headers(stream), hf.PriorityFrame(stream, depends_on=stream, stream_weight=15)
        )
    stream_error(peer, stream, PROTOCOL_ERROR)


@C_CORE_LENIENT
def test_a_connection_error_is_a_goaway_then_close(connect: Connect) -> None:
    """§5.4.1, §6.8: after a connection error (DATA on stream 0) the server sends GOAWAY with
    the error's code and the last stream it took (1, answered), then closes the connection."""
    peer = connect()
    answered(peer)
    peer.send(raw(DATA, 0, 0, b"x"))
    peer.read(3.0, until=lambda p: p.closed)
    assert peer.goaway is not None, f"no GOAWAY; {seen(peer)}"
    assert (peer.goaway.error_code, peer.goaway.last_stream_id) == (PROTOCOL_ERROR, 1), seen(peer)
    assert peer.closed, "the connection stays open after GOAWAY"


# -- §6.1 DATA, §6.2 HEADERS, §6.3 PRIORITY, §6.4 RST_STREAM, §6.8 GOAWAY ---------------------


@pytest.mark.parametrize(
    "frame",
    [pytest.param(raw(DATA, 0, 0, b"x"), marks=C_CORE_LENIENT),
     pytest.param(raw(HEADERS, END_HEADERS, 0, b"\x82"), marks=C_CORE_LENIENT),
     pytest.param(raw(PRIORITY, 0, 0, bytes(5)), marks=C_CORE_LENIENT),
     pytest.param(raw(RST_STREAM, 0, 0, b"\x00\x00\x00\x08"), marks=C_CORE_LENIENT),
     raw(CONTINUATION, END_HEADERS, 0, b"\x82")],
    ids=["data", "headers", "priority", "rst-stream", "continuation"],
)  # fmt: skip
def test_a_stream_frame_on_stream_0_is_a_protocol_error(connect: Connect, frame: bytes) -> None:
    """§6.1, §6.2, §6.3, §6.4, §6.10: DATA, HEADERS, PRIORITY, RST_STREAM and CONTINUATION
    belong to streams: on stream 0, a connection error PROTOCOL_ERROR."""
    peer = connect()
    peer.send(frame)
    connection_error(peer, PROTOCOL_ERROR)


@pytest.mark.parametrize(
    "frame",
    [raw(SETTINGS, 0, 1), pytest.param(raw(PING, 0, 1, b"12345678"), marks=C_CORE_LENIENT),
     pytest.param(raw(GOAWAY, 0, 1, bytes(8)), marks=C_CORE_LENIENT)],
    ids=["settings", "ping", "goaway"],
)  # fmt: skip
def test_a_connection_frame_on_a_stream_is_a_protocol_error(connect: Connect, frame: bytes) -> None:
    """§6.5, §6.7, §6.8: SETTINGS, PING and GOAWAY belong to the connection: on a stream, a
    connection error PROTOCOL_ERROR."""
    peer = connect()
    open_stream(peer)
    peer.send(frame)
    connection_error(peer, PROTOCOL_ERROR)


@C_CORE_PADDING
def test_padded_frames_are_taken(connect: Connect) -> None:
    """§6.1, §6.2: padded HEADERS and DATA frames (the padding discarded) are a valid call."""
    peer = connect()
    stream, block, payload = peer.open(), peer.block(grpc_headers()), message(add_message())
    peer.send(raw(HEADERS, END_HEADERS | PADDED, stream, b"\x02" + block + b"\0\0"),
              raw(DATA, PADDED, stream, b"\x00" + payload[:9]),
              raw(DATA, PADDED | END_STREAM, stream, b"\xff" + payload[9:] + bytes(255)))  # fmt: skip
    answered(peer, stream)


@pytest.mark.parametrize("kind", [pytest.param("data", marks=C_CORE_PADDING), "headers"])
def test_padding_as_long_as_the_payload_is_a_protocol_error(connect: Connect, kind: str) -> None:
    """§6.1, §6.2: a pad length as long as the frame's payload, or longer, is a connection
    error PROTOCOL_ERROR."""
    peer = connect()
    if kind == "data":
        peer.send(raw(DATA, PADDED | END_STREAM, open_stream(peer), b"\x05abcd"))
    else:
        block = peer.block(grpc_headers())
        peer.send(raw(HEADERS, PADDED | END_HEADERS | END_STREAM, 1, bytes((len(block) + 1,)) + block))  # fmt: skip
    connection_error(peer, PROTOCOL_ERROR)


# -- §6.5 SETTINGS, §6.7 PING -----------------------------------------------------------------


def setting(key: int, value: int) -> bytes:
    return key.to_bytes(2, "big") + value.to_bytes(4, "big")


@pytest.mark.parametrize(
    ("frame", "code"),
    [(raw(SETTINGS, ACK, 0, setting(SettingsFrame.ENABLE_PUSH, 0)), FRAME_SIZE_ERROR),
     (raw(SETTINGS, 0, 0, setting(SettingsFrame.ENABLE_PUSH, 2)), PROTOCOL_ERROR),
     (raw(SETTINGS, 0, 0, setting(INITIAL_WINDOW_SIZE, MAX_WINDOW + 1)), FLOW_CONTROL_ERROR),
     (raw(SETTINGS, 0, 0, setting(SettingsFrame.MAX_FRAME_SIZE, 16_383)), PROTOCOL_ERROR),
     (raw(SETTINGS, 0, 0, setting(SettingsFrame.MAX_FRAME_SIZE, 2**24)), PROTOCOL_ERROR)],
    ids=["ack-with-payload", "enable-push-2", "initial-window-past-2^31-1",
         "max-frame-size-below-16384", "max-frame-size-past-2^24-1"],
)  # fmt: skip
def test_invalid_settings_are_connection_errors(connect: Connect, frame: bytes, code: int) -> None:
    """§6.5, §6.5.2: a SETTINGS ACK with a payload is FRAME_SIZE_ERROR; ENABLE_PUSH other than
    0 or 1, MAX_FRAME_SIZE outside 2^14..2^24-1 are PROTOCOL_ERROR; INITIAL_WINDOW_SIZE past
    2^31-1 is FLOW_CONTROL_ERROR: connection errors."""
    peer = connect()
    peer.send(frame)
    connection_error(peer, code)


def test_settings_are_acknowledged_and_unknown_ones_ignored(connect: Connect) -> None:
    """§6.5, §6.5.2, §6.5.3: each SETTINGS is acknowledged with an empty SETTINGS ACK, one with
    an unknown setting too (it is ignored)."""
    peer = connect()
    before = acks(peer)
    peer.send(raw(SETTINGS, 0, 0, setting(0xFF, 1) + setting(SettingsFrame.ENABLE_PUSH, 0)))
    peer.read(3.0, until=lambda p: acks(p) > before)
    assert acks(peer) == before + 1, seen(peer)
    assert all(not f.settings for f in peer.frames if isinstance(f, SettingsFrame) and "ACK" in f.flags)  # fmt: skip
    answered(peer)


def test_ping_is_answered_with_its_payload(connect: Connect) -> None:
    """§6.7: a PING is answered by a PING with ACK and the same payload."""
    peer = connect()
    peer.send(peer.ping(b"\x00\x01\x02\x03\xfc\xfd\xfe\xff"))
    peer.read(3.0, until=lambda p: bool(pongs(p)))
    assert pongs(peer) == [b"\x00\x01\x02\x03\xfc\xfd\xfe\xff"], seen(peer)


def test_a_ping_ack_is_not_answered(connect: Connect) -> None:
    """§6.7: a PING with ACK is not answered: of a PING ACK then a PING, only the second is."""
    peer = connect()
    peer.send(peer.ping(b"ack-ack!", ack=True), peer.ping(b"answered"))
    peer.read(3.0, until=lambda p: bool(pongs(p)))
    peer.read(0.3)
    assert pongs(peer) == [b"answered"], seen(peer)


# -- §6.9 WINDOW_UPDATE and flow control ------------------------------------------------------


@pytest.mark.parametrize(
    ("on_stream", "increments", "code"),
    [(False, (0,), PROTOCOL_ERROR),
     pytest.param(True, (0,), PROTOCOL_ERROR, marks=c_core("ends the call (RST_STREAM NO_ERROR, grpc-status 14)")),
     pytest.param(False, (MAX_WINDOW, MAX_WINDOW), FLOW_CONTROL_ERROR, marks=C_CORE_LENIENT),
     pytest.param(True, (MAX_WINDOW, MAX_WINDOW), FLOW_CONTROL_ERROR, marks=c_core("ignores a stream window past 2^31-1"))],
    ids=["connection-increment-0", "stream-increment-0", "connection-past-2^31-1", "stream-past-2^31-1"],
)  # fmt: skip
def test_a_bad_window_update_is_an_error(connect: Connect, on_stream: bool, increments: tuple[int, ...], code: int) -> None:  # fmt: skip
    """§6.9, §6.9.1: an increment of 0 is a PROTOCOL_ERROR, a window past 2^31-1 a
    FLOW_CONTROL_ERROR: connection errors on the connection, stream errors on a stream."""
    peer = connect()
    stream = open_stream(peer) if on_stream else 0
    peer.send(*(raw(WINDOW_UPDATE, 0, stream, n.to_bytes(4, "big")) for n in increments))
    if on_stream:
        stream_error(peer, stream, code)
    else:
        connection_error(peer, code)


def test_an_answer_comes_only_as_the_stream_window_allows(connect: Connect) -> None:
    """§6.9, §6.9.1: with a stream window of 16 octets, the answer arrives 16 octets at a
    time, each piece once the client gives window back, and whole."""
    peer = connect({INITIAL_WINDOW_SIZE: 16})
    stream = peer.call(add_message(rows=4))
    granted = 16
    for _ in range(64):
        peer.read(3.0, until=lambda p, g=granted: received(p, stream) >= g or stream in p.ended)
        if granted == 16:
            peer.read(0.3)  # time to send more than the window, were it not kept
        assert received(peer, stream) <= granted, f"{received(peer, stream)} octets > {granted}"
        if stream in peer.ended or peer.goaway or peer.resets:
            break
        assert received(peer, stream) == granted, f"stalled at {received(peer, stream)} octets"
        peer.send(peer.window_update(stream, 16))
        granted += 16
    answered(peer, stream)
    assert granted > 16 * 4, "the answer came in too few pieces"
    answer = service_pb2.ModelInferResponse.FromString(bytes(peer.data[stream])[5:])
    assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [2.0] * 16


def test_answers_come_only_as_the_connection_window_allows(connect: Connect) -> None:
    """§6.9.1: the connection's window (65535 octets, never raised by this client) bounds the
    answers of all its streams: once it is spent, an answer waits for a connection
    WINDOW_UPDATE, then comes whole."""
    peer = connect({INITIAL_WINDOW_SIZE: 1 << 20})
    payload = message(add_message(rows=1000))  # about 16 KB each way
    assert len(payload) <= (server_settings(peer) or {}).get(INITIAL_WINDOW_SIZE, DEFAULT_WINDOW)
    sent = 0

    def room(p: Peer) -> int:  # what the server's connection window still takes
        given = sum(f.window_increment for f in p.frames if isinstance(f, hf.WindowUpdateFrame) and f.stream_id == 0)  # fmt: skip
        return DEFAULT_WINDOW + given - sent

    for _ in range(8):
        peer.read(3.0, until=lambda p: room(p) >= len(payload))
        assert room(peer) >= len(payload), "the server gives no connection window back"
        stream = peer.open()
        peer.send(peer.headers(stream), *body(stream, payload))
        sent += len(payload)
        peer.read(2.0, until=lambda p, s=stream: s in p.ended or p.goaway or p.resets)
        assert received(peer) <= DEFAULT_WINDOW, f"{received(peer)} octets > {DEFAULT_WINDOW}"
        if stream not in peer.ended:
            break
    assert stream not in peer.ended and not peer.resets, f"never held; {seen(peer, stream)}"
    peer.send(peer.window_update(0, 1 << 20))
    answered(peer, stream)


def test_initial_window_0_holds_data_until_settings_raise_it(connect: Connect) -> None:
    """§6.9.2: with SETTINGS_INITIAL_WINDOW_SIZE 0 no DATA comes; a SETTINGS that raises it
    changes the window of the open stream, and the answer comes."""
    peer = connect({INITIAL_WINDOW_SIZE: 0})
    stream = peer.call(add_message())
    peer.read(1.0, until=lambda p: received(p, stream) > 0 or stream in p.ended)
    assert received(peer, stream) == 0 and stream not in peer.ended, seen(peer, stream)
    peer.send(peer.settings({INITIAL_WINDOW_SIZE: DEFAULT_WINDOW}))
    answered(peer, stream)


def test_a_window_made_negative_by_settings_is_allowed(connect: Connect) -> None:
    """§6.9.2: a SETTINGS that lowers INITIAL_WINDOW_SIZE can make an open stream's window
    negative: no error, no DATA until it is positive again, then the rest of the answer."""
    peer = connect({INITIAL_WINDOW_SIZE: 16})
    stream = peer.call(add_message(rows=4))
    peer.read(3.0, until=lambda p: received(p, stream) >= 16)
    assert received(peer, stream) == 16, seen(peer, stream)
    peer.send(peer.settings({INITIAL_WINDOW_SIZE: 0}), peer.window_update(stream, 8))  # -16 + 8
    peer.read(0.5)
    assert received(peer, stream) == 16 and not peer.resets and peer.goaway is None, seen(peer, stream)  # fmt: skip
    peer.send(peer.settings({INITIAL_WINDOW_SIZE: DEFAULT_WINDOW}))
    answered(peer, stream)


# -- §6.10 CONTINUATION -----------------------------------------------------------------------


def continuation_case(peer: Peer, case: str) -> list[hf.Frame | bytes]:
    block = peer.block(grpc_headers())
    first, rest, end = block[:4], block[4:], ["END_HEADERS"]
    head, cont = hf.HeadersFrame, hf.ContinuationFrame
    between = {
        "ping-inside-block": raw(PING, 0, 0, b"12345678"),
        "priority-inside-block": raw(PRIORITY, 0, 1, bytes((0, 0, 0, 3, 15))),
        "data-inside-block": raw(DATA, 0, 1, b"x"),
        "headers-inside-block": raw(HEADERS, END_HEADERS, 3, peer.block(grpc_headers())),
        "unknown-type-inside-block": raw(UNKNOWN, 0, 1, b"x"),
    }
    if case in between:
        return [head(1, first), between[case], cont(1, rest, flags=end)]
    cases: dict[str, list[hf.Frame | bytes]] = {
        "without-headers": [cont(1, block, flags=end)],
        "after-end-headers": [head(1, block, flags=end), cont(1, b"\x82")],
        "after-last-continuation": [head(1, first), cont(1, rest, flags=end), cont(1, b"\x82", flags=end)],
        "on-another-stream": [head(1, first), cont(3, rest, flags=end)],
        "after-data": [head(1, block, flags=end), DataFrame(1, b"\x00"), cont(1, b"\x82", flags=end)],
    }  # fmt: skip
    return cases[case]


@pytest.mark.parametrize(
    "case",
    ["without-headers", "after-end-headers", "after-last-continuation", "on-another-stream",
     "after-data", "ping-inside-block", "priority-inside-block", "data-inside-block",
     "headers-inside-block", "unknown-type-inside-block"],
)  # fmt: skip
def test_continuation_out_of_place_is_a_protocol_error(connect: Connect, case: str) -> None:
    """§6.10, §4.3, §5.5: a CONTINUATION follows a HEADERS or CONTINUATION without
    END_HEADERS, on its stream; any other frame (unknown types too) between a HEADERS and its
    CONTINUATION, or a CONTINUATION elsewhere, is a connection error PROTOCOL_ERROR."""
    peer = connect()
    peer.send(*continuation_case(peer, case))
    connection_error(peer, PROTOCOL_ERROR)


# -- §8 HTTP semantics: malformed requests ----------------------------------------------------

BASE = grpc_headers()


def edited(field: str, value: str | None = None) -> Headers:
    """The valid request's headers, ``field`` dropped (or given ``value``)."""
    return [
        (k, v if k != field or value is None else value)
        for k, v in BASE
        if k != field or value is not None
    ]


MALFORMED: dict[str, Headers] = {
    "uppercase-field-name": [*BASE, ("X-Request-Id", "1")],
    "connection": [*BASE, ("connection", "keep-alive")],
    "keep-alive": [*BASE, ("keep-alive", "timeout=5")],
    "proxy-connection": [*BASE, ("proxy-connection", "keep-alive")],
    "transfer-encoding": [*BASE, ("transfer-encoding", "chunked")],
    "upgrade": [*BASE, ("upgrade", "h2c")],
    "te-not-trailers": edited("te", "trailers, deflate"),
    "unknown-pseudo-header": [(":custom", "1"), *BASE],
    "response-pseudo-header": [(":status", "200"), *BASE],
    "pseudo-header-after-field": [*edited(":authority"), (":authority", "localhost")],
    "duplicate-:method": [(":method", "POST"), *BASE],
    "duplicate-:scheme": [(":scheme", "http"), *BASE],
    "duplicate-:path": [(":path", MODEL_INFER), *BASE],
    "missing-:method": edited(":method"),
    "missing-:scheme": edited(":scheme"),
    "missing-:path": edited(":path"),
    "empty-:path": edited(":path", ""),
    "nul-in-value": [*BASE, ("x-meta", "a\x00b")],
    "cr-in-value": [*BASE, ("x-meta", "a\rb")],
    "lf-in-value": [*BASE, ("x-meta", "a\nb")],
    "content-length-disagrees": [*BASE, ("content-length", "1")],
}
C_CORE_MALFORMED = c_core(
    "serves most malformed requests (grpc-status 0) and ends the others with a grpc-status "
    "or RST_STREAM NO_ERROR / INTERNAL_ERROR, never RST_STREAM PROTOCOL_ERROR"
)


def malformed(peer: Peer, stream: int) -> None:
    """§8.1.1: a malformed request is a stream error PROTOCOL_ERROR (a response may come
    first, not the call served); the connection and its other calls live on."""
    peer.read(2.0, until=lambda p: first_reset(p, stream) is not None or p.goaway or p.closed)
    assert first_reset(peer, stream) == PROTOCOL_ERROR, f"expected RST_STREAM PROTOCOL_ERROR; {seen(peer, stream)}"  # fmt: skip
    assert peer.status(stream) != 0, f"the malformed call was served; {seen(peer, stream)}"
    answered(peer)


@C_CORE_MALFORMED
@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_request_is_a_stream_error(connect: Connect, case: str) -> None:
    """§8.1.1, §8.2.1, §8.2.2, §8.3, §8.3.1: upper-case field names, connection-specific
    fields, TE other than "trailers", undefined, response, late or duplicate pseudo-header
    fields, a missing :method, :scheme or :path, an empty :path, NUL, CR or LF in a value,
    a content-length other than the DATA's: malformed, a stream error PROTOCOL_ERROR."""
    peer = connect()
    stream = peer.open()
    peer.send(peer.headers(stream, MALFORMED[case]), *body(stream))
    malformed(peer, stream)


@C_CORE_MALFORMED
def test_pseudo_headers_in_trailers_are_malformed(connect: Connect) -> None:
    """§8.1, §8.3: trailers carry no pseudo-header fields: a stream error PROTOCOL_ERROR."""
    peer = connect()
    stream = peer.open()
    peer.send(peer.headers(stream), *body(stream, end=False),
              peer.headers(stream, [(":method", "POST"), ("x-trailer", "1")], end_stream=True))  # fmt: skip
    malformed(peer, stream)


def test_valid_trailers_are_taken(connect: Connect) -> None:
    """§8.1: a request may end with trailers (a HEADERS with END_STREAM): it is answered."""
    peer = connect()
    stream = peer.open()
    peer.send(peer.headers(stream), *body(stream, end=False),
              peer.headers(stream, [("x-trailer", "1")], end_stream=True))  # fmt: skip
    answered(peer, stream)
