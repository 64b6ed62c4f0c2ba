"""The fast path: plain HTTP/1.1 inference requests served without aiohttp's per-request
machinery.

A data-plane connection starts on the fast path (:class:`~.connections.Connection`). It
frames each request itself: the head up to its blank line, then exactly ``Content-Length``
bytes. A request the fast path takes (:meth:`FastPath.take`) is a strictly well-formed
``POST`` to a route that a front end registered here (the v2 ``infer`` of a route), over
HTTP/1.1, with one ``Content-Length`` within the small-body limits and nothing that asks
for more than a body (no ``Transfer-Encoding``, ``Expect``, ``Content-Encoding``,
``Upgrade`` or ``Connection`` other than ``keep-alive``, no query string, ASCII header
values). Its handler runs it through the data plane (``server/dataplane/plane.py``), as
any front end does, and its answer is written here.

Anything else, from the first byte of that request on, goes to aiohttp, which keeps the
connection from then on: the bytes are handed to its protocol as they came. A handler
may decline a request it has framed (a body its decoder refuses, a feature it leaves to
aiohttp): nothing has been answered or counted yet, and aiohttp answers it as it answers
every request. So every error a client can cause before the data plane runs is aiohttp's
(and the middleware's) answer, byte for byte; the fast path answers only what the data
plane answers: results, and the errors the request path raises (``server/http/middleware.py``
maps them, the one place errors become HTTP).
"""

from __future__ import annotations

import email.utils
import http
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from aiohttp import web

from plugserve.server.http.middleware import VARIANT_HEADER, ErrorShapes, error_payload, failure
from plugserve.server.runtime.logs import (
    REQUEST_CHAIN,
    REQUEST_ID,
    REQUEST_ID_HEADER,
    client_request_id,
    new_request_id,
)
from plugserve.server.transport.h1framing import (
    FastAnswer,
    FastHandler,
    FastRequest,
    Route,
    Taken,
    take,
)

log = structlog.get_logger("plugserve.server")

HEADS_KEPT = 256
HEAD_KEPT_BYTES = 2048
"""Request heads (up to this long, ``HEADS_KEPT`` of them) whose parse is kept."""


@dataclass
class FastPath:
    """The fast path of one app: the routes front ends registered, and the limits a
    request must be within."""

    max_body_bytes: int
    keepalive_timeout_s: float
    shapes: ErrorShapes | None = None
    access_log: bool = False
    routes: list[Route] = field(default_factory=list)
    _date: tuple[int, str] = (0, "")
    _heads: dict[bytes, Taken] = field(default_factory=dict)

    def add_post(
        self, prefix: str, suffix: str, handler: FastHandler, known: Callable[[str], bool]
    ) -> None:
        """Serve ``POST {prefix}{segment}{suffix}`` (one path segment, no query) with
        ``handler``; ``known(segment)`` says whether the segment names something served."""
        self.routes.append(Route(prefix.encode(), suffix.encode(), handler, known))

    def take(self, head: bytes) -> Taken | None:
        """What :func:`~plugserve.server.transport.h1framing.take` makes of a request head,
        within this app's routes and body limit; a head seen before (clients send the same
        head with every request) is looked up, not parsed again. Its headers are shared by
        the requests that sent it: handlers see them read-only."""
        heads = self._heads
        taken = heads.get(head)
        if taken is None:
            taken = take(self.routes, head, self.max_body_bytes)
            if taken is not None and len(head) <= HEAD_KEPT_BYTES:
                if len(heads) >= HEADS_KEPT:
                    del heads[next(iter(heads))]  # the oldest
                heads[head] = taken
        return taken

    async def serve(self, route: Route, request: FastRequest) -> tuple[bytes, bool] | None:
        """The response's bytes and whether the connection closes after them (an error
        that says ``Connection: close``); ``None`` when the handler declined the request.

        Runs as the request's own task, as aiohttp's handler would: its request id and chain
        are bound for the log lines of the request (:mod:`plugserve.server.runtime.logs`).
        A client that hangs up cancels it (the connection does), and nothing is written.
        """
        started = time.perf_counter()
        headers = request.headers
        request_id = client_request_id(headers.get(REQUEST_ID_HEADER)) or new_request_id()
        REQUEST_ID.set(request_id)
        REQUEST_CHAIN.set(None)
        try:
            answer = await route.handler(request)
        except Exception as exc:
            error = failure(exc, request.path)
            answer = FastAnswer(
                error.status,
                {"Content-Type": "application/json; charset=utf-8", **error.headers()},
                json.dumps(error_payload(error, request.path, self.shapes)).encode(),
            )
        if answer is None:
            return None
        if self.access_log:
            log.info(
                "request",
                method="POST",
                path=request.path,
                status=answer.status,
                ms=round((time.perf_counter() - started) * 1000, 3),
                remote=request.remote,
            )
        closes = answer.headers.get("Connection") == "close"
        return self.response(answer, request_id), closes

    def response(self, answer: FastAnswer, request_id: str) -> bytes:
        """The answer as HTTP/1.1 bytes: status line, headers, body."""
        status = answer.status
        head = [
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"
            f"Content-Length: {len(answer.body)}\r\n"
            f"Date: {self.date()}\r\n"
            f"{REQUEST_ID_HEADER}: {request_id}\r\n"
        ]
        chain = REQUEST_CHAIN.get()
        if chain is not None:
            head.append(f"{VARIANT_HEADER}: {chain.variant}\r\n")
        for name, value in answer.headers.items():
            head.append(f"{name}: {value}\r\n")
        head.append("\r\n")
        return "".join(head).encode("latin-1") + answer.body

    def date(self) -> str:
        """The ``Date`` header's value, formatted once a second."""
        now = int(time.time())
        second, text = self._date
        if second != now:
            text = email.utils.formatdate(now, usegmt=True)
            self._date = (now, text)
        return text


_REASONS = {status.value: status.phrase for status in http.HTTPStatus}


FAST_PATH = web.AppKey("fast_path", FastPath)
"""The app's fast path; data-plane connections take their requests through it."""
