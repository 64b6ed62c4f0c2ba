"""Run one request through the chain of its route: resolve, count in, run, count out, measure."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Mapping
from typing import Any, Protocol, TypeVar, cast

from aiohttp import web

from plugserve.registry import tracing
from plugserve.registry.chain import Chain
from plugserve.registry.errors import (
    DeadlineExceeded,
    InvalidInput,
    PlugserveError,
    TooManyRequests,
    Unavailable,
)
from plugserve.registry.types import RequestContext
from plugserve.server.bodies import BODY_BYTES
from plugserve.server.connections import cancel_on_hangup
from plugserve.server.events import STREAM_STATUS
from plugserve.server.logs import REQUEST_CHAIN, REQUEST_ID
from plugserve.server.state import DRAIN, METRICS, REGISTRY

T = TypeVar("T")

UNKNOWN_ROUTE = "_unknown"
TIMEOUT_HEADER = "X-Request-Timeout"
TENANT_HEADER = "X-Tenant-ID"
MAX_TIMEOUT_S = 86400.0
"""Longer budgets (even ``inf``) count as a day: past that a deadline means nothing."""
CLIENT_CLOSED_REQUEST = 499
"""The status counted for a request whose client hung up before its answer (as nginx does)."""


class Incoming(Protocol):
    """What the request path reads of a call, whatever carried it: an aiohttp request, or a
    gRPC call (``server/grpc_api/calls.py``) with its metadata as the headers."""

    @property
    def app(self) -> web.Application: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def content_type(self) -> str: ...


def deadline_seconds(request: Incoming, parameters: dict[str, Any]) -> float | None:
    """The request's time budget: v2 ``timeout`` (microseconds, as tritonclient sends it)
    or the ``X-Request-Timeout`` header (seconds); the smaller when both are given."""
    budgets = []
    if "timeout" in parameters:
        value = parameters["timeout"]
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise InvalidInput("parameter 'timeout' must be a positive number of microseconds")
        budgets.append(min(value, MAX_TIMEOUT_S * 1e6) / 1e6)  # 10**400: no OverflowError
    header = request.headers.get(TIMEOUT_HEADER)
    if header is not None:
        try:
            seconds = float(header)
        except ValueError:
            seconds = -1.0
        if not seconds > 0:
            raise InvalidInput(f"{TIMEOUT_HEADER} must be a positive number of seconds")
        budgets.append(min(seconds, MAX_TIMEOUT_S))
    return min(budgets) if budgets else None


def request_context(
    request: Incoming,
    route: str,
    protocol: str,
    parameters: dict[str, Any],
    deadline_s: float | None = None,
    body_bytes: int | None = None,
) -> RequestContext:
    """The ``ctx`` stages see; deadline, priority and tenant steer the runner's scheduler.
    ``body_bytes``: the request's size, by default the length of an HTTP request's body as
    :class:`plugserve.server.bodies.Bodies` read it."""
    priority = parameters.get("priority")
    # A /predict query string: ASCII digits only ("²".isdigit() is true, int("²") fails).
    if isinstance(priority, str) and priority.isascii() and priority.isdecimal():
        if len(priority) > 18:  # int() refuses 4,300 digits; no level is that high anyway
            raise InvalidInput(f"parameter 'priority' {priority[:20]}... is out of range")
        priority = int(priority)
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or priority < 0
    ):
        raise InvalidInput("parameter 'priority' must be a non-negative integer (1 is highest)")
    return RequestContext(
        request_id=REQUEST_ID.get() or "",
        route=route,
        parameters=parameters,
        headers=request.headers,
        content_type=request.content_type,
        protocol=protocol,
        deadline=None if deadline_s is None else time.monotonic() + deadline_s,
        priority=priority,
        tenant=request.headers.get(TENANT_HEADER),
        body_bytes=_body_bytes(request) if body_bytes is None else body_bytes,
    )


def _body_bytes(request: Incoming) -> int | None:
    """The length of an HTTP request's body as read; ``None`` for one not read that way."""
    if isinstance(request, web.BaseRequest):
        return request.get(BODY_BYTES)
    return None


