"""The fast path answers what aiohttp would answer, and leaves everything else to it.

Real server subprocesses, raw sockets: one server with the fast path (the default) and one
without (``fast_path = false``) take the same bytes. aiohttp's answers carry its
``Server`` header; the fast path's do not, which tells who answered.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import ServerProcess, rss_mib, write_add_runner
from tests.server.http.test_connections import connect, start

Server = Callable[..., ServerProcess]

JSON_BODY = json.dumps(
    {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4.5]}]}
).encode()


def binary_body() -> tuple[bytes, int]:
    header = json.dumps(
        {
            "inputs": [
                {"name": "x", "shape": [1, 4], "datatype": "FP32",
                 "parameters": {"binary_data_size": 16}},
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()  # fmt: skip
    return header + struct.pack("<4f", 1, 2, 3, 4.5), len(header)


def post(path: str, body: bytes, *headers: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def read_response(sock: socket.socket, buffer: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body off ``sock``; the rest stays in
    ``buffer`` for the next."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a whole response: {bytes(buffer)!r}"
        buffer += chunk
    end = buffer.index(b"\r\n\r\n")
    lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers["content-length"])
    while len(buffer) < end + 4 + length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed inside a response body"
        buffer += chunk
    body = bytes(buffer[end + 4 : end + 4 + length])
    del buffer[: end + 4 + length]
    return status, headers, body


def exchange(srv: ServerProcess, *requests: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Send every request at once on one connection (pipelined); their answers in order."""
    with connect(srv) as sock:
        sock.sendall(b"".join(requests))
        buffer = bytearray()
        return [read_response(sock, buffer) for _ in requests]


@pytest.fixture
def servers(
    server: Server, tmp_path: Path, plugins_dir: Path
) -> tuple[ServerProcess, ServerProcess]:
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1.0)
    (tmp_path / "fast").mkdir()
    (tmp_path / "plain").mkdir()
    fast = start(server, tmp_path / "fast", plugins_dir)
    plain = start(server, tmp_path / "plain", plugins_dir, fast_path=False)
    return fast, plain


def same(fast: tuple[int, dict[str, str], bytes], plain: tuple[int, dict[str, str], bytes]) -> None:
    """The same answer, but for who gave it."""
    assert fast[0] == plain[0], (fast, plain)
    assert fast[2] == plain[2]
    for name in ("content-type", "x-plugserve-variant", "inference-header-content-length"):
        assert fast[1].get(name) == plain[1].get(name), name


