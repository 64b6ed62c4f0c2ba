"""The native gRPC engine's HTTP/2, byte by byte: a raw socket client (frames written here,
header blocks by the ``hpack`` package's encoder) against a real server with
``--grpc-engine native``: what a client may do (split and padded frames, compression, a
small window), and what ends a connection (a wrong preface, silence, floods)."""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import hpack
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from plugserve.server.grpc_api import wire
from plugserve.server.transport import h2frames
from plugserve.server.transport.h2frames import END_HEADERS, END_STREAM, Frame
from tests.helpers import ServerProcess, write_add_runner

pytestmark = pytest.mark.slow

Server = Callable[..., ServerProcess]
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


def start(server: Server, tmp_path: Path, plugins_dir: Path, **settings: object) -> ServerProcess:
    write_add_runner(plugins_dir, "add", "1.0.0")
    path = tmp_path / "plugserve.toml"
    path.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items()))
    (tmp_path / "models").mkdir(exist_ok=True)
    return server("--plugins-dir", str(plugins_dir), "--models-dir", str(tmp_path / "models"),
                  "--config", str(path), "--grpc-engine", "native")  # fmt: skip


def add_message(rows: int = 1) -> bytes:
    message = service_pb2.ModelInferRequest(model_name="add")
    message.inputs.add(name="x", datatype="FP32", shape=[rows, 4])
    message.raw_input_contents.append(np.ones((rows, 4), np.float32).tobytes())
    return message.SerializeToString()


class Client:
    """One HTTP/2 connection, spoken frame by frame."""

    def __init__(self, port: int, window: int | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.buffer = b""
        self.next_stream = 1
        settings = {} if window is None else {h2frames.Setting.INITIAL_WINDOW_SIZE: window}
        self.sock.sendall(h2frames.PREFACE + h2frames.settings(settings))

    def headers(self, path: str = MODEL_INFER, extra: tuple[tuple[str, str], ...] = ()) -> bytes:
        return self.encoder.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "localhost"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *extra,
            ]
        )

    def call(self, message: bytes, extra: tuple[tuple[str, str], ...] = ()) -> int:
        """A unary call in one HEADERS and one DATA frame; its stream id."""
        stream = self.open()
        self.send(h2frames.frame(Frame.HEADERS, END_HEADERS, stream, self.headers(extra=extra)))
        self.send(h2frames.frame(Frame.DATA, END_STREAM, stream, wire.message_frame(message)))
        return stream

    def data(self, stream: int, payload: bytes, end: bool = True) -> None:
        """``payload`` in DATA frames of at most 16 KiB (the default frame size)."""
        pieces = [payload[i : i + 16_384] for i in range(0, len(payload), 16_384)] or [b""]
        for i, piece in enumerate(pieces):
            last = end and i == len(pieces) - 1
            self.send(h2frames.frame(Frame.DATA, END_STREAM if last else 0, stream, piece))

    def open(self) -> int:
        stream, self.next_stream = self.next_stream, self.next_stream + 2
        return stream

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frames(self) -> Iterator[tuple[int, int, int, bytes]]:
        """Frames as they come (kind, flags, stream, payload) until the server closes."""
        while True:
            while len(self.buffer) >= 9:
                length = int.from_bytes(self.buffer[:3], "big")
                if len(self.buffer) < 9 + length:
                    break
                kind, flags = self.buffer[3], self.buffer[4]
                stream = int.from_bytes(self.buffer[5:9], "big")
                payload, self.buffer = self.buffer[9 : 9 + length], self.buffer[9 + length :]
                yield kind, flags, stream, payload
            data = self.sock.recv(65536)
            if not data:
                return
            self.buffer += data

    def answer(self, stream: int) -> tuple[dict[str, str], bytes, dict[str, str]]:
        """The stream's headers, body and trailers (or, for trailers only, its one block)."""
        blocks: list[dict[str, str]] = []
        body = b""
        for kind, flags, sid, payload in self.frames():
            if kind == Frame.SETTINGS and not flags & h2frames.ACK:
                self.send(h2frames.frame(Frame.SETTINGS, h2frames.ACK, 0))
            if sid != stream:
                continue
            if kind == Frame.HEADERS:
                blocks.append(dict(self.decoder.decode(payload)))
            elif kind == Frame.DATA:
                body += payload
                self.send(
                    h2frames.window_update(0, len(payload))
                    + h2frames.window_update(sid, len(payload))
                )
            if flags & END_STREAM:
                break
        return blocks[0], body, blocks[-1]

    def close(self) -> None:
        self.sock.close()


