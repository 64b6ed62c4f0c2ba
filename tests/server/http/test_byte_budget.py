"""The process's byte budget for requests still arriving (``request_bytes_budget``), on a real
server: HTTP bodies and gRPC messages that never finish hold it; past it a request is refused
at once (HTTP 503, gRPC RESOURCE_EXHAUSTED), and neither protocol can take the other's room."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import h2peer
from tests.helpers import ServerProcess, write_add_runner

pytestmark = pytest.mark.slow

Server = Callable[..., ServerProcess]
MIB = 1 << 20
BUDGET = 3 * MIB
"""Each protocol may hold three quarters of it: 2.25 MiB."""
GOOD = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
).encode()


@pytest.fixture
def target(server: Server, tmp_path: Path, plugins_dir: Path) -> ServerProcess:
    write_add_runner(plugins_dir, "add", "1.0.0")
    config = tmp_path / "plugserve.toml"
    config.write_text(f"max_body_bytes = {2 * MIB}\nrequest_bytes_budget = {BUDGET}\n")
    (tmp_path / "models").mkdir()
    return server("--plugins-dir", str(plugins_dir), "--models-dir", str(tmp_path / "models"),
                  "--config", str(config), "--grpc-engine", "native")  # fmt: skip


def head(length: int) -> bytes:
    return (
        f"POST /v2/models/add/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


@contextlib.contextmanager
def unfinished_bodies(srv: ServerProcess, count: int, sent: int) -> Iterator[None]:
    """``count`` HTTP requests declaring 1.5 MiB, ``sent`` bytes of each sent, none finished."""
    socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(count)]
    try:
        for sock in socks:
            sock.sendall(head(3 * MIB // 2) + b" " * sent)
        time.sleep(0.5)
        yield
    finally:
        for sock in socks:
            sock.close()


@contextlib.contextmanager
def unfinished_messages(srv: ServerProcess, count: int, sent: int) -> Iterator[h2peer.Peer]:
    """``count`` gRPC calls declaring a 1.5 MiB message, ``sent`` bytes of each sent."""
    peer = h2peer.Peer(srv.grpc_port)
    peer.read(0.3)  # the server's settings and its connection window
    prefix = (3 * MIB // 2).to_bytes(5, "big")
    try:
        for _ in range(count):
            stream = peer.open()
            payload = prefix + bytes(sent - 5)
            peer.send(
                peer.headers(stream),
                *h2peer.data_frames(stream, payload, end=False),
            )
        peer.read(0.5)
        yield peer
    finally:
        peer.close()


def answer(sock: socket.socket) -> tuple[int, bytes]:
    """The status and head of the response that comes on ``sock``."""
    data = b""
    with contextlib.suppress(OSError):
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def test_http_bodies_past_their_share_are_refused_503(target: ServerProcess) -> None:
    with (
        unfinished_bodies(target, 2, MIB),
        socket.create_connection(("127.0.0.1", target.port), timeout=10) as third,
    ):
        third.sendall(head(3 * MIB // 2) + b" " * (MIB // 2))
        status, response = answer(third)
        assert status == 503, response
        assert b"Retry-After: 1" in response and b"request_bytes_budget" in response
    # Once they are gone, their bytes are given back: a large body is read again.
    status, _, body = target.request("POST", "/v2/models/add/infer", GOOD + b" " * MIB,
                                     {"Content-Type": "application/json"})  # fmt: skip
    assert status == 200, body


def test_grpc_messages_past_their_share_are_refused_and_http_keeps_its_room(
    target: ServerProcess,
) -> None:
    with unfinished_messages(target, 2, MIB) as peer:
        assert not peer.resets and peer.goaway is None
        third = peer.open()
        peer.send(
            peer.headers(third),
            *h2peer.data_frames(third, (3 * MIB // 2).to_bytes(5, "big") + bytes(MIB // 2), False),
        )
        peer.wait_stream(third)
        assert peer.status(third) == 8  # RESOURCE_EXHAUSTED
        assert b"request_bytes_budget" in (peer.header(third, b"grpc-message") or b"")
        # gRPC holds 2 MiB of the 3: a large HTTP body (0.9 MiB) still has its room.
        status, _, body = target.request("POST", "/v2/models/add/infer",
                                         GOOD + b" " * (9 * MIB // 10),
                                         {"Content-Type": "application/json"})  # fmt: skip
        assert status == 200, body
