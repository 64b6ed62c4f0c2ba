"""gRPC calls counted, capped and swept, with room kept for health checks.

Every call passes :class:`Admission` (a server interceptor) as it starts, before
its request message is read. A data call is admitted while fewer than
``max_calls`` are open; past it, an open stream is ended to make room, as HTTP closes an
idle keep-alive connection: one that has sent nothing since it opened, 50 ms or more,
first, else the stream idle longest, a quarter second or more (no request in flight, no
write waiting); with none the call is refused ``RESOURCE_EXHAUSTED`` at once. Health and
readiness (``ServerLive``, ``ServerReady``, ``ModelReady``, ``grpc.health.v1.Health``) are
counted apart, up to ``HEALTH_CALLS`` at once, so that data calls never crowd them out.

A unary call's request message must arrive within ``request_timeout_s`` (HTTP's
``body_timeout_s``; a health call's within ``health_request_timeout_s``, HTTP's
``header_timeout_s``), else the call ends ``DEADLINE_EXCEEDED``; at a full pool, the call
that has waited longest for its message, a quarter second or more, is ended ``UNAVAILABLE`` to make
room, so calls that never send their message cannot hold the pool (health's included).

A sweep once a second ends, with ``DEADLINE_EXCEEDED``, a stream that has sent
no request for ``idle_timeout_s`` with none in flight, and one whose client has
read none of an answer for ``send_timeout_s`` (HTTP's ``body_timeout_s``): its
requests are cancelled, which closes their streams and frees their runners'
slots. Its status waits behind the answer the client has not read (grpcio cannot reset
one stream), so the call stays counted until its client reads or disconnects.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import structlog

from plugserve.server.http.connections import Swept

log = structlog.get_logger("plugserve.grpc")

IDLE_EVICTABLE_S = 0.25
"""At ``max_calls``, a stream idle this long may be ended for a new call (the longest idle
first); a unary call waiting this long for its request message, before any stream."""
SILENT_EVICTABLE_S = 0.05
"""At ``max_calls``, a stream that has sent no request since it opened, this long, may be
ended for a new call before any other: a client sends its first request as it opens a
stream, so such streams are what holds the pool when calls are opened to fill it."""
HEALTH_CALLS = 64
"""Health and readiness calls open at once, apart from ``max_calls``; more are refused."""
EXEMPT = frozenset(
    {
        "/inference.GRPCInferenceService/ServerLive",
        "/inference.GRPCInferenceService/ServerReady",
        "/inference.GRPCInferenceService/ModelReady",
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
    }
)
"""The health and readiness methods: counted against ``HEALTH_CALLS``, not ``max_calls``."""


@dataclass(frozen=True)
class CallLimits:
    """The settings a gRPC listener's calls live by."""

    max_calls: int
    """Data calls open at once (``max_connections``)."""
    idle_timeout_s: float
    """A stream with nothing in flight that sends no request for this long is ended."""
    send_timeout_s: float
    """A stream whose client reads none of an answer for this long is ended."""
    request_timeout_s: float = 60.0
    """A unary data call whose request message has not arrived this long is ended."""
    health_request_timeout_s: float = 10.0
    """The same for a health or readiness call."""


class Cancellable(Protocol):
    """What ends a call: its task, or the native server's stream (``stream.py``)."""

    def cancel(self, msg: Any = None) -> Any: ...