def goaway_of(client: Client) -> int | None:
    """The error code of the GOAWAY the server sends before it closes (``None``: none)."""
    for kind, _, _, payload in client.frames():
        if kind == Frame.GOAWAY:
            return int.from_bytes(payload[4:8], "big")
    return None


@pytest.fixture
def native(server: Server, tmp_path: Path, plugins_dir: Path) -> ServerProcess:
    return start(server, tmp_path, plugins_dir, header_timeout_s=1, grpc_idle_timeout_s=3)


def test_split_padded_frames_answer_as_one(native: ServerProcess) -> None:
    """HEADERS split over CONTINUATION frames, the message over padded DATA frames of a few
    bytes each: the answer is x + 1, headers, message and ``grpc-status: 0``."""
    client = Client(native.grpc_port)
    stream = client.open()
    block = client.headers(extra=(("x-request-id", "split-1"),))
    client.send(h2frames.frame(Frame.HEADERS, 0, stream, block[:5]))
    client.send(h2frames.frame(Frame.CONTINUATION, 0, stream, block[5:9]))
    client.send(h2frames.frame(Frame.CONTINUATION, END_HEADERS, stream, block[9:]))
    data = wire.message_frame(add_message())
    for i in range(0, len(data), 7):
        end = END_STREAM if i + 7 >= len(data) else 0
        client.send(
            h2frames.frame(
                Frame.DATA, h2frames.PADDED | end, stream, b"\x03" + data[i : i + 7] + b"pad"
            )
        )
    headers, body, trailers = client.answer(stream)
    assert headers[":status"] == "200" and headers["content-type"] == "application/grpc"
    assert trailers["grpc-status"] == "0", trailers
    answer = service_pb2.ModelInferResponse.FromString(body[5:])
    assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [2.0] * 4
    client.close()


def test_a_gzip_message_is_read(native: ServerProcess) -> None:
    client = Client(native.grpc_port)
    stream = client.open()
    client.send(h2frames.frame(Frame.HEADERS, END_HEADERS, stream,
                           client.headers(extra=(("grpc-encoding", "gzip"),))))  # fmt: skip
    packed = gzip.compress(add_message())
    client.send(h2frames.frame(Frame.DATA, END_STREAM, stream,
                           b"\x01" + len(packed).to_bytes(4, "big") + packed))  # fmt: skip
    _, body, trailers = client.answer(stream)
    assert trailers["grpc-status"] == "0" and body
    client.close()


def test_an_answer_larger_than_the_window_waits_for_it(native: ServerProcess) -> None:
    """A client whose streams' window is 64 bytes: the answer comes in pieces, each sent as
    the client gives window back, and whole."""
    client = Client(native.grpc_port, window=64)
    stream = client.call(add_message(rows=64))
    _, body, trailers = client.answer(stream)
    assert trailers["grpc-status"] == "0"
    answer = service_pb2.ModelInferResponse.FromString(body[5:])
    assert len(answer.raw_output_contents[0]) == 64 * 4 * 4
    client.close()


def test_errors_are_statuses(native: ServerProcess) -> None:
    client = Client(native.grpc_port)
    unknown = client.call(b"\x0a\x04nope")  # model_name "nope"
    assert client.answer(unknown)[2]["grpc-status"] == "5"  # NOT_FOUND
    garbage = client.call(b"\xff\xff\xff")
    _, _, trailers = client.answer(garbage)
    assert trailers["grpc-status"] == "3" and "ModelInferRequest" in trailers["grpc-message"]
    missing = client.open()
    client.send(
        h2frames.frame(Frame.HEADERS, END_HEADERS, missing, client.headers("/no.Such/Method"))
    )
    client.send(h2frames.frame(Frame.DATA, END_STREAM, missing, wire.message_frame(b"")))
    assert client.answer(missing)[2]["grpc-status"] == "12"  # UNIMPLEMENTED
    client.close()


