"""gzip and deflate: responses when Accept-Encoding asks, request bodies when Content-Encoding says."""

import gzip
import json
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from plugserve.server.http.compression import accepted, compress
from tests.helpers import ServerProcess, write_add_runner


def test_the_coding_follows_accept_encoding() -> None:
    for header, coding in [
        (None, None),
        ("", None),
        ("identity", None),
        ("gzip", "gzip"),
        ("deflate", "deflate"),
        ("deflate, gzip", "gzip"),
        ("gzip;q=0, deflate", "deflate"),
        ("GZIP ; q=0.5", "gzip"),
        ("*", "gzip"),
        ("br, zstd", None),
        ("gzip;q=nope", None),
        # Found by attacking it: an explicit q=0 stands against "*" (RFC 9110).
        ("gzip;q=0, *", "deflate"),
        ("gzip;q=0, deflate;q=0, *", None),
        ("*;q=0", None),
    ]:
        assert accepted(header) == coding, header
    body = b"0123456789" * 500
    assert gzip.decompress(compress(body, "gzip")) == body
    assert zlib.decompress(compress(body, "deflate")) == body  # HTTP's deflate: the zlib format


@pytest.fixture
def add_server(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> ServerProcess:
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    return server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))


@pytest.mark.slow
@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("request_coding", [None, "gzip", "deflate"])
@pytest.mark.parametrize("response_coding", [None, "gzip", "deflate"])
def test_tritonclient_compresses_both_ways(
    add_server: ServerProcess,
    binary: bool,
    request_coding: str | None,
    response_coding: str | None,
) -> None:
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{add_server.port}")
    x = np.arange(1200, dtype=np.float32).reshape(300, 4)
    inp = httpclient.InferInput("x", [300, 4], "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("y", binary_data=binary)
    result = client.infer(
        "add", [inp], outputs=[out],
        request_compression_algorithm=request_coding,
        response_compression_algorithm=response_coding,
    )  # fmt: skip
    np.testing.assert_array_equal(result.as_numpy("y"), x + 1)
    client.close()


@pytest.mark.slow
def test_only_an_answer_worth_compressing_is_compressed(add_server: ServerProcess) -> None:
    def infer(rows: int, accept: str | None) -> tuple[dict[str, str], bytes]:
        doc = {"inputs": [{"name": "x", "shape": [rows, 4], "datatype": "FP32",
                           "data": [0.5] * (rows * 4)}]}  # fmt: skip
        headers = {"Accept-Encoding": accept} if accept else {}
        status, got, body = add_server.request("POST", "/v2/models/add/infer", doc, headers)
        assert status == 200
        return got, body

    for rows in (200, 8000):  # 8000 rows: over 64 KiB, compressed off the event loop
        headers, body = infer(rows, "gzip")
        assert headers["Content-Encoding"] == "gzip"
        assert headers["Vary"] == "Accept-Encoding"  # caches must not mix the codings
        assert json.loads(gzip.decompress(body))["outputs"][0]["data"] == [1.5] * rows * 4
    headers, body = infer(200, "deflate;q=1, gzip;q=0")
    assert headers["Content-Encoding"] == "deflate"
    assert json.loads(zlib.decompress(body))["outputs"][0]["data"] == [1.5] * 800
    for rows, accept in ((200, None), (200, "br"), (1, "gzip")):  # not asked, or too small
        headers, body = infer(rows, accept)
        assert "Content-Encoding" not in headers
        assert json.loads(body)["outputs"][0]["data"] == [1.5] * rows * 4
