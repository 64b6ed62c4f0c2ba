"""What the data plane reads of a call, whatever carried it, and the ``ctx`` it makes of it:
the deadline, the priority and the tenant."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from plugserve.registry.errors import InvalidInput
from plugserve.registry.execution.graph import derived_context
from plugserve.registry.types import RequestContext
from plugserve.server.runtime.logs import REQUEST_ID

TIMEOUT_HEADER = "X-Request-Timeout"
TENANT_HEADER = "X-Tenant-ID"
MAX_TIMEOUT_S = 86400.0
"""Longer budgets (even ``inf``) count as a day: past that a deadline means nothing."""


class Incoming(Protocol):
    """A call as the data plane sees it: an aiohttp request, or a gRPC call
    (``server/grpc_api/calls.py``) with its metadata as the headers."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def content_type(self) -> str: ...


def deadline_seconds(call: Incoming, parameters: Mapping[str, Any]) -> float | None:
    """The request's time budget: v2 ``timeout`` (microseconds, as tritonclient sends it)
    or the ``X-Request-Timeout`` header (seconds); the smaller when both are given."""
    budgets = []
    if "timeout" in parameters:
        value = parameters["timeout"]
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise InvalidInput("parameter 'timeout' must be a positive number of microseconds")
        budgets.append(min(value, MAX_TIMEOUT_S * 1e6) / 1e6)  # 10**400: no OverflowError
    header = call.headers.get(TIMEOUT_HEADER)
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
    call: Incoming,
    route: str,
    protocol: str,
    parameters: Mapping[str, Any],
    deadline_s: float | None = None,
    body_bytes: int | None = None,
    router: Any = None,
) -> RequestContext:
    """The ``ctx`` stages see; deadline, priority and tenant steer the runner's scheduler."""
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
        headers=call.headers,
        content_type=call.content_type,
        protocol=protocol,
        deadline=None if deadline_s is None else time.monotonic() + deadline_s,
        priority=priority,
        tenant=call.headers.get(TENANT_HEADER),
        body_bytes=body_bytes,
        router=router,
    )


def another(ctx: RequestContext, parameters: Mapping[str, Any]) -> RequestContext:
    """A context of the same request for one more run of its chain (an OpenAI request's
    ``n`` choices): its own parameters, state, timings and usage; the same deadline."""
    return derived_context(ctx, parameters)
