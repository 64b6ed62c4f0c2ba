"""The request middleware: request ids, and the one place errors become HTTP responses.

An error's status and log level come from the data plane's table
(``server/dataplane/outcomes.py``); its body is ``{"error": message, ...}``, or the
shape a front end registered for the paths under its prefix (:class:`ErrorShapes`:
OpenAI's under ``/v1/``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from plugserve.registry.errors import PlugserveError, one_error
from plugserve.server.dataplane.outcomes import log_failure
from plugserve.server.http.bodies import BODIES, release_slot, too_large
from plugserve.server.http.connections import begin_request
from plugserve.server.runtime.logs import (
    REQUEST_CHAIN,
    REQUEST_ID,
    REQUEST_ID_HEADER,
    client_request_id,
    new_request_id,
)
from plugserve.server.state import SETTINGS

VARIANT_HEADER = "X-Plugserve-Variant"
"""The runner version (``name@version``) that served the request."""

log = structlog.get_logger("plugserve.server")


def identify(response: web.StreamResponse, request_id: str) -> None:
    """The answer's ``X-Request-ID`` and, once a runner version was chosen, its variant."""
    response.headers[REQUEST_ID_HEADER] = request_id
    chain = REQUEST_CHAIN.get()
    if chain is not None:
        response.headers[VARIANT_HEADER] = chain.variant


ErrorShape = Callable[[PlugserveError], Any]
"""An error's JSON body in a front end's own shape."""


class ErrorShapes:
    """The error shapes front ends registered, by the path prefix they serve."""

    def __init__(self) -> None:
        self.by_prefix: list[tuple[str, ErrorShape]] = []

    def add(self, prefix: str, shape: ErrorShape) -> None:
        self.by_prefix.append((prefix, shape))

    def body(self, exc: PlugserveError, path: str) -> Any:
        for prefix, shape in self.by_prefix:
            if path.startswith(prefix):
                return shape(exc)
        return exc.to_json()


ERROR_SHAPES = web.AppKey("error_shapes", ErrorShapes)


def error_shapes(app: web.Application) -> ErrorShapes:
    """The app's error shapes, for a front end to add its own to."""
    if ERROR_SHAPES not in app:
        app[ERROR_SHAPES] = ErrorShapes()
    return app[ERROR_SHAPES]


def error_response(
    exc: PlugserveError, path: str = "", shapes: ErrorShapes | None = None
) -> web.Response:
    """``exc`` as its status and JSON: ``{"error": message, ...}``, or the shape ``shapes``
    hold for ``path``."""
    return web.json_response(
        error_payload(exc, path, shapes), status=exc.status, headers=exc.headers()
    )


def error_payload(exc: PlugserveError, path: str = "", shapes: ErrorShapes | None = None) -> Any:
    """``exc``'s JSON body: ``{"error": message, ...}``, or the shape ``shapes`` hold for
    ``path``."""
    return exc.to_json() if shapes is None else shapes.body(exc, path)


def _plain_error(request: web.Request, status: int, message: str) -> web.Response:
    exc = PlugserveError(message)
    exc.status = status
    return error_response(exc, request.path, request.app.get(ERROR_SHAPES))


@web.middleware
async def request_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bind a request id to the log context, answer every error as ``{"error": ...}`` JSON.

    :class:`PlugserveError` carries its status; aiohttp's own HTTP errors (unknown
    path, wrong method, body too large) keep theirs; anything else is a 500
    whose details go to the log only. Only 500s (server faults) log at error
    level; other refusals are expected outcomes and log at debug. Tracebacks
    never show local variables (server/runtime/logs.py). The request's connection knows
    that a request is being handled (its header and body timeouts,
    ``server/http/connections.py``), and a large body never handed to a parser gives
    its place back when the request ends. One middleware for all of it: aiohttp
    wraps each middleware anew on every request.
    """
    connection = begin_request(request)
    app = request.app
    request_id = client_request_id(request.headers.get(REQUEST_ID_HEADER)) or new_request_id()
    REQUEST_ID.set(request_id)
    REQUEST_CHAIN.set(None)
    started = time.perf_counter()
    try:
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = _refusal(request, exc)
        except Exception as exc:
            response = _failure(request, exc)
        if response.status >= 400 and _large_body_left(request):
            # Refused before its body was read (404, 401, 429, 413 ...): aiohttp would read,
            # and inflate, the rest for up to 10 s after the answer. Close the connection.
            request.content.feed_eof()
            response.force_close()
        if not response.prepared:  # a stream (server/http/sse.py) set its headers as it began
            identify(response, request_id)
        if app[SETTINGS].access_log:
            log.info(
                "request",
                method=request.method,
                path=request.path,
                status=response.status,
                ms=round((time.perf_counter() - started) * 1000, 3),
                remote=request.remote,
            )
        return response
    finally:
        if connection is not None:
            connection.end()
        if app[BODIES].large:
            release_slot(request)


def failure(exc: Exception, path: str) -> PlugserveError:
    """The error answered for an exception a handler raised, logged at its level: a
    :class:`PlugserveError` as it is (an exception group: its one error, :func:`one_error`),
    anything else a 500 whose details go to the log only."""
    raised = one_error(exc)
    if not isinstance(raised, PlugserveError):
        log_failure(raised, path=path)
        error = PlugserveError("internal server error")
        error.status = 500
        return error
    log_failure(raised)
    return raised


def _failure(request: web.Request, exc: Exception) -> web.Response:
    """The answer to an exception raised by a handler, logged at its level."""
    return error_response(failure(exc, request.path), request.path, request.app.get(ERROR_SHAPES))


def _refusal(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own HTTP errors (unknown path, wrong method, body too large) as JSON."""
    reason = exc.reason
    if isinstance(exc, web.HTTPRequestEntityTooLarge):  # aiohttp's own body limit
        reason = too_large(request.app[SETTINGS].max_body_bytes).message
    response = _plain_error(request, exc.status, reason)
    if "Allow" in exc.headers:
        response.headers["Allow"] = exc.headers["Allow"]
    return response


LINGER_BYTES = 64 * 1024
"""An unread body larger than this (or compressed, or of unknown length) is not read after
an error answer: the connection closes. A smaller one is read and dropped, as aiohttp does,
so that the client sees the answer rather than a reset."""


def _large_body_left(request: web.Request) -> bool:
    if request.content.is_eof():
        return False
    length = request.content_length
    compressed = request.headers.get("Content-Encoding", "identity").lower() != "identity"
    return compressed or length is None or length > LINGER_BYTES
