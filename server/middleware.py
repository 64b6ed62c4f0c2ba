"""The request middleware: request ids, and the one place errors become HTTP responses."""

from __future__ import annotations

import itertools
import os
import time

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

from plugserve.registry.errors import InvalidInput, PluginError, PlugserveError, StreamingOnly
from plugserve.server.bodies import release_slot, too_large
from plugserve.server.connections import begin_request
from plugserve.server.logs import REQUEST_CHAIN, REQUEST_ID
from plugserve.server.openai_api import errors as openai_errors
from plugserve.server.state import BODIES, SETTINGS

REQUEST_ID_HEADER = "X-Request-ID"
VARIANT_HEADER = "X-Plugserve-Variant"
"""The runner version (``name@version``) that served the request."""

log = structlog.get_logger("plugserve.server")

# Unique per process start; a counter after it. uuid4() reads the kernel's random
# source on every call, which profiles showed as 8% of a busy server's time.
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count()


MAX_REQUEST_ID = 128
"""Longest ``X-Request-ID`` taken from a client; a longer or odd one is replaced."""


def client_request_id(value: str | None) -> str | None:
    """The client's request id if it is short printable ASCII without spaces, else ``None``:
    it is echoed in a header and written to every log line of the request."""
    if value and len(value) <= MAX_REQUEST_ID and value.isascii() and value.isprintable():
        return None if " " in value else value
    return None


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


def identify(response: web.StreamResponse, request_id: str) -> None:
    """The answer's ``X-Request-ID`` and, once a runner version was chosen, its variant."""
    response.headers[REQUEST_ID_HEADER] = request_id
    chain = REQUEST_CHAIN.get()
    if chain is not None:
        response.headers[VARIANT_HEADER] = chain.variant


DECOUPLED_HTTP = "HTTP end point doesn't support models with decoupled transaction policy"
"""Triton's words for an HTTP call to a decoupled model (a streaming route here) that asks
for a single answer."""


def in_http_terms(exc: PlugserveError) -> PlugserveError:
    """``exc`` as an HTTP client reads it: a streaming route called for one answer names the
    calls that stream (the core's :class:`StreamingOnly` names none)."""
    if isinstance(exc, StreamingOnly):
        return InvalidInput(
            f"{DECOUPLED_HTTP}: route {exc.route!r} streams its responses; call "
            ".../generate_stream, .../generate or gRPC ModelStreamInfer (or /v1 for an "
            "OpenAI route)",
            **exc.fields,
        )
    return exc


def error_response(exc: PlugserveError, path: str = "") -> web.Response:
    """``{"error": message, ...}``, or OpenAI's shape under ``/v1/``."""
    exc = in_http_terms(exc)
    payload = openai_errors.of(exc) if openai_errors.is_openai(path) else exc.to_json()
    return web.json_response(payload, status=exc.status, headers=exc.headers())


def _plain_error(path: str, status: int, message: str) -> web.Response:
    if openai_errors.is_openai(path):
        return web.json_response(openai_errors.body(status, message), status=status)
    return web.json_response({"error": message}, status=status)


@web.middleware
async def request_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bind a request id to the log context, answer every error as ``{"error": ...}`` JSON.

    :class:`PlugserveError` carries its status; aiohttp's own HTTP errors (unknown
    path, wrong method, body too large) keep theirs; anything else is a 500
    whose details go to the log only. Only 500s (server faults) log at error
    level; other refusals are expected outcomes and log at debug. Tracebacks
    never show local variables (server/logs.py). The request's connection knows
    that a request is being handled (its header and body timeouts,
    ``server/connections.py``), and a large body never handed to a parser gives
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
        if not response.prepared:  # a stream (server/events.py) set its headers as it began
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


def _failure(request: web.Request, exc: Exception) -> web.Response:
    """The answer to an exception raised by a handler, logged by its kind."""
    if not isinstance(exc, PlugserveError):
        log.exception("internal_error", path=request.path, exc_info=exc)
        return _plain_error(request.path, 500, "internal server error")
    if isinstance(exc, PluginError):
        log.error("plugin_raised", error=exc.message, exc_info=exc.exc)
    elif exc.status == 500:
        log.error("request_failed", error=exc.message, status=exc.status)
    else:  # refused or timed out (503, 504, 429) or the client's mistake: expected
        log.debug("request_failed", error=exc.message, status=exc.status)
    return error_response(exc, request.path)


def _refusal(request: web.Request, exc: web.HTTPException) -> web.Response:
    """aiohttp's own HTTP errors (unknown path, wrong method, body too large) as JSON."""
    reason = exc.reason
    if isinstance(exc, web.HTTPRequestEntityTooLarge):  # aiohttp's own body limit
        reason = too_large(request.app[SETTINGS].max_body_bytes).message
    response = _plain_error(request.path, exc.status, reason)
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