def test_ping_is_answered(native: ServerProcess) -> None:
    client = Client(native.grpc_port)
    client.send(h2frames.frame(Frame.PING, 0, 0, b"plugserv"))
    for kind, flags, _, payload in client.frames():
        if kind == Frame.PING:
            assert flags & h2frames.ACK and payload == b"plugserv"
            break
    client.close()


def test_a_wrong_preface_is_refused(native: ServerProcess) -> None:
    sock = socket.create_connection(("127.0.0.1", native.grpc_port), timeout=10)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    client = Client.__new__(Client)
    client.sock, client.buffer = sock, b""
    assert goaway_of(client) == h2frames.Error.PROTOCOL_ERROR


def test_silence_and_idleness_close_the_connection(native: ServerProcess) -> None:
    """No preface within header_timeout_s (1 s): closed. An idle connection: GOAWAY after
    grpc_idle_timeout_s (3 s), as gRPC's max_connection_idle."""
    sock = socket.create_connection(("127.0.0.1", native.grpc_port), timeout=10)
    started = time.monotonic()
    while sock.recv(65536):
        pass
    assert time.monotonic() - started < 5
    client = Client(native.grpc_port)
    assert client.answer(client.call(add_message()))[2]["grpc-status"] == "0"
    started = time.monotonic()
    assert goaway_of(client) == h2frames.Error.NO_ERROR
    assert 2 < time.monotonic() - started < 8


def test_a_reset_flood_ends_the_connection_not_the_server(native: ServerProcess) -> None:
    """HEADERS then RST_STREAM, over and over (the "rapid reset" attack): GOAWAY
    ENHANCE_YOUR_CALM, and other clients are served."""
    client = Client(native.grpc_port)
    burst = b"".join(
        h2frames.frame(Frame.HEADERS, END_HEADERS, s, client.headers())
        + h2frames.rst_stream(s, h2frames.Error.CANCEL)
        for s in range(1, 2 * 1500, 2)
    )
    with contextlib.suppress(OSError):  # closed while the burst was written
        client.send(burst)
    assert goaway_of(client) == h2frames.Error.ENHANCE_YOUR_CALM
    other = Client(native.grpc_port)
    assert other.answer(other.call(add_message()))[2]["grpc-status"] == "0"
    other.close()
    assert "Traceback" not in native.log()


def test_an_answer_never_read_ends_after_body_timeout(
    server: Server, tmp_path: Path, plugins_dir: Path
) -> None:
    """A client that gives none of its 16-byte window back: the unary call's answer waits,
    and after body_timeout_s (2 s) the call ends DEADLINE_EXCEEDED (its status is not held
    by flow control) and frees its place."""
    srv = start(server, tmp_path, plugins_dir, body_timeout_s=2, max_connections=1)
    client = Client(srv.grpc_port, window=16)
    stream = client.call(add_message(rows=64))
    started = time.monotonic()
    status = None
    for kind, flags, sid, payload in client.frames():
        if kind == Frame.HEADERS and sid == stream and flags & END_STREAM:
            status = dict(client.decoder.decode(payload))
            break
        if kind == Frame.HEADERS and sid == stream:
            client.decoder.decode(payload)
    assert status is not None and status["grpc-status"] == "4", status
    assert 1.5 < time.monotonic() - started < 6
    other = Client(srv.grpc_port)
    assert other.answer(other.call(add_message()))[2]["grpc-status"] == "0"
    client.close()
    other.close()


