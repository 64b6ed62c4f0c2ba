"""Differential: the fast path answers every byte stream as aiohttp alone answers it.

Two real servers, the same plugins and models: one with the fast path (the default), one
with ``fast_path = false``. Hypothesis writes what a client could send on one keep-alive
connection: one to four requests, valid v2 infer POSTs (JSON bodies, binary tensor data
with ``Inference-Header-Content-Length``) and hostile ones (broken framing, odd heads,
other methods, versions and targets, pipelining). Each stream goes, byte for byte, to
both servers on a fresh connection; the answers (status line, headers, body, in order,
and how the connection ended) must be the same but for the headers listed in
:func:`normalized` (``server/http/fastpath.py`` promises exactly that).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gzip
import json
import re
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.helpers import ServerProcess, write_add_runner

pytestmark = pytest.mark.slow

IDLE_S = 1.0
"""A connection that sends nothing more for this long after its last byte is done."""
MAX_WAIT_S = 15.0
"""The most one stream's answers are read for (every answer here takes milliseconds)."""
CLOSE = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
"""What most streams end with, so the servers close the connection rather than idle."""

Answer = tuple[bytes, tuple[tuple[str, str], ...], bytes]
Exchange = tuple[bytes, str]


# -- the servers ------------------------------------------------------------------------


def _start(root: Path, plugins: Path, fast_path: bool) -> ServerProcess:
    root.mkdir()
    (root / "models").mkdir()
    config = root / "plugserve.toml"
    config.write_text(f"fast_path = {'true' if fast_path else 'false'}\n")
    return ServerProcess("--plugins-dir", str(plugins), "--models-dir", str(root / "models"),
                         "--config", str(config), log=root / "server.log")  # fmt: skip


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ...]]:
    """(fast path, aiohttp alone): both started at once, the same plugins and models."""
    folder = tmp_path_factory.mktemp("differential")
    plugins = folder / "plugins"
    plugins.mkdir()
    write_add_runner(plugins, "add", "1.0.0", amount=1.0)
    started = [_start(folder / "fast", plugins, True), _start(folder / "plain", plugins, False)]
    try:
        for srv in started:
            srv.wait_ready()
        yield tuple(started)
    finally:
        for srv in started:
            srv.stop()
    for srv in started:
        assert "Traceback" not in srv.log(), srv.log()[-4000:]


@pytest.fixture(scope="module")
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        yield executor


# -- what a client sends ----------------------------------------------------------------

ROUTES = ["add", "missing", "a%64d", "..", ".", "Add", "add@1.0.0", "a:b", "-"]
HOST = b"Host: t"