async def measured(
    request: Incoming, route: str | Callable[[], str], protocol: str, work: Coroutine[Any, Any, T]
) -> T:
    """Await ``work`` (decode, chain, encode) and record its status and duration.

    The work is cancelled if the client hangs up first (counted as 499): a
    request waiting in a runner's queue leaves it without running.

    A route not in the table is labelled ``_unknown``, so clients cannot grow
    the metric series by asking for made-up routes. ``route`` may be a callable
    for a route named in the body (OpenAI's ``model``): asked once ``work`` ends.
    """
    started = time.perf_counter()
    status = 200
    app = request.app
    # One isinstance (an ABC's, not free): a gRPC call is cancelled by grpc itself.
    http = isinstance(request, web.BaseRequest)
    if http:
        cancel_on_hangup(cast(web.BaseRequest, request))
    if app[DRAIN].draining:
        work.close()  # never awaited: close it
        app[METRICS].observe(UNKNOWN_ROUTE, protocol, 503, 0.0)
        raise Unavailable("the server is shutting down")
    try:
        answer = await work
        # A stream that failed after it began (server/events.py); a plain answer cannot.
        if http and type(answer) is not web.Response:
            status = cast(web.BaseRequest, request).get(STREAM_STATUS, status)
        return answer
    except PlugserveError as exc:
        status = exc.status
        raise
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = CLIENT_CLOSED_REQUEST
        raise
    except BaseException:
        status = 500
        raise
    finally:
        if not isinstance(route, str):
            route = route()
        known = route in app[REGISTRY].routes.entries
        chain = REQUEST_CHAIN.get()
        app[METRICS].observe(
            route if known else UNKNOWN_ROUTE,
            protocol,
            status,
            time.perf_counter() - started,
            "" if chain is None else chain.variant,
        )


def _request_span(request: Incoming, route: str, chain: Chain) -> Any:
    """A server span for the request, continuing the caller's W3C ``traceparent``."""
    from opentelemetry import propagate, trace

    return tracing.TRACER.start_as_current_span(
        f"infer {route}",
        context=propagate.extract(request.headers),
        kind=trace.SpanKind.SERVER,
        attributes={"plugserve.route": route, "plugserve.chain": chain.label},
    )


def admit(request: Incoming, route: str, version: str | None) -> None:
    """Before a byte of the body is read: 404/503 for a route or version not served here,
    429 for a route over its rate limit. :func:`serve` resolves the chain again after
    decoding (the table may have changed meanwhile; a lookup costs well under 1 µs)."""
    registry = request.app[REGISTRY]
    registry.routes.resolve(route, version)
    bucket = registry.buckets.get(route)
    if bucket is not None and (wait := bucket.take()) > 0:
        raise TooManyRequests(
            f"route {route!r} is over its rate limit of {bucket.limit.rps:g} requests/s",
            retry_after_s=math.ceil(wait),
        )


async def serve(
    request: Incoming,
    route: str,
    version: str | None,
    handle: Callable[[Chain], Awaitable[T]],
    deadline_s: float | None = None,
) -> T:
    """Resolve ``route`` and call ``handle(chain)`` with the request counted in on every stage.

    The chain is resolved and entered in one event-loop step (no ``await``
    between), so a reload can never release an instance a request is about to use.
    A request still running at its deadline answers 504 (a runner call already
    on a thread finishes there, unobserved; a queued one never starts).
    """
    app = request.app
    chain = app[REGISTRY].routes.resolve(route, version, request.headers)
    # Counted in for the shutdown drain only now that its body is in: a client still
    # uploading never holds a shutdown up (503 if the drain began meanwhile).
    drain = app[DRAIN]
    drain.enter()
    chain.enter()
    REQUEST_CHAIN.set(chain)
    span = None
    if tracing.TRACER is not None:
        span = _request_span(request, route, chain)
        span.__enter__()
    try:
        if deadline_s is None:
            return await handle(chain)
        try:
            async with asyncio.timeout(deadline_s):
                return await handle(chain)
        except TimeoutError:
            # Stage errors arrive wrapped (PluginError): this can only be the deadline.
            raise DeadlineExceeded(f"the request's deadline of {deadline_s:g} s passed") from None
    finally:
        chain.leave()
        drain.leave()
        if span is not None:
            span.__exit__(*sys.exc_info())


async def streamed(
    request: Incoming, chain: Chain, data: Any, ctx: RequestContext
) -> AsyncGenerator[Any, None]:
    """``chain.stream(data, ctx)``, timed: time to first token, between tokens, tokens made and
    streams in flight (``server/metrics.py``). Close it (``aclose``) to stop the stream."""
    clock = request.app[METRICS].stream(chain.route)
    try:
        async with contextlib.aclosing(chain.stream(data, ctx)) as responses:
            async for response in responses:
                clock.response(ctx.usage.get("completion_tokens", 0))
                yield response
    finally:
        clock.done(ctx.usage.get("completion_tokens", 0))
