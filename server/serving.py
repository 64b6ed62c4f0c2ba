"""Run one request through the chain of its route: resolve, count in, run, count out, measure."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from registry.chain import Chain
from registry.errors import PlugserveError
from registry.types import RequestContext
from server.middleware import REQUEST_ID_HEADER
from server.state import METRICS, REGISTRY

T = TypeVar("T")

UNKNOWN_ROUTE = "_unknown"


def request_context(
    request: web.Request, route: str, protocol: str, parameters: dict[str, Any]
) -> RequestContext:
    return RequestContext(
        request_id=request.headers.get(REQUEST_ID_HEADER, ""),
        route=route,
        parameters=parameters,
        headers=request.headers,
        content_type=request.content_type,
        protocol=protocol,
    )


async def serve(
    request: web.Request,
    route: str,
    version: str | None,
    protocol: str,
    handle: Callable[[Chain], Awaitable[T]],
) -> T:
    """Resolve ``route`` and call ``handle(chain)`` with the request counted in on every stage.

    The chain is resolved and entered in one event-loop step (no ``await``
    between), so a reload can never release an instance a request is about to use.
    """
    registry = request.app[REGISTRY]
    started = time.perf_counter()
    label = route if route in registry.routes.entries else UNKNOWN_ROUTE
    status = 200
    try:
        chain = registry.routes.resolve(route, version)
        chain.enter()
        try:
            return await handle(chain)
        finally:
            chain.leave()
    except PlugserveError as exc:
        status = exc.status
        raise
    except BaseException:
        status = 500
        raise
    finally:
        request.app[METRICS].observe(label, protocol, status, time.perf_counter() - started)