def json_body(draw: Callable[..., Any]) -> tuple[bytes, list[bytes]]:
    """A v2 infer JSON body, well-formed or not, and the headers it goes with."""
    rows = draw(st.sampled_from([1, 2, 40]))
    width = draw(st.sampled_from([4, 4, 3]))
    data: list[Any] = draw(
        st.lists(
            st.one_of(st.integers(-100, 100), st.sampled_from([0.5, -1.25, 1e30, 3.0e-3])),
            min_size=rows * width,
            max_size=rows * width,
        )
    )
    tensor: dict[str, Any] = {"name": "x", "shape": [rows, width], "datatype": "FP32", "data": data}
    flaw = draw(
        st.sampled_from([None, None, None, "name", "datatype", "count", "nan", "syntax", "empty"])
    )
    if flaw == "name":
        tensor["name"] = "z"
    elif flaw == "datatype":
        tensor["datatype"] = draw(st.sampled_from(["INT64", "FP64", "BYTES", "FP99"]))
    elif flaw == "count":
        tensor["data"] = data[:-1]
    doc: dict[str, Any] = {"inputs": [tensor]}
    if draw(st.booleans()):
        doc["id"] = draw(st.sampled_from(["r1", "", "é"]))
    if draw(st.booleans()):
        doc["outputs"] = [{"name": draw(st.sampled_from(["y", "nope"]))}]
    body = json.dumps(doc).encode()
    if flaw == "nan":
        body = body.replace(b'"data": [', b'"data": [NaN, ', 1)
    elif flaw == "syntax":
        body = body[: len(body) // 2]
    elif flaw == "empty":
        body = draw(st.sampled_from([b"", b"{}", b'{"inputs": []}', b"[]", b"\xff"]))
    headers = []
    if draw(st.booleans()):
        headers.append(draw(st.sampled_from([b"Content-Type: application/json",
                                             b"Content-Type: text/plain",
                                             b"Content-Type: application/json; charset=utf-8"])))  # fmt: skip
    if rows == 40 or draw(st.booleans()):
        headers.append(draw(st.sampled_from([b"Accept-Encoding: gzip", b"Accept-Encoding: deflate",
                                             b"Accept-Encoding: gzip;q=0, *"])))  # fmt: skip
    return body, headers


def binary_body(draw: Callable[..., Any]) -> tuple[bytes, list[bytes]]:
    """A v2 infer body with binary tensor data, its JSON header's length in a header."""
    rows = draw(st.sampled_from([1, 2]))
    values = draw(st.lists(st.integers(-50, 50), min_size=rows * 4, max_size=rows * 4))
    data = struct.pack(f"<{len(values)}f", *values)
    tensor = {"name": "x", "shape": [rows, 4], "datatype": "FP32",
              "parameters": {"binary_data_size": len(data)}}  # fmt: skip
    doc: dict[str, Any] = {"inputs": [tensor]}
    if draw(st.booleans()):
        doc["outputs"] = [{"name": "y", "parameters": {"binary_data": draw(st.booleans())}}]
    header = json.dumps(doc).encode()
    length = str(len(header)).encode()
    length = draw(st.sampled_from([length, length, str(len(header) + 1).encode(), b"0", b"-1",
                                   b"abc", str(len(header) + len(data) + 5).encode()]))  # fmt: skip
    return header + data, [b"Inference-Header-Content-Length: " + length]


def chunked(draw: Callable[..., Any], body: bytes) -> bytes:
    """``body`` in one to three chunks, a chunk extension or a trailer perhaps."""
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=2)))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    out = b""
    for piece in pieces:
        if piece:
            size = f"{len(piece):x}".encode()
            out += draw(st.sampled_from([size, size.upper(), size + b";ext=1", b"0" + size]))
            out += b"\r\n" + piece + b"\r\n"
    return out + b"0\r\n" + draw(st.sampled_from([b"", b"", b"X-Trailer: 1\r\n"])) + b"\r\n"


def broken_chunks(draw: Callable[..., Any], body: bytes) -> bytes:
    size = f"{len(body):x}".encode()
    return draw(
        st.sampled_from([
            b"zz\r\n" + body + b"\r\n0\r\n\r\n",  # not a hex size
            size + b"\r\n" + body + b"0\r\n\r\n",  # no CRLF after the data
            size + b"\r\n" + body + b"\r\n",  # no last chunk
            f"{len(body) + 3:x}".encode() + b"\r\n" + body + b"\r\n0\r\n\r\n",  # size too large
            b"-1\r\n" + body + b"\r\n0\r\n\r\n",
            size + b" \r\n" + body + b"\r\n0\r\n\r\n",  # a space after the size
            size + b"\n" + body + b"\n0\n\n",  # bare LF
            b"fffffffffffffffff\r\n" + body,  # an overflowing size
        ])
    )  # fmt: skip


MUTATIONS = [
    "cl-missing", "cl-short", "cl-long", "cl-duplicate-same", "cl-duplicate-other",
    "cl-malformed", "cl-whitespace", "te-chunked", "te-chunked-broken", "te-and-cl",
    "te-other", "obs-fold", "space-before-colon", "bare-lf", "bare-lf-one-line",
    "nul-value", "non-ascii-value", "ctl-value", "http-1.0", "expect-100", "expect-other",
    "connection-close", "connection-other", "absolute-form", "query", "over-long-head",
    "many-headers", "method", "version", "target", "request-line", "host", "header-name",
    "content-encoding", "upgrade", "request-id", "empty-value",
]  # fmt: skip