def test_a_streamed_message_larger_than_the_stream_window_arrives(native: ServerProcess) -> None:
    """ModelStreamInfer with one 4 MiB message (the stream's window is 1 MiB): the window is
    given back as its pieces come, and the answer is x + 1 for every row."""
    client = Client(native.grpc_port)
    stream = client.open()
    path = "/inference.GRPCInferenceService/ModelStreamInfer"
    client.send(h2frames.frame(Frame.HEADERS, END_HEADERS, stream, client.headers(path)))
    data = wire.message_frame(add_message(rows=1 << 18))
    frames = client.frames()
    window = h2frames.DEFAULT_WINDOW  # until the server's settings say otherwise
    for kind, _, _, payload in frames:
        if kind == Frame.SETTINGS:
            settings = {payload[i + 1]: int.from_bytes(payload[i + 2 : i + 6], "big")
                        for i in range(0, len(payload), 6)}  # fmt: skip
            window = settings.get(h2frames.Setting.INITIAL_WINDOW_SIZE, window)
            break
    sent = 0
    while sent < len(data):
        while window <= 0:
            kind, _, sid, payload = next(frames)
            if kind == Frame.WINDOW_UPDATE and sid == stream:
                window += int.from_bytes(payload, "big")
        piece = data[sent : sent + min(16_384, window)]
        client.send(h2frames.frame(Frame.DATA, 0, stream, piece))
        sent += len(piece)
        window -= len(piece)
    client.send(h2frames.frame(Frame.DATA, END_STREAM, stream, b""))
    body = b""
    for kind, flags, sid, payload in frames:
        if sid != stream:
            continue
        if kind == Frame.DATA:
            body += payload
            client.send(
                h2frames.window_update(0, len(payload)) + h2frames.window_update(sid, len(payload))
            )
        if flags & END_STREAM:
            break
    answer = service_pb2.ModelStreamInferResponse.FromString(body[5:])
    assert not answer.error_message
    rows = np.frombuffer(answer.infer_response.raw_output_contents[0], np.float32)
    assert rows.size == 4 << 18 and (rows == 2.0).all()
    client.close()


def test_a_client_without_a_dynamic_table_reads_every_answer(native: ServerProcess) -> None:
    """A client that sets HEADER_TABLE_SIZE to 0 (as h2load --header-table-size=0): the
    first header block after it starts with a table size update, as RFC 7541 §4.2 asks."""
    client = Client(native.grpc_port)
    client.send(h2frames.settings({h2frames.Setting.HEADER_TABLE_SIZE: 0}))
    stream = client.call(add_message())
    for kind, _, sid, payload in client.frames():
        if kind == Frame.HEADERS and sid == stream:
            assert payload[:1] == b"\x20"
            break
    client.close()


def test_compressed_messages_that_cannot_be_read(native: ServerProcess) -> None:
    """A bomb past max_body_bytes: RESOURCE_EXHAUSTED; a cut gzip stream: INTERNAL; a
    message that declares more than max_body_bytes: RESOURCE_EXHAUSTED before it comes."""
    client = Client(native.grpc_port)
    gz = (("grpc-encoding", "gzip"),)
    bomb = gzip.compress(bytes(80 << 20))  # 80 MiB inflated, 80 KiB sent
    for body, code in ((bomb, "8"), (gzip.compress(add_message())[:-6], "13")):
        stream = client.open()
        client.send(h2frames.frame(Frame.HEADERS, END_HEADERS, stream, client.headers(extra=gz)))
        client.data(stream, b"\x01" + len(body).to_bytes(4, "big") + body)
        assert client.answer(stream)[2]["grpc-status"] == code
    stream = client.open()
    client.send(h2frames.frame(Frame.HEADERS, END_HEADERS, stream, client.headers()))
    client.send(h2frames.frame(Frame.DATA, 0, stream, b"\x00" + (2**31).to_bytes(4, "big")))
    assert client.answer(stream)[2]["grpc-status"] == "8"
    client.close()


def test_an_empty_continuation_flood_ends_the_connection(native: ServerProcess) -> None:
    client = Client(native.grpc_port)
    client.send(h2frames.frame(Frame.HEADERS, 0, 1, client.headers()[:3]))
    with contextlib.suppress(OSError):
        client.send(h2frames.frame(Frame.CONTINUATION, 0, 1) * 5000)
    assert goaway_of(client) == h2frames.Error.ENHANCE_YOUR_CALM


def test_late_frames_of_an_ended_call_are_ignored(native: ServerProcess) -> None:
    """A call refused before its message came (an unknown method: answered at once) whose
    client then sends its message and trailers: those frames are ignored, and the
    connection serves the next call."""
    client = Client(native.grpc_port)
    stream = client.open()
    client.send(
        h2frames.frame(Frame.HEADERS, END_HEADERS, stream, client.headers("/no.Such/Method"))
    )
    assert client.answer(stream)[2]["grpc-status"] == "12"
    client.data(stream, wire.message_frame(add_message()), end=False)
    trailers = client.encoder.encode([("x-trailer", "1")])
    client.send(h2frames.frame(Frame.HEADERS, END_HEADERS | END_STREAM, stream, trailers))
    assert client.answer(client.call(add_message()))[2]["grpc-status"] == "0"
    client.close()
