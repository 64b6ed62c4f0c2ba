"""Issue 29 finding 1: a request's size is bounded before any plugin sees it, on every front
end. A body over ``max_body_bytes`` (64 KiB here), plain or compressed (counted inflated),
is refused with 413 (gRPC: RESOURCE_EXHAUSTED) by the bundled routes' server, which then
still answers health and a good request."""

from __future__ import annotations

import gzip
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.helpers import ROOT, ServerProcess

pytestmark = pytest.mark.slow

LIMIT = 64 * 1024
TOO_MUCH = "x" * (4 * LIMIT)
LIMIT_MESSAGE = f"the request body is larger than max_body_bytes = {LIMIT} bytes"


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("limits")
    config = folder / "limits.toml"
    config.write_text(f"max_body_bytes = {LIMIT}\n")
    srv = ServerProcess("--plugins-dir", str(ROOT / "plugins"), "--models-dir",
                        str(ROOT / "models"), "--config", str(config),
                        log=folder / "server.log")  # fmt: skip
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def _post(srv: ServerProcess, path: str, body: bytes, gzipped: bool) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if gzipped:
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    req = urllib.request.Request(srv.url + path, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _healthy(srv: ServerProcess) -> None:
    assert srv.request("GET", "/v2/health/live")[0] == 200
    status, _, body = srv.request("POST", "/v1/chat/completions", {"model": "chat", "messages": [
        {"role": "user", "content": "Hello!"}], "max_tokens": 2})  # fmt: skip
    assert status == 200, body


HTTP_FRONT_ENDS = {
    "v2 infer": ("/v2/models/iris/infer", {"inputs": [{"name": "input", "datatype": "BYTES",
                                                        "shape": [1], "data": [TOO_MUCH]}]}),
    "predict": ("/predict/iris", {"input": TOO_MUCH}),
    "generate": ("/v2/models/chat/generate", {"text_input": TOO_MUCH}),
    "generate_stream": ("/v2/models/chat/generate_stream", {"text_input": TOO_MUCH}),
    "chat": ("/v1/chat/completions", {"model": "chat", "messages": [
        {"role": "user", "content": TOO_MUCH}]}),
    "completions": ("/v1/completions", {"model": "chat", "prompt": TOO_MUCH}),
    "embeddings": ("/v1/embeddings", {"model": "embed", "input": TOO_MUCH}),
}  # fmt: skip


@pytest.mark.parametrize("gzipped", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("front_end", HTTP_FRONT_ENDS)
def test_an_http_body_over_the_limit_is_413_before_any_plugin(
    bundled: ServerProcess, front_end: str, gzipped: bool
) -> None:
    """Issue 29 finding 1 (bounded before a plugin): every HTTP front end, plain and gzip
    (256 KiB inflated from 1 KiB)."""
    path, body = HTTP_FRONT_ENDS[front_end]
    status, raw = _post(bundled, path, json.dumps(body).encode(), gzipped)
    assert status == 413, raw[:300]
    error = json.loads(raw)
    message = error["error"]["message"] if isinstance(error["error"], dict) else error["error"]
    assert message == LIMIT_MESSAGE
    _healthy(bundled)


def _iris_request(rows: int) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="iris")
    request.inputs.add(name="input", datatype="FP32", shape=[rows, 4])
    request.raw_input_contents.append(np.zeros((rows, 4), np.float32).tobytes())
    return request


@pytest.mark.parametrize("compression", [grpc.Compression.NoCompression, grpc.Compression.Gzip],
                         ids=["plain", "gzip"])  # fmt: skip
def test_a_grpc_message_over_the_limit_is_resource_exhausted(
    bundled: ServerProcess, compression: grpc.Compression
) -> None:
    """Issue 29 finding 1 (bounded before a plugin), gRPC: ModelInfer and ModelStreamInfer,
    plain and gzip (256 KiB of zeros inflated from a few hundred bytes)."""
    too_big = _iris_request(LIMIT // 4)  # 256 KiB of FP32
    with grpc.insecure_channel(bundled.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(too_big, compression=compression, timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        stream = stub.ModelStreamInfer(iter([too_big]), compression=compression, timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        good = stub.ModelInfer(_iris_request(1), compression=compression, timeout=30)
        assert good.outputs
    _healthy(bundled)


def test_a_body_at_the_limit_is_served(bundled: ServerProcess) -> None:
    """The bound is the limit itself: a chat body just under it is read and answered (400:
    its prompt is too long for the model, which only a plugin can tell)."""
    content = "hi " * ((LIMIT - 200) // 3)
    body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": content}]})
    assert len(body) <= LIMIT
    status, raw = _post(bundled, "/v1/chat/completions", body.encode(), False)
    assert status == 400 and b"at most 1024 are allowed" in raw, raw[:300]


JSON_LIMIT = 64 * 1024
JSON_MESSAGE = "more than max_json_bytes = 65536"


@pytest.fixture(scope="module")
def json_bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Bodies up to 4 MiB, their JSON up to 64 KiB."""
    folder = tmp_path_factory.mktemp("json-limits")
    config = folder / "limits.toml"
    config.write_text(f"max_body_bytes = {4 << 20}\nmax_json_bytes = {JSON_LIMIT}\n")
    srv = ServerProcess("--plugins-dir", str(ROOT / "plugins"), "--models-dir",
                        str(ROOT / "models"), "--config", str(config),
                        log=folder / "server.log")  # fmt: skip
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def _message(raw: bytes) -> str:
    error = json.loads(raw)
    return str(error["error"]["message"] if isinstance(error["error"], dict) else error["error"])


@pytest.mark.parametrize("gzipped", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("front_end", HTTP_FRONT_ENDS)
def test_json_over_max_json_bytes_is_413_before_it_is_parsed(
    json_bounded: ServerProcess, front_end: str, gzipped: bool
) -> None:
    """Issue 29, from the hostile soak: 45 MiB JSON bodies (within max_body_bytes) held the
    interpreter for 1-2 s each while orjson parsed them on a body thread, and HTTP health
    waited as long. A request's JSON is now bounded apart (max_json_bytes), before it is
    parsed, on every JSON front end, plain and gzip (counted inflated)."""
    path, body = HTTP_FRONT_ENDS[front_end]
    status, raw = _post(json_bounded, path, json.dumps(body).encode(), gzipped)
    assert status == 413, raw[:300]
    assert JSON_MESSAGE in _message(raw), raw[:300]
    assert json.loads(raw).get("max_json_bytes") == JSON_LIMIT or "max_json_bytes" in raw.decode()
    _healthy(json_bounded)


def _binary_infer(srv: ServerProcess, rows: int, request_id: str = "") -> tuple[int, bytes]:
    header = json.dumps({"id": request_id, "inputs": [{"name": "input", "datatype": "FP32",
        "shape": [rows, 4], "parameters": {"binary_data_size": rows * 16}}],
        "outputs": [{"name": "probabilities", "parameters": {"binary_data": False}}]}).encode()  # fmt: skip
    body = header + np.ones((rows, 4), np.float32).tobytes()
    status, _, raw = srv.request("POST", "/v2/models/iris/infer", body, {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream"})  # fmt: skip
    return status, raw


def test_binary_tensor_data_is_bounded_by_max_body_bytes_not_max_json_bytes(
    json_bounded: ServerProcess,
) -> None:
    """Variant: the bound is on JSON text, not on a request's size. 256 KiB of binary FP32
    (four times max_json_bytes) is served; the same tensor as JSON is 413; so is a binary
    request whose JSON header alone is over the bound (a long id)."""
    rows = 16384  # 256 KiB of FP32
    status, raw = _binary_infer(json_bounded, rows)
    assert status == 200, raw[:300]
    assert json.loads(raw[: raw.index(b"}]}") + 3])["outputs"][0]["shape"] == [rows, 3]
    as_json = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [rows, 4],
                           "data": [1.0] * (rows * 4)}]}  # fmt: skip
    status, _, raw = json_bounded.request("POST", "/v2/models/iris/infer", as_json)
    assert status == 413 and JSON_MESSAGE in _message(raw), raw[:300]
    status, raw = _binary_infer(json_bounded, 1, request_id="x" * JSON_LIMIT)
    assert status == 413 and JSON_MESSAGE in _message(raw), raw[:300]
    _healthy(json_bounded)


SPELLINGS: dict[str, Callable[[int], str]] = {
    "plus": lambda n: f"+{n}",
    "underscore": lambda n: f"{n // 10}_{n % 10}",
    "spaces": lambda n: f" {n} ",
    "4400-digits": lambda n: "9" * 4400,
}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_header_length_in_any_spelling_is_bounded_or_refused(
    json_bounded: ServerProcess, spelling: str
) -> None:
    """Variant, from the review: the JSON header's declared length was checked against
    max_json_bytes only when it was all digits, while the parser takes what int() takes:
    "+65600" or "6560_0" let a header over the bound be parsed, and 4,400 digits (more than
    int() converts) were a 500. Every spelling int() takes is bounded; the rest is 400."""
    header = json.dumps({"id": "x" * JSON_LIMIT, "inputs": [{"name": "input", "datatype": "FP32",
        "shape": [1, 4], "parameters": {"binary_data_size": 16}}]}).encode()  # fmt: skip
    status, _, raw = json_bounded.request("POST", "/v2/models/iris/infer",
        header + np.ones(4, np.float32).tobytes(),
        {"Inference-Header-Content-Length": SPELLINGS[spelling](len(header)),
         "Content-Type": "application/octet-stream"})  # fmt: skip
    if spelling == "4400-digits":
        assert status == 400 and "must be an integer" in _message(raw), raw[:300]
    else:
        assert status == 413 and JSON_MESSAGE in _message(raw), raw[:300]
    _healthy(json_bounded)


def _status_after(srv: ServerProcess, head: str, body: bytes) -> tuple[int, bytes]:
    """Send ``head`` and ``body`` on a socket of its own; the status and body answered."""
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return int(answer.split(b" ", 2)[1]), answer.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize("path", ["POST /v2/systemsharedmemory/region/r/register",
                                  "POST /v2/repository/index",
                                  "POST /v2/repository/models/iris/load",
                                  "PUT /admin/routes/iris"])  # fmt: skip
def test_a_control_body_over_a_mib_is_413(json_bounded: ServerProcess, path: str) -> None:
    """Variant: the control routes read their JSON where it arrives (it is small by nature),
    bounded to 1 MiB whatever max_body_bytes allows: declared, or chunked and counted."""
    message = "a control request's body is at most 1048576 bytes"
    head = f"{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    status, raw = _status_after(json_bounded, head + f"Content-Length: {2 << 20}\r\n\r\n", b"")
    assert status == 413 and message in _message(raw), raw
    chunk = b"10000\r\n" + b" " * 65536 + b"\r\n"  # 64 KiB chunks, 17 of them: over 1 MiB
    status, raw = _status_after(json_bounded, head + "Transfer-Encoding: chunked\r\n\r\n",
                                chunk * 17)  # fmt: skip
    assert status == 413 and message in _message(raw), raw
    _healthy(json_bounded)


def test_a_grpc_repository_load_config_over_a_mib_is_resource_exhausted(
    json_bounded: ServerProcess,
) -> None:
    """Variant, gRPC: RepositoryModelLoad's ``config`` parameter, JSON parsed where it
    arrives, is bounded as the HTTP load's body is."""
    request = service_pb2.RepositoryModelLoadRequest(model_name="iris")
    request.parameters["config"].string_param = "{" + " " * (2 << 20) + "}"
    with grpc.insecure_channel(json_bounded.grpc_url, options=[
            ("grpc.max_send_message_length", 8 << 20)]) as channel:  # fmt: skip
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.RepositoryModelLoad(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    assert "parameter 'config' is at most 1048576 bytes" in str(info.value.details())
    _healthy(json_bounded)