@st.composite
def requests(draw: Callable[..., Any], hostile: bool) -> bytes:
    """One request's bytes: a v2 infer POST, and with ``hostile`` up to two flaws."""
    route = draw(st.sampled_from(ROUTES if hostile else ROUTES[:2]))
    method, target, version = b"POST", f"/v2/models/{route}/infer".encode(), b"HTTP/1.1"
    body, extra = (binary_body if draw(st.integers(0, 3)) == 0 else json_body)(draw)
    headers: list[bytes] = [HOST, *extra]
    if draw(st.integers(0, 3)) == 0:
        headers.append(b"X-Request-ID: client-" + str(draw(st.integers(0, 9))).encode())
    if draw(st.integers(0, 3)) == 0:
        headers.append(b"Connection: keep-alive")
    length_at = draw(st.integers(0, len(headers)))
    headers.insert(length_at, b"Content-Length: %d" % len(body))

    def replace_length(*lines: bytes) -> None:
        headers[length_at : length_at + 1] = list(lines)

    sep, payload = b"\r\n", body
    mutations = (
        draw(st.lists(st.sampled_from(MUTATIONS), max_size=2, unique=True)) if hostile else []
    )
    for mutation in mutations:
        if mutation == "cl-missing":
            replace_length()
        elif mutation == "cl-short":  # the body is shorter than declared
            replace_length(b"Content-Length: %d" % (len(body) + draw(st.integers(1, 9))))
        elif mutation == "cl-long":  # the body is longer than declared
            replace_length(b"Content-Length: %d" % max(0, len(body) - draw(st.integers(1, 9))))
        elif mutation == "cl-duplicate-same":
            headers.append(b"Content-Length: %d" % len(body))
        elif mutation == "cl-duplicate-other":
            headers.append(b"content-length: %d" % (len(body) + 1))
        elif mutation == "cl-malformed":
            value = draw(st.sampled_from(["+{n}", "-1", "{n}.0", "0x{n}", "{n} {n}", "", "{n},{n}",
                                          "00{n}", "9" * 20, "1_0", "\u0661"]))  # fmt: skip
            replace_length(b"Content-Length: " + value.format(n=len(body)).encode())
        elif mutation == "cl-whitespace":
            replace_length(b"Content-Length:\t %d \t" % len(body))
        elif mutation == "te-chunked":
            replace_length(b"Transfer-Encoding: chunked")
            payload = chunked(draw, body)
        elif mutation == "te-chunked-broken":
            replace_length(b"Transfer-Encoding: chunked")
            payload = broken_chunks(draw, body)
        elif mutation == "te-and-cl":
            headers.append(b"Transfer-Encoding: chunked")
            payload = chunked(draw, body)
        elif mutation == "te-other":
            headers.append(b"Transfer-Encoding: " + draw(st.sampled_from(
                [b"gzip", b"identity", b"chunked, identity", b"gzip, chunked", b"Chunked"]
            )))  # fmt: skip
        elif mutation == "obs-fold":
            at = draw(st.integers(0, len(headers)))
            headers[at:at] = [b"X-Folded: a", draw(st.sampled_from([b" b", b"\tb"]))]
        elif mutation == "space-before-colon":
            at = draw(st.integers(0, len(headers) - 1))
            name, _, value = headers[at].partition(b":")
            headers[at] = name + draw(st.sampled_from([b" ", b"\t"])) + b":" + value
        elif mutation == "bare-lf":
            sep = b"\n"
        elif mutation == "bare-lf-one-line":
            at = draw(st.integers(0, len(headers) - 1))
            headers[at] += b"\n" + draw(st.sampled_from([b"X-After-Lf: 1", HOST]))
        elif mutation in ("nul-value", "non-ascii-value", "ctl-value"):
            odd = {"nul-value": [b"\x00"], "non-ascii-value": [b"\xe9", b"\xc3\xa9", b"\x80"],
                   "ctl-value": [b"\x01", b"\x7f", b"\x1b", b"\r"]}[mutation]  # fmt: skip
            headers.append(b"X-Note: a" + draw(st.sampled_from(odd)) + b"b")
        elif mutation == "http-1.0":
            version = b"HTTP/1.0"
        elif mutation == "expect-100":
            headers.append(b"Expect: 100-continue")
        elif mutation == "expect-other":
            headers.append(b"Expect: " + draw(st.sampled_from([b"200-ok", b"100-Continue"])))
        elif mutation == "connection-close":
            headers.append(b"Connection: " + draw(st.sampled_from([b"close", b"Close"])))
        elif mutation == "connection-other":
            headers.append(b"Connection: " + draw(st.sampled_from(
                [b"Keep-Alive", b"keep-alive, close", b"upgrade", b"TE", b""]
            )))  # fmt: skip
        elif mutation == "absolute-form":
            target = draw(st.sampled_from([b"http://t", b"https://t:1", b"//t"])) + target
        elif mutation == "query":
            target += draw(st.sampled_from([b"?x=1", b"?", b"#f", b"?a=%zz"]))
        elif mutation == "over-long-head":  # around the head limits (8190 bytes)
            size = 8190 - len(target) - 40 + draw(st.integers(-20, 20)) - len(sep.join(headers))
            headers.append(b"X-Pad: " + b"a" * max(1, draw(st.sampled_from([size, 9000]))))
        elif mutation == "many-headers":  # around the header count limits (100 and 128)
            count = draw(st.sampled_from([95, 96, 97, 98, 99, 100, 127, 128, 129]))
            headers += [b"X-%d: v" % i for i in range(count - len(headers))]
        elif mutation == "method":
            method = draw(
                st.sampled_from([b"GET", b"HEAD", b"PUT", b"post", b"OPTIONS", b"DELETE"])
            )
        elif mutation == "version":
            version = draw(st.sampled_from([b"HTTP/1.2", b"HTTP/2.0", b"HTTP/0.9", b"http/1.1"]))
        elif mutation == "target":
            target = draw(st.sampled_from([
                b"/v2/models/add/infer/", b"/v2/models//infer", b"/v2/models/add/versions/1.0.0/infer",
                b"//v2/models/add/infer", b"/v2/models/add;x/infer", b"/v2/models/add/INFER",
                b"*", b"/v2/models/add%2Finfer", b"/v2/models/add/infer%00", b"/v2/models/\xc3\xa9/infer",
                b"/v2/models/add/ready", b"v2/models/add/infer", b"/v2/models/add/infer?",
            ]))  # fmt: skip
        elif mutation == "request-line":
            method = draw(st.sampled_from([b"POST ", b"POST\t", b" POST", b""]))
        elif mutation == "host":
            if draw(st.booleans()):
                headers.remove(HOST)
            else:
                headers.append(b"Host: u")
        elif mutation == "header-name":
            headers.append(
                draw(st.sampled_from([b"X(y): z", b"X y: z", b": z", b"NoColon", b"X\x00: z"]))
            )
        elif mutation == "content-encoding":
            headers.append(b"Content-Encoding: gzip")
            if draw(st.booleans()):
                payload = gzip.compress(payload, mtime=0)
                headers = [h for h in headers if not h.lower().startswith(b"content-length:")]
                headers.append(b"Content-Length: %d" % len(payload))
        elif mutation == "upgrade":
            headers += [
                b"Upgrade: h2c",
                b"Connection: Upgrade, HTTP2-Settings",
                b"HTTP2-Settings: ",
            ]
        elif mutation == "request-id":
            headers.append(
                b"X-Request-ID: " + draw(st.sampled_from([b"has space", b"x" * 300, b""]))
            )
        elif mutation == "empty-value":
            headers.append(
                draw(st.sampled_from([b"X-Empty:", b"Content-Type:", b"Accept-Encoding:"]))
            )
    request_line = method + b" " + target + b" " + version
    return sep.join([request_line, *headers]) + sep + sep + payload