class Ended(Exception):
    """Why the server ended a call: the status its client is sent."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class TrackedCall:
    """One admitted call: what the sweep reads of it, and how it is ended."""

    __slots__ = (
        "awaiting_since",
        "counted",
        "ended",
        "in_flight",
        "pool",
        "since",
        "streaming",
        "task",
        "used",
        "writing_since",
    )

    def __init__(self, pool: set[TrackedCall], task: Cancellable, streaming: bool) -> None:
        self.pool = pool
        self.task: Cancellable | None = task
        self.streaming = streaming
        """Whether the client sends a stream of requests (``ModelStreamInfer``)."""
        self.since = time.monotonic()
        """When the call last received a request or finished one."""
        self.in_flight = 0
        self.used = False
        """Whether a request came on the stream."""
        self.writing_since: float | None = None
        """Since when an answer waits for the client to read it (``None``: none waits)."""
        self.ended: Ended | None = None
        self.counted = True
        self.awaiting_since: float | None = None
        """Since when a unary call waits for its request message (``None``: it arrived, or
        the call is not one whose wait :func:`_arrival_bounded` bounds)."""

    def request_arrived(self) -> None:
        self.awaiting_since = None

    def request_began(self) -> None:
        self.used = True
        self.in_flight += 1
        self.since = time.monotonic()

    def request_ended(self) -> None:
        self.in_flight -= 1
        self.since = time.monotonic()

    def write_began(self) -> None:
        self.writing_since = time.monotonic()

    def write_ended(self) -> None:
        self.writing_since = None

    def idle_for(self, now: float) -> float:
        """How long the stream has had nothing to do (0 while it has)."""
        if not self.streaming or self.in_flight or self.writing_since is not None:
            return 0.0
        return now - self.since

    def evictable(self, now: float) -> tuple[bool, bool, float]:
        """Whether the stream may be ended to make room, whether it is silent (no request
        since it opened), and how long it has been idle: the largest goes first."""
        idle = self.idle_for(now)
        least = IDLE_EVICTABLE_S if self.used else SILENT_EVICTABLE_S
        return idle >= least and idle > 0, not self.used, idle

    def end(self, code: grpc.StatusCode, message: str) -> None:
        """Stop the call's handler, which then sends ``code`` and ``message``. The call counts
        against its limit until its handler has ended: a status that waits for its client
        to read keeps it counted."""
        if self.ended is None and self.task is not None:
            self.ended = Ended(code, message)
            self.task.cancel()

    def release(self) -> None:
        """Stop counting the call against its limit (once)."""
        if self.counted:
            self.counted = False
            self.pool.discard(self)
            self.task = None  # a call's context may outlive it: it holds nothing of the call


CURRENT_CALL: contextvars.ContextVar[TrackedCall | None] = contextvars.ContextVar(
    "plugserve_grpc_call", default=None
)
"""The call the running handler serves (set by :class:`Admission`, in the call's task)."""


class Admission(Swept, grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Counts the calls of one gRPC server, refuses those over its limits, sweeps them."""

    def __init__(self, limits: CallLimits) -> None:
        self.limits = limits
        self.calls: set[TrackedCall] = set()
        self.health: set[TrackedCall] = set()
        self.refused = 0
        self.evicted = 0
        self.timed_out = {"idle": 0, "send": 0, "request": 0}
        self._reported = (0, 0, 0, 0, 0)

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        details: Any,
    ) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        task = asyncio.current_task()
        assert task is not None  # grpc.aio runs each call in a task of its own
        streaming = bool(handler.request_streaming)
        call = self.admit(details.method, task, streaming, bool(handler.response_streaming))
        if isinstance(call, str):
            return _refusal(handler, call)
        task.add_done_callback(lambda _: call.release())
        CURRENT_CALL.set(call)
        if call.awaiting_since is None:
            return handler
        return _arrival_bounded(handler, call)

    def admit(
        self, method: str, task: Cancellable, streaming: bool, answers_stream: bool
    ) -> TrackedCall | str:
        """A call of ``method`` counted (``task`` is cancelled to end it; a unary call waits
        for its request message from now), or why it is refused (``RESOURCE_EXHAUSTED``)."""
        exempt = method in EXEMPT
        pool, limit = (self.health, HEALTH_CALLS) if exempt else (self.calls, self.limits.max_calls)
        if len(pool) >= limit and not self._make_room(pool, exempt):
            self.refused += 1
            return _refusal_message(exempt, limit)
        call = TrackedCall(pool, task, streaming)
        pool.add(call)
        if not (streaming or answers_stream):
            call.awaiting_since = call.since
        return call

    def _make_room(self, pool: set[TrackedCall], exempt: bool) -> bool:
        """End one call of a full ``pool`` to make room for a new one: the unary call that has
        waited longest for its request message (``IDLE_EVICTABLE_S`` or more), else, for data
        calls, the stream idle longest; ``False`` if there is none."""
        now = time.monotonic()
        waiting = [c for c in pool if c.awaiting_since is not None and c.ended is None]
        if waiting:
            oldest = min(waiting, key=lambda c: c.awaiting_since or now)
            if now - (oldest.awaiting_since or now) >= IDLE_EVICTABLE_S:
                oldest.end(
                    grpc.StatusCode.UNAVAILABLE,
                    "the call's request message had not arrived and the server is at its "
                    "call limit: ended to make room",
                )
                oldest.release()
                self.evicted += 1
                return True
        return not exempt and self._evict_idle()

    def _evict_idle(self) -> bool:
        """End a stream to make room: a silent one (``SILENT_EVICTABLE_S`` or more) first,
        else the one idle longest, ``IDLE_EVICTABLE_S`` or more; ``False`` if there is none.
        An ended call stays counted until its handler ends: its status may wait for its
        client to read."""
        now = time.monotonic()
        idle = max(
            (c for c in self.calls if c.ended is None),
            key=lambda c: c.evictable(now),
            default=None,
        )
        if idle is None or not idle.evictable(now)[0]:
            return False
        idle.end(
            grpc.StatusCode.UNAVAILABLE,
            "the stream was idle and the server is at its call limit "
            "(max_connections): closed to make room; open it again when needed",
        )
        idle.release()  # it ends at once: nothing of it waits on the client
        self.evicted += 1
        return True

    def sweep(self, now: float) -> None:
        """End the unary calls whose request message is late, and the streams past their
        idle or send timeout."""
        limits = self.limits
        for pool, within, setting in (
            (self.calls, limits.request_timeout_s, "body_timeout_s"),
            (self.health, limits.health_request_timeout_s, "header_timeout_s"),
        ):
            for call in [c for c in pool if c.awaiting_since is not None and c.ended is None]:
                if now - (call.awaiting_since or now) > within:
                    self.timed_out["request"] += 1
                    call.end(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"the call's request message did not arrive within {setting} = "
                        f"{within:g} s",
                    )
        for call in list(self.calls):
            if call.ended is not None:
                continue  # ended once; counted until its handler ends
            writing = call.writing_since
            if writing is not None and now - writing > limits.send_timeout_s:
                self.timed_out["send"] += 1
                call.end(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "the client read none of the call's answers for body_timeout_s = "
                    f"{limits.send_timeout_s:g} s",
                )
            elif call.idle_for(now) > limits.idle_timeout_s:
                self.timed_out["idle"] += 1
                call.end(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "the stream sent no request for grpc_idle_timeout_s = "
                    f"{limits.idle_timeout_s:g} s",
                )
        self._report()

    def _report(self) -> None:
        """One log line per sweep that saw refusals or timeouts, never one per call."""
        timed_out = self.timed_out
        current = (self.refused, self.evicted, timed_out["idle"], timed_out["send"],
                   timed_out["request"])  # fmt: skip
        refused, evicted, idle, send, request = (
            c - r for c, r in zip(current, self._reported, strict=True)
        )
        self._reported = current
        if refused or evicted:
            log.warning(
                "grpc_calls_refused",
                refused=refused,
                evicted=evicted,
                open=len(self.calls),
                max_calls=self.limits.max_calls,
            )
        if idle or send or request:
            log.info("grpc_calls_timed_out", idle=idle, send=send, request=request)


async def end_with(context: Any, ended: Ended) -> None:
    """Send the status of a call the server ended (``abort``). Its client may read nothing,
    or be gone, and then gRPC's core cannot send it: the handler ends quietly instead
    (a ``CancelledError``, which grpc.aio logs at debug), not with gRPC's error traceback."""
    try:
        await context.abort(ended.code, ended.message)
    except grpc.aio.AbortError:
        raise
    except Exception as exc:
        log.debug("grpc_status_not_sent", code=ended.code.name, error=type(exc).__name__)
        raise asyncio.CancelledError from None


def _arrival_bounded(handler: Any, call: TrackedCall) -> Any:
    """``handler``, a unary call's, taking its request as a stream so that the wait for the
    request message can be ended (:meth:`Admission.sweep` past its timeout,
    :meth:`Admission._make_room` at a full pool); then the handler's own behaviour."""
    behaviour = handler.unary_unary

    async def bounded(requests: Any, context: Any) -> Any:
        try:
            request = await context.read()
        except asyncio.CancelledError:
            ended = call.ended
            if ended is None:
                raise  # the client went away, or the server stops
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            await end_with(context, ended)
        if request is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call sent no request")
        call.request_arrived()
        answer = behaviour(request, context)
        return (await answer) if inspect.isawaitable(answer) else answer

    return grpc.stream_unary_rpc_method_handler(
        bounded, handler.request_deserializer, handler.response_serializer
    )


def _refusal_message(exempt: bool, limit: int) -> str:
    if exempt:
        return f"the server has {limit} health calls open, its limit; try again shortly"
    return f"the server has {limit} calls open, its limit (max_connections); try again shortly"


def _refusal(handler: Any, message: str) -> Any:
    """A handler that refuses the call ``RESOURCE_EXHAUSTED`` at once. It takes the request
    as a stream, so it answers before the request's message has arrived."""

    async def refuse(requests: Any, context: Any) -> None:
        context.set_trailing_metadata((("retry-after", "1"),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    return grpc.stream_unary_rpc_method_handler(
        refuse, handler.request_deserializer, handler.response_serializer
    )
