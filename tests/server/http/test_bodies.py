"""Request bodies: limits that name their setting, large bodies parsed on a bounded pool."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
from pathlib import Path

import pytest
from aiohttp.test_utils import make_mocked_request

from plugserve.registry.errors import TooManyRequests
from plugserve.server.http.bodies import BODIES, Bodies
from tests.helpers import write_add_runner

X = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}]}
LIMIT_MESSAGE = "the request body is larger than max_body_bytes = 1024 bytes"


@pytest.mark.parametrize("path", ["/v2/models/add/infer", "/predict/add"])
async def test_a_body_over_the_limit_is_413_naming_the_setting(  # type: ignore[no-untyped-def]
    plugins_dir: Path, client, path: str
) -> None:
    """issue 12, finding 18: the 413 names max_body_bytes and its value, whether the body
    is plain, announced too large by Content-Length, or inflates past the limit."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client(max_body_bytes=1024)
    bodies = [
        ({}, b"x" * 2048),
        ({"Content-Encoding": "gzip"}, gzip.compress(b" " * 4096)),  # 4 KiB inflated
    ]
    for headers, body in bodies:
        resp = await cli.post(path, data=body, headers=headers)
        assert resp.status == 413
        assert (await resp.json())["error"] == LIMIT_MESSAGE


async def test_aiohttps_own_413_names_the_setting_too(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 18: a control-plane body over the limit (read by aiohttp)."""
    cli = await client(max_body_bytes=1024)
    resp = await cli.put("/admin/routes/r", data=json.dumps({"runner": "x" * 2048}))
    assert resp.status == 413
    assert (await resp.json())["error"] == LIMIT_MESSAGE


async def test_a_gzip_body_within_the_limit_is_served(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client()
    body = gzip.compress(json.dumps(X).encode())
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    resp = await cli.post("/v2/models/add/infer", data=body, headers=headers)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["outputs"][0]["data"] == [1, 2, 3, 4]


async def test_an_unknown_route_is_404_before_the_body_is_read(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 11: 404 comes first, even for a body over the limit."""
    cli = await client(max_body_bytes=1024)
    for path in ("/v2/models/nope/infer", "/predict/nope"):
        resp = await cli.post(path, data=b"x" * 4096)
        assert resp.status == 404
        assert "Request for unknown model: 'nope' is not found" in (await resp.json())["error"]


async def test_large_body_parses_are_bounded() -> None:
    """issue 12, finding 11 (the class): at most max_large_bodies large bodies are held
    (read or parsed) at once; the next gets 429 with Retry-After, and its place comes back
    when one ends."""
    bodies = Bodies(1 << 20, threads=1, max_large=2)
    gate = threading.Event()

    def held(body: bytes) -> int:
        gate.wait(10)
        return len(body)

    requests = [make_mocked_request("POST", "/") for _ in range(4)]
    for request in requests[:2]:
        bodies.take(request)
    running = [
        asyncio.ensure_future(bodies.parse(r, b"x" * n, held))
        for r, n in zip(requests, (1, 2), strict=False)
    ]
    await asyncio.sleep(0.05)
    assert bodies.large == 2
    with pytest.raises(TooManyRequests) as refused:
        bodies.take(requests[2])
    assert "max_large_bodies = 2" in refused.value.message
    assert refused.value.headers() == {"Retry-After": "1"}
    gate.set()
    assert await asyncio.gather(*running) == [1, 2]
    await asyncio.sleep(0.05)
    assert bodies.large == 0
    bodies.take(requests[3])
    assert await bodies.parse(requests[3], b"abc", len) == 3
    await asyncio.sleep(0.05)
    assert bodies.large == 0
    assert await bodies.parse(make_mocked_request("POST", "/"), b"abc", len) == 3  # small: inline
    bodies.close()


async def test_a_cancelled_parse_keeps_its_place_until_its_thread_is_done() -> None:
    """A hung-up client's parse still occupies the pool: it is counted until it ends."""
    bodies = Bodies(1 << 20, threads=1, max_large=1)
    gate = threading.Event()
    request = make_mocked_request("POST", "/")
    bodies.take(request)
    task = asyncio.ensure_future(bodies.parse(request, b"x", lambda body: gate.wait(10)))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.sleep(0.05)
    assert bodies.large == 1
    gate.set()
    await asyncio.sleep(0.1)
    assert bodies.large == 0
    bodies.close()


async def test_large_bodies_being_uploaded_hold_their_places(  # type: ignore[no-untyped-def]
    plugins_dir: Path, client
) -> None:
    """Review of issue 12: the max_large_bodies bound applied only once a body was read, so
    any number of 64 MiB uploads could be held in memory at once. A large body now takes its
    place before it is read; one that never ends gives it back when its request ends."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client(max_large_bodies=1)
    _reader, writer = await asyncio.open_connection(cli.host, cli.port)
    writer.write(b"POST /v2/models/add/infer HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Length: 1048576\r\n\r\n" + b" " * 300_000)  # fmt: skip
    await writer.drain()
    await asyncio.sleep(0.2)
    big = b" " * 600_000 + b'{"inputs": []}'
    resp = await cli.post("/v2/models/add/infer", data=big)
    assert resp.status == 429
    assert "max_large_bodies = 1" in (await resp.json())["error"]
    small = await cli.post("/v2/models/add/infer", json=X)
    assert small.status == 200  # small bodies hold no place
    writer.close()  # the held upload ends: its place comes back
    await asyncio.sleep(0.2)
    resp = await cli.post("/v2/models/add/infer", data=big)
    assert resp.status == 400  # read and parsed: no inputs
    assert cli.app[BODIES].large == 0


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
async def test_a_body_that_cannot_be_inflated_is_400(  # type: ignore[no-untyped-def]
    plugins_dir: Path, client, encoding: str
) -> None:
    """A broken compressed body is the client's mistake: 400 naming it, not a 500."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client()
    for path in ("/v2/models/add/infer", "/predict/add"):
        resp = await cli.post(path, data=b"not compressed", headers={"Content-Encoding": encoding})
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert (
            error == f"the request body cannot be read: Can not decode content-encoding: {encoding}"
        )
    assert (await cli.post("/v2/models/add/infer", json=X)).status == 200