@st.composite
def streams(draw: Callable[..., Any], hostile: bool) -> bytes:
    """What one client sends on one connection: one to four requests, most often then a
    health check that asks the server to close."""
    sent = b"".join(draw(st.lists(requests(hostile), min_size=1, max_size=4)))
    if hostile and draw(st.integers(0, 7)) == 0:
        sent = sent[: draw(st.integers(1, len(sent)))]  # the client stops mid-request
    if draw(st.integers(0, 5)) != 0:
        sent += CLOSE
    return sent


# -- what the servers answer ------------------------------------------------------------


def exchange(srv: ServerProcess, sent: bytes, first: int = 0, answered: int = 0) -> Exchange:
    """What ``srv`` answers to ``sent`` on a fresh connection, and how the exchange ended:
    ``closed`` by the server, ``reset``, or ``idle`` (nothing for ``IDLE_S``). With
    ``first``, the client sends that many bytes first and the rest once ``answered``
    answers to them have arrived."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.settimeout(IDLE_S)
        data, ended, deadline = b"", "idle", time.monotonic() + MAX_WAIT_S
        rest = sent
        if first:
            sock.sendall(sent[:first])
            rest = sent[first:]
            while complete(data) < answered and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    chunk = sock.recv(65536)
                    if not chunk:  # it answered otherwise than the fast path: compared next
                        return data, "closed"
                    data += chunk
        sock.sendall(rest)
        try:
            while time.monotonic() < deadline:
                chunk = sock.recv(65536)
                if not chunk:
                    ended = "closed"
                    break
                data += chunk
        except TimeoutError:
            pass
        except ConnectionResetError:
            ended = "reset"
    return data, ended


def complete(data: bytes) -> int:
    """How many whole answers with a ``Content-Length`` body ``data`` holds."""
    count = 0
    while (end := data.find(b"\r\n\r\n")) >= 0:
        length = re.search(rb"\r\ncontent-length: *(\d+)", data[:end], re.IGNORECASE)
        size = end + 4 + (int(length[1]) if length else 0)
        if len(data) < size:
            break
        data, count = data[size:], count + 1
    return count


def fast_served(sent: bytes, received: bytes) -> tuple[int, int]:
    """How many leading answers the fast path gave (aiohttp's name itself in ``Server``),
    and the length of the requests they answered: each is a head the fast path took (its
    one ``Content-Length`` says how long its body is)."""
    served = 0
    for head in re.split(rb"(?=HTTP/1\.[01] )", received)[1:]:
        if b"\r\nServer: " in head.split(b"\r\n\r\n")[0]:
            break
        served += 1
    offset = 0
    for _ in range(served):
        end = sent.index(b"\r\n\r\n", offset)
        length = re.search(rb"\r\ncontent-length:[ \t]*(\d+)", sent[offset:end], re.IGNORECASE)
        assert length is not None, sent[offset:end]
        offset = end + 4 + int(length[1])
    return served, offset


GENERATED_ID = re.compile(r"[0-9a-f]{32}\Z")
"""A request id a server made up (``new_request_id``: its process's prefix, a counter)."""


def normalized(headers: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The headers that must be the same, sorted (the fast path writes its own in another
    order, which HTTP gives no meaning to), names lowercased.

    Left out, as they legitimately differ:

    - ``Date``: the time of the answer, which the two servers write a moment apart;
    - ``Server``: aiohttp names itself, the fast path does not (``test_fastpath.py`` uses
      this to tell who answered); it says who the software is, nothing of the answer;

    and the value of ``X-Request-ID`` (``REQUEST_ID_HEADER``), where the server made it up:
    each process numbers its requests itself. A client's own id is echoed, so kept.
    """
    kept = []
    for name, value in headers:
        if name in ("date", "server"):
            continue
        if name == "x-request-id" and GENERATED_ID.match(value):
            value = "<generated>"
        kept.append((name, value))
    return tuple(sorted(kept))


def answers(data: bytes) -> list[Answer]:
    """The responses in ``data``, in order; what cannot be read as one is kept whole as
    the last entry's body."""
    found: list[Answer] = []
    while data:
        end = data.find(b"\r\n\r\n")
        if not data.startswith(b"HTTP/") or end < 0:
            found.append((b"<unparsed>", (), data))
            break
        status_line, *lines = data[:end].split(b"\r\n")
        headers = []
        for line in lines:
            name, _, value = line.decode("latin-1").partition(":")
            headers.append((name.strip().lower(), value.strip()))
        rest = data[end + 4 :]
        length = next((int(v) for n, v in headers if n == "content-length"), None)
        status = int(status_line.split(b" ")[1])
        if status < 200 or status in (204, 304) or rest.startswith(b"HTTP/1.") or not rest:
            size = 0  # no body, or a HEAD's answer (what follows is the next answer)
        else:
            size = len(rest) if length is None else length  # without a length: to the close
        found.append((status_line, normalized(headers), rest[:size]))
        data = rest[size:]
    return found


def differential(servers: tuple[ServerProcess, ...], pool: Any, sent: bytes) -> None:
    """The same answers from both servers to ``sent``.

    aiohttp's answer depends on how the bytes arrive: when a request it cannot parse
    comes in the same read as whole requests before it, it answers only that 400 and
    drops the others (``web_protocol.RequestHandler.data_received``); in separate reads,
    it answers each. The fast path frames the requests it takes itself and hands aiohttp
    the rest in one read, so it answers as aiohttp alone answers when the requests the
    fast path served come first, the rest once they are answered. Where the answers to
    ``sent`` in one write differ, aiohttp alone is asked again so: the fast path's answers
    must be the same as one of aiohttp's. (That the fast path took those requests at all
    is checked by their answers: aiohttp answers them itself here.)
    """
    fast, plain = pool.map(lambda srv: exchange(srv, sent), servers)
    if not same(fast, plain):
        served, offset = fast_served(sent, fast[0])
        if 0 < offset < len(sent):
            plain = exchange(servers[1], sent, first=offset, answered=served)
    detail = f"\nsent: {sent!r}\nfast path: {fast!r}\naiohttp alone: {plain!r}"
    ours, theirs = answers(fast[0]), answers(plain[0])
    assert len(ours) == len(theirs), detail
    for index, (one, other) in enumerate(zip(ours, theirs, strict=True)):
        assert one[0] == other[0], f"answer {index}: status line{detail}"
        assert one[1] == other[1], f"answer {index}: headers{detail}"
        assert one[2] == other[2], f"answer {index}: body{detail}"
    # How the connection ended: closed by both, or left open by both.
    assert fast[1] == plain[1], f"the connection {fast[1]} / {plain[1]}{detail}"


def same(fast: Exchange, plain: Exchange) -> bool:
    return answers(fast[0]) == answers(plain[0]) and fast[1] == plain[1]


BOUNDED = settings(
    deadline=None,
    derandomize=True,  # the same examples on every run: CI is reproducible
    database=None,
    # No shrinking: an example whose connection idles waits IDLE_S on it, and a shrink
    # tries hundreds; the differences found so far have minimal examples below.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture],
)  # fmt: skip


@settings(BOUNDED, max_examples=25)
@given(sent=streams(hostile=False))
def test_valid_pipelines_are_answered_alike(
    servers: tuple[ServerProcess, ...], pool: concurrent.futures.ThreadPoolExecutor, sent: bytes
) -> None:
    differential(servers, pool, sent)


@settings(BOUNDED, max_examples=45)
@given(sent=streams(hostile=True))
def test_hostile_streams_are_answered_alike(
    servers: tuple[ServerProcess, ...], pool: concurrent.futures.ThreadPoolExecutor, sent: bytes
) -> None:
    differential(servers, pool, sent)


# -- the differences found, each at its smallest --------------------------------------

INFER = b'{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}'


def test_a_request_without_host_is_refused_as_aiohttp_refuses_it(
    servers: tuple[ServerProcess, ...], pool: concurrent.futures.ThreadPoolExecutor
) -> None:
    """aiohttp answers an HTTP/1.1 request without ``Host`` 400 ("Missing 'Host' header in
    request.") and closes; ``framing.take`` takes it, and the fast path answers 200."""
    differential(servers, pool, b"POST /v2/models/add/infer HTTP/1.1\r\nContent-Length: %d"
                 b"\r\n\r\n%s" % (len(INFER), INFER))  # fmt: skip


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", id="tls-client-hello"),
        pytest.param(b"POST /v2/models/add/infer HTTP/1.1\nHost: t\n\n", id="bare-lf-head"),
    ],
)
def test_bytes_aiohttp_refuses_before_a_blank_line_are_refused_at_once(
    servers: tuple[ServerProcess, ...], pool: concurrent.futures.ThreadPoolExecutor, sent: bytes
) -> None:
    """aiohttp answers 400 as soon as a request line cannot be one (TLS on the plain port:
    "Received HTTPS traffic on an HTTP port"); ``Connection._frame`` waits for a
    ``\\r\\n\\r\\n`` (or 8190 bytes) before anything is decided, so nothing is
    answered until ``header_timeout_s`` (408)."""
    differential(servers, pool, sent)


def test_an_unknown_route_is_refused_before_its_body_has_come(
    servers: tuple[ServerProcess, ...], pool: concurrent.futures.ThreadPoolExecutor
) -> None:
    """aiohttp runs the handler once the head is in, and the data plane answers 404 for
    an unknown route before the body is read; the fast path waits for the whole body
    (``Connection._frame``) before its handler runs, so nothing is answered meanwhile."""
    differential(servers, pool, b"POST /v2/models/missing/infer HTTP/1.1\r\nHost: t\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(INFER) + 1, INFER))  # fmt: skip
