"""Issue 29 finding 1: a request's size is bounded before any plugin sees it, on every front
end. A body over ``max_body_bytes`` (64 KiB here), plain or compressed (counted inflated),
is refused with 413 (gRPC: RESOURCE_EXHAUSTED) by the bundled routes' server, which then
still answers health and a good request."""

from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

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
