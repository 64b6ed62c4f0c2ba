"""HTTP/1.1 framing for the fast path: which request heads it takes, what it hands a
handler, and the raw answers a connection writes itself (``server/http/fastpath.py`` says
what the fast path is).

A head is taken only when nothing in it could be read two ways: a request line of exactly
three parts, ``POST``, ``HTTP/1.1``, a target that is a registered prefix, one plain path
segment and its suffix; header names that are tokens, values of visible ASCII; exactly
one ``Content-Length`` of digits; none of the headers that ask for more than a body. Every
other head is aiohttp's, from its first byte.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import orjson
from aiohttp.helpers import parse_content_type
from multidict import CIMultiDict, CIMultiDictProxy

MAX_HEAD_BYTES = 8190
"""A longer head is aiohttp's to answer (its own line and field limits are this size)."""

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_FIELD_VALUE = re.compile(rb"[\x21-\x7e](?:[\x20-\x7e\t]*[\x21-\x7e])?\Z|\Z")
_SEGMENT = re.compile(rb"[A-Za-z0-9._~!$&'()*+,=:@-]+\Z")
"""A path segment without ``%``, ``?``, ``#``, ``;`` or ``/``: its bytes are its text."""
_DECLINED_HEADERS = frozenset(
    {"transfer-encoding", "expect", "content-encoding", "upgrade", "te", "trailer"}
)
"""A request carrying one of these asks for more than a body: aiohttp's to serve."""
_SINGLETONS = frozenset(
    {"host", "content-type", "content-location", "content-range", "etag", "max-forwards",
     "server", "user-agent"}
)  # fmt: skip
"""Headers a request may carry once: aiohttp's parser answers 400 to a second one (RFC 9110
singletons; ``Content-Length`` and ``Transfer-Encoding`` are checked apart)."""
MAX_HEADERS = 100
"""More header lines than this are aiohttp's to answer."""


@dataclass(slots=True)
class FastRequest:
    """A framed request the fast path took: what a handler sees, and the data plane's
    :class:`~plugserve.server.dataplane.context.Incoming`."""

    path: str
    route: str
    """The path's one variable segment (the route of ``/v2/models/{route}/infer``)."""
    headers: CIMultiDictProxy[str]
    body: bytes
    remote: str | None = None

    @property
    def content_type(self) -> str:
        """As aiohttp reads it: the media type, ``application/octet-stream`` without one."""
        return parse_content_type(self.headers.get("Content-Type", ""))[0]


@dataclass(slots=True)
class FastAnswer:
    """What a handler answers: a status, its headers (``Content-Type`` among them), a body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


Taken = tuple["Route", str, str, CIMultiDictProxy[str], int]
"""A head the fast path takes: its route, path, path segment, headers and body length."""

FastHandler = Callable[[FastRequest], Awaitable[FastAnswer | None]]
"""Serves a request, or declines it (``None``) for aiohttp to serve, before it has
answered or counted anything of it."""


@dataclass(slots=True)
class Route:
    """``POST {prefix}{segment}{suffix}``, served by ``handler``; ``known(segment)`` says
    whether the segment names something served (aiohttp answers 404 to one that does not
    as soon as the head is in, before the body)."""

    prefix: bytes
    suffix: bytes
    handler: FastHandler
    known: Callable[[str], bool]


def could_be_taken(start: bytes | bytearray) -> bool:
    """Whether the first bytes of a head whose end has not come could still be one the fast
    path takes: aiohttp answers some heads before their end (bytes that are no request
    line, bare line feeds), and the fast path does as aiohttp does."""
    line = start[:6]
    return b"POST /".startswith(line) and start.count(b"\n") == start.count(b"\r\n")


def take(routes: list[Route], head: bytes, max_body_bytes: int) -> Taken | None:
    """The route, path, segment, headers and body length of a request head (without its
    blank line) that the fast path serves; ``None`` for aiohttp to serve."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1":
        return None
    target = parts[1]
    route = next(
        (r for r in routes if target.startswith(r.prefix) and target.endswith(r.suffix)),
        None,
    )
    if route is None:
        return None
    segment = target[len(route.prefix) : len(target) - len(route.suffix)]
    if _SEGMENT.match(segment) is None:  # nothing aiohttp would decode or refuse
        return None
    if len(lines) > MAX_HEADERS:
        return None
    headers: CIMultiDict[str] = CIMultiDict()
    length = None
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.match(name):
            return None  # no colon, a space before it, a folded line: aiohttp's
        value = value.strip(b" \t")
        if not _FIELD_VALUE.match(value):
            return None
        key = name.decode("ascii").lower()
        if key in _DECLINED_HEADERS:
            return None
        if key == "content-length":
            if length is not None or not value.isdigit() or len(value) > 15:
                return None
            length = int(value)
        elif key == "connection" and value.lower() != b"keep-alive":
            return None
        elif key in _SINGLETONS and key in headers:
            return None  # aiohttp refuses a second one: its 400
        headers.add(name.decode("ascii"), value.decode("ascii"))
    if length is None or length > max_body_bytes or "host" not in headers:
        return None  # HTTP/1.1 without Host: aiohttp's 400
    return route, target.decode("ascii"), segment.decode("ascii"), CIMultiDictProxy(headers), length


def raw_error(status: str, message: str, extra: str = "") -> bytes:
    """A closing answer (:func:`raw_answer`) whose JSON body is ``{"error": message}``."""
    return raw_answer(status, orjson.dumps({"error": message}), extra)


def raw_answer(status: str, body: bytes, extra: str = "") -> bytes:
    """An HTTP/1.1 answer written as bytes: ``status``, a JSON ``body``, the header lines
    ``extra`` (each ending ``\\r\\n``), and ``Connection: close``."""
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body
