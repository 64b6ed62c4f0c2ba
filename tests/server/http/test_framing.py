"""Which request heads the fast path takes, and what it makes of them."""

from __future__ import annotations

import pytest

from plugserve.server.http import fastpath
from plugserve.server.http.fastpath import FastPath
from plugserve.server.transport.h1framing import FastAnswer, FastRequest


async def _handler(request: FastRequest) -> FastAnswer | None:
    return None


def _fast() -> FastPath:
    fast = FastPath(max_body_bytes=1000, keepalive_timeout_s=75.0)
    fast.add_post("/v2/models/", "/infer", _handler, lambda route: True)
    return fast


def head(*lines: str, target: str = "/v2/models/add/infer", start: str = "") -> bytes:
    first = start or f"POST {target} HTTP/1.1"
    return "\r\n".join([first, "Host: x", *lines]).encode()


def test_a_plain_inference_head_is_taken() -> None:
    taken = _fast().take(head("Content-Length: 12", "Content-Type: application/json"))
    assert taken is not None
    _, path, segment, headers, length = taken
    assert (path, segment, length) == ("/v2/models/add/infer", "add", 12)
    assert headers["content-type"] == "application/json"  # case-insensitive


@pytest.mark.parametrize(
    "text",
    [
        head("Content-Length: 12", start="GET /v2/models/add/infer HTTP/1.1"),
        head("Content-Length: 12", start="POST /v2/models/add/infer HTTP/1.0"),
        head("Content-Length: 12", start="POST  /v2/models/add/infer HTTP/1.1"),
        head("Content-Length: 12", target="/v2/models/add/infer?x=1"),
        head("Content-Length: 12", target="/v2/models/a%20b/infer"),
        head("Content-Length: 12", target="/v2/models/a/versions/1/infer"),
        head("Content-Length: 12", target="/v2/models//infer"),
        head("Content-Length: 12", target="/v2/models/add/ready"),
        head(),  # no Content-Length
        head("Content-Length: 12", "Content-Length: 12"),
        head("Content-Length: +12"),
        head("Content-Length: 1_2"),
        head("Content-Length: 1001"),  # over the body limit
        head("Content-Length: 12", "Transfer-Encoding: chunked"),
        head("Content-Length: 12", "Expect: 100-continue"),
        head("Content-Length: 12", "Content-Encoding: gzip"),
        head("Content-Length: 12", "Upgrade: h2c"),
        head("Content-Length: 12", "Connection: close"),
        head("Content-Length: 12", "Bad Name: x"),
        head("Content-Length: 12", "X: a\x01b"),
        head("Content-Length: 12", " folded"),
        head("Content-Length: 12", "no colon"),
        head("Content-Length: 12", "Host: y"),  # a second Host: aiohttp's 400
        head("Content-Length: 12", *(f"X-{i}: v" for i in range(100))),
        "POST /v2/models/add/infer HTTP/1.1\r\nX: caf\u00e9\r\nContent-Length: 1".encode(),
    ],
)
def test_anything_else_is_left_to_aiohttp(text: bytes) -> None:
    assert _fast().take(text) is None


def test_a_head_seen_before_is_looked_up_and_the_kept_heads_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fastpath, "HEADS_KEPT", 4)
    fast = _fast()
    first = fast.take(head("Content-Length: 12"))
    again = fast.take(head("Content-Length: 12"))
    assert first is not None and again is first  # not parsed again
    for length in range(20, 30):
        assert fast.take(head(f"Content-Length: {length}")) is not None
    assert len(fast._heads) == 4  # the oldest went first
    assert fast.take(head("Content-Length: 12")) is not first  # parsed anew