def test_inference_on_the_fast_path_answers_as_aiohttp_does(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    fast, plain = servers
    binary, header_length = binary_body()
    requests = [
        post("/v2/models/add/infer", JSON_BODY, "Content-Type: application/json"),
        post("/v2/models/add/infer", binary, f"Inference-Header-Content-Length: {header_length}"),
        post("/v2/models/add/infer", JSON_BODY, "X-Request-ID: mine-1"),
        post("/v2/models/missing/infer", JSON_BODY),  # the data plane's 404
    ]
    answers = exchange(fast, *requests)
    for ours, theirs in zip(answers, exchange(plain, *requests), strict=True):
        same(ours, theirs)
        assert "server" not in ours[1]  # the fast path answered
        assert "server" in theirs[1]  # aiohttp answered
        assert ours[1]["x-request-id"]
    json_answer, binary_answer, named, missing = answers
    assert json.loads(json_answer[2])["outputs"][0]["data"] == [2, 3, 4, 5.5]
    data = binary_answer[2][int(binary_answer[1]["inference-header-content-length"]) :]
    assert struct.unpack("<4f", data) == (2, 3, 4, 5.5)
    assert named[1]["x-request-id"] == "mine-1"
    assert missing[0] == 404 and "missing" in json.loads(missing[2])["error"]


DECLINED = [
    pytest.param(post("/v2/models/add/infer", b'{"inputs": ['), id="body-the-decoder-refuses"),
    pytest.param(post("/v2/models/add/infer", b'{"inputs": []}'), id="no-inputs"),
    pytest.param(post("/v2/models/add/infer?x=1", JSON_BODY), id="query-string"),
    pytest.param(post("/v2/models/a%64d/infer", JSON_BODY), id="percent-encoded-route"),
    pytest.param(post("/v2/models/add/infer", JSON_BODY, "Connection: close"), id="close"),
    pytest.param(post("/v2/models/add/infer", JSON_BODY, "Expect: 100-continue"), id="expect"),
    pytest.param(
        post("/v2/models/add/infer", JSON_BODY, f"Content-Length: {len(JSON_BODY)}"),
        id="two-content-lengths",
    ),
    pytest.param(
        b"POST /v2/models/add/infer HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        + f"{len(JSON_BODY):x}\r\n".encode()
        + JSON_BODY
        + b"\r\n0\r\n\r\n",
        id="chunked",
    ),
    pytest.param(
        post("/v2/models/add/infer", JSON_BODY).replace(b"HTTP/1.1", b"HTTP/1.0", 1),
        id="http-1.0",
    ),
    pytest.param(post("/v2/models/add/infer", JSON_BODY, "X-Note: caf\xe9"), id="non-ascii-value"),
    pytest.param(post("/v2/models/add/predict", JSON_BODY), id="another-path"),
    pytest.param(
        post(
            "/v2/models/missing/infer",
            json.dumps(
                {"inputs": [{"name": "x", "datatype": "FP32", "shape": [10**11], "data": [1]}]}
            ).encode(),
        ),
        id="too-large-tensor-for-an-unknown-route",  # 404 (admission) before 413 (decode)
    ),
]


@pytest.mark.parametrize("request_bytes", DECLINED)
def test_what_the_fast_path_does_not_take_is_aiohttps_answer(
    servers: tuple[ServerProcess, ServerProcess], request_bytes: bytes
) -> None:
    fast, plain = servers
    ours, theirs = (_answers(srv, request_bytes) for srv in (fast, plain))
    assert _status(ours) == _status(theirs)
    assert b"\r\nServer: " in ours  # aiohttp answered, on the fast-path server too


def _answers(srv: ServerProcess, request: bytes) -> bytes:
    """Everything the server sends for ``request`` until it closes or goes quiet for 1 s."""
    with connect(srv) as sock:
        sock.sendall(request)
        sock.settimeout(1.0)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except TimeoutError:
            pass
    return data


def _status(data: bytes) -> int:
    return int(data.split(b" ", 2)[1])


def test_one_connection_goes_on_after_a_request_the_fast_path_leaves(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    """Pipelined on one connection: two fast answers, a health check (aiohttp's, which keeps
    the connection from then on) and inference again, every answer in order and right."""
    fast, _ = servers
    probe = b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n"
    infer = post("/v2/models/add/infer", JSON_BODY)
    answers = exchange(fast, infer, infer, probe, infer)
    assert [a[0] for a in answers] == [200, 200, 200, 200]
    assert ["server" in a[1] for a in answers] == [False, False, True, True]
    for index in (0, 1, 3):
        assert json.loads(answers[index][2])["outputs"][0]["data"] == [2, 3, 4, 5.5]
    assert json.loads(answers[2][2]) == {"ready": True}


def test_many_requests_on_one_fast_connection_each_answered(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    fast, _ = servers
    bodies = [
        json.dumps({"id": str(i), "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                               "data": [i, i, i, i]}]}).encode()
        for i in range(50)
    ]  # fmt: skip
    answers = exchange(fast, *(post("/v2/models/add/infer", b) for b in bodies))
    for i, (status, headers, body) in enumerate(answers):
        assert status == 200 and "server" not in headers
        doc = json.loads(body)
        assert doc["id"] == str(i) and doc["outputs"][0]["data"] == [i + 1] * 4


def test_a_client_that_hangs_up_leaves_no_trace_but_its_count(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    fast, _ = servers
    for _ in range(20):
        with connect(fast) as sock:
            sock.sendall(post("/v2/models/add/infer", JSON_BODY))
    status, _, body = fast.request("POST", "/v2/models/add/infer", json.loads(JSON_BODY))
    assert status == 200, body
    assert "Traceback" not in fast.log()


def test_answers_a_client_does_not_read_wait_and_then_all_arrive_in_order(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    """2,000 pipelined requests whose answers the client leaves unread for a second: the
    connection stops framing while its answers wait (the transport's write buffer is
    full), then goes on; every answer arrives, in order."""
    fast, _ = servers
    count = 2000
    bodies = [
        json.dumps({"id": str(i), "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                               "data": [i, i, i, i]}]}).encode()
        for i in range(count)
    ]  # fmt: skip
    with connect(fast) as sock:
        sock.settimeout(30)
        sender = threading.Thread(
            target=sock.sendall,
            args=(b"".join(post("/v2/models/add/infer", b) for b in bodies),),
        )
        sender.start()
        time.sleep(1.0)  # nothing read meanwhile
        buffer = bytearray()
        answers = [read_response(sock, buffer) for _ in range(count)]
        sender.join(30)
    for i, (status, _, body) in enumerate(answers):
        assert status == 200
        assert json.loads(body)["id"] == str(i)


def test_a_stopping_server_closes_its_idle_fast_path_connections(
    server: Server, tmp_path: Path, plugins_dir: Path
) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0")
    srv = start(server, tmp_path, plugins_dir)
    with connect(srv) as sock:
        sock.sendall(post("/v2/models/add/infer", JSON_BODY))
        status, headers, _ = read_response(sock, bytearray())
        assert status == 200 and "server" not in headers  # on the fast path, now idle
        srv.proc.send_signal(signal.SIGTERM)
        sock.settimeout(20)
        assert sock.recv(65536) == b""  # closed by the server as it stops
    assert srv.proc.wait(30) == 0
    assert "Traceback" not in srv.log()


def test_a_client_sending_ahead_of_its_answers_is_held_at_the_pause_mark(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    """One keep-alive connection pipelining 32 KiB requests as fast as the socket takes them,
    its answers read as they come: the server reads at most ``PAUSE_BYTES`` ahead of the
    request it serves (and the kernel's socket buffers), so the client's sends wait, and the
    server's memory stays flat."""
    fast, _ = servers
    request = post("/v2/models/add/infer", JSON_BODY + b" " * 32_000)
    before = rss_mib(fast.proc.pid)
    sent = answered = 0
    stop = time.monotonic() + 3.0

    def send(sock: socket.socket) -> None:
        nonlocal sent
        batch = request * 32
        with contextlib.suppress(OSError):
            while time.monotonic() < stop and sent < 1 << 30:
                sock.sendall(batch)
                sent += len(batch)

    peak = before
    with connect(fast) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 * 1024)
        sender = threading.Thread(target=send, args=(sock,), daemon=True)
        sender.start()
        buffer = bytearray()
        while time.monotonic() < stop:
            status, _, _ = read_response(sock, buffer)
            assert status == 200
            answered += 1
            if answered % 256 == 0:
                peak = max(peak, rss_mib(fast.proc.pid))
        ahead_mib = (sent - answered * len(request)) / (1 << 20)
        sock.shutdown(socket.SHUT_RDWR)
    sender.join(10)
    assert answered > 100
    assert ahead_mib < 48, f"the server took {ahead_mib:.0f} MiB ahead of its answers"
    assert peak - before < 96, f"RSS {before:.0f} -> {peak:.0f} MiB"
