"""The request path of every front end: admit, read, budget, resolve, run, count.

A front end (v2 HTTP, ``/predict``, Triton's generate, OpenAI's ``/v1``, gRPC) is
an adapter around :meth:`DataPlane.infer`: it reads and decodes its wire format
into an :class:`Inference`, and writes the chain's result (or its stream of
responses) back in its wire format. Everything between is here, once:

1. the drain (503 while the server shuts down) and admission: a route or version
   not served here is 404/503, a route over its rate limit 429, before a byte of
   the body is read;
2. the request's budget (``timeout`` parameter, ``X-Request-Timeout``, and the
   transport's own deadline, the smallest), priority and tenant, in its ``ctx``;
3. route resolution and the variant (canary, sticky header), entered on every
   stage in the same event-loop step, so a reload never releases an instance a
   request is about to use; the shutdown drain counts it in;
4. the chain, with the response cache (:func:`run_chain`), or its stream of
   responses, timed (:meth:`Served.responses`);
5. a deadline that passes answers 504; tracing spans from the caller's
   ``traceparent``; the request's status and duration in the metrics, labelled
   by route, protocol and variant.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import sys
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from plugserve.registry.errors import (
    DeadlineExceeded,
    NotLoaded,
    TooManyRequests,
    Unavailable,
    one_error,
)
from plugserve.registry.execution import tracing
from plugserve.registry.execution.batching import priority_level
from plugserve.registry.execution.chain import Chain
from plugserve.registry.execution.components import batch_policy
from plugserve.registry.execution.graph import TIMER_SLACK_S, RouteCaller
from plugserve.registry.execution.sequences import is_sequence_id
from plugserve.registry.lifecycle.lifecycle_events import Key
from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.refs import Ref
from plugserve.registry.routing.figures import Windows
from plugserve.registry.routing.variants import sticky_key
from plugserve.registry.types import RequestContext
from plugserve.server.dataplane.cache import ResponseCache
from plugserve.server.dataplane.context import (
    Incoming,
    another,
    deadline_seconds,
    request_context,
)
from plugserve.server.dataplane.outcomes import status_of
from plugserve.server.dataplane.pins import SequencePins, sequence_key
from plugserve.server.dataplane.shadow import ShadowTraffic
from plugserve.server.runtime.logs import REQUEST_CHAIN
from plugserve.server.runtime.metrics import Metrics
from plugserve.server.runtime.shutdown import Drain

T = TypeVar("T")

UNKNOWN_ROUTE = "_unknown"
"""The metrics' label of a route not in the table: clients cannot grow the metric series
by asking for made-up routes."""


@dataclass(slots=True)
class Inference:
    """A request in no protocol's terms: what its front end decoded."""

    route: str
    data: Any
    """What the chain's first stage receives: named tensors, a parsed JSON body, bytes."""
    parameters: Mapping[str, Any] = field(default_factory=dict)
    body_bytes: int | None = None
    """The request's size (its body as read, inflated, with its tensors in shared memory)."""
    deadline_s: float | None = None
    """A budget the transport set itself (a gRPC deadline), besides the request's own."""
    streams: bool = False
    """The front end keeps the deadline of a stream it sends as responses come (Server-Sent
    Events), so that it can still tell the client; the data plane does not bound it."""


class Served:
    """One request in the data plane: its route, and once resolved its chain and ``ctx``.

    What a front end's answer callback is handed: :meth:`result` runs the chain,
    :meth:`responses` streams it. ``status`` is set by a front end whose stream
    failed after its answer began (it said 200): what the request is counted as.
    """

    __slots__ = ("chain", "ctx", "data", "deadline_s", "plane", "route", "status")

    def __init__(self, plane: DataPlane, route: str | None) -> None:
        self.plane = plane
        self.route = route
        self.status: int | None = None
        self.chain: Chain
        self.ctx: RequestContext
        self.data: Any
        self.deadline_s: float | None = None

    async def result(self) -> Any:
        """The chain's result for the request's data (from the response cache if it may);
        on a rollout's route, a share of the stable version's requests is copied to its
        canary once answered (``shadow.py``)."""
        plane, route = self.plane, self.route
        copy = None
        if route is not None and plane.rollouts:
            copy = plane.shadow.copy(route, self.chain, self.data, self.ctx)
        try:
            result = await run_chain(plane.cache, self.chain, self.data, self.ctx)
        except BaseException:
            if copy is not None:
                plane.shadow.release(copy)
            raise
        if copy is not None:
            plane.shadow.offer(copy, result)
        return result

    async def responses(
        self, data: Any = None, ctx: RequestContext | None = None
    ) -> AsyncGenerator[Any, None]:
        """The chain's responses as they come (``chain.stream``), timed: time to first
        token, between tokens, tokens made, streams in flight (``server/runtime/metrics.py``).
        Close it (``aclose``) to stop the stream: its runner stops before its next step."""
        ctx = self.ctx if ctx is None else ctx
        data = self.data if data is None else data
        clock = self.plane.metrics.stream(self.chain.route)
        try:
            async with contextlib.aclosing(self.chain.stream(data, ctx)) as responses:
                async for response in responses:
                    clock.response(ctx.usage.get("completion_tokens", 0))
                    yield response
        finally:
            clock.done(ctx.usage.get("completion_tokens", 0))

    def context(self, parameters: Mapping[str, Any]) -> RequestContext:
        """A further ``ctx`` of this request, for one more run of its chain."""
        return another(self.ctx, parameters)


class DataPlane:
    """The request path of one process, over its registry, metrics, drain and cache."""

    def __init__(
        self, registry: Registry, metrics: Metrics, drain: Drain, cache: ResponseCache
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.drain = drain
        self.cache = cache
        self.router = RouteCaller(self.route_chain)
        """``ctx.infer``: a route called in-process by a plugin (``graph.py``)."""
        self.pins = SequencePins()
        """The chain each running sequence started on (``pins.py``)."""
        self.windows = Windows()
        """The figures of each rollout's window, as this process counts them."""
        self.shadow = ShadowTraffic(
            lambda: self.registry.routes,
            self.windows,
            drain,
            metrics.shadowed,
        )
        self.rollouts = False
        """Whether some route has a rollout under way (its requests are counted)."""
        registry.on_routes.append(self._routes_changed)

    def _routes_changed(self) -> None:
        windows = {}
        for name, entry in self.registry.routes.entries.items():
            rollout = entry.spec.rollout
            if rollout is not None and rollout.active:
                windows[name] = rollout.key
                for version in (rollout.stable, rollout.canary):
                    self._load_version(version)
        self.rollouts = bool(windows)
        self.windows.keep(windows)
        self.shadow.routes_changed()

    def _load_version(self, ref: Ref) -> None:
        """A rollout's version (stable or canary) that loads on its first request is loaded
        now: while it is not, it takes no share of the route (the other takes it all), and
        no request would ever load it."""
        record = self.registry.records.get(("runner", ref.name, str(ref.version)))
        if record is None or record.state != "available":
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self.registry.prefetch([record.key])

    async def infer(
        self,
        call: Incoming,
        protocol: str,
        read: Callable[[Served], Awaitable[Inference]],
        answer: Callable[[Served], Awaitable[T]],
        route: str | None = None,
        version: str | None = None,
    ) -> T:
        """Serve one request: ``read(served)`` decodes it, ``answer(served)`` runs its chain
        and encodes what it gives; counted in the metrics with its status and duration.

        ``route`` is known before the body is read from most front ends' paths (admitted
        before the body is read); ``None`` where the body names it (OpenAI's ``model``,
        admitted once read; ``read`` may set ``served.route`` as soon as it knows it, so
        that a refused body counts under its route).
        """
        served = Served(self, route)
        started = time.perf_counter()
        status = 200
        shed = False  # refused by the runner's open circuit: it never ran
        if self.drain.draining:
            self.metrics.observe(UNKNOWN_ROUTE, protocol, 503, 0.0)
            raise Unavailable("the server is shutting down")
        try:
            return await self._infer(call, protocol, served, read, answer, version)
        except BaseException as exc:
            status = status_of(exc)
            failure = one_error(exc)
            shed = isinstance(failure, Unavailable) and bool(failure.fields.get("circuit"))
            raise
        finally:
            route = served.route
            entry = None if route is None else self.registry.routes.entries.get(route)
            chain = REQUEST_CHAIN.get()
            took = time.perf_counter() - started
            status = status if served.status is None else served.status
            variant = "" if chain is None else chain.variant
            self.metrics.observe(UNKNOWN_ROUTE if entry is None else entry.spec.name,
                                 protocol, status, took, variant)  # fmt: skip
            # A rollout's window counts the route's own traffic: not a request naming a version,
            # nor one its runner's open circuit refused (the failures that opened it count:
            # the requests it sheds are those failures' echo, landing on every client).
            if (self.rollouts and entry is not None and chain is not None and version is None
                    and not shed):  # fmt: skip
                rollout = entry.spec.rollout
                if rollout is not None and rollout.active:
                    window = self.windows.window(entry.spec.name, rollout.key)
                    placed_by = _placed_by(entry.spec.sticky, call, served)
                    window.variant(variant).record(status, _gated_time(served, took), placed_by)

    async def _infer(
        self,
        call: Incoming,
        protocol: str,
        served: Served,
        read: Callable[[Served], Awaitable[Inference]],
        answer: Callable[[Served], Awaitable[T]],
        version: str | None,
    ) -> T:
        admitted = served.route
        if admitted is not None:  # 404/503/429 before a byte of the body is read
            self.admit(admitted, version)
        inference = await read(served)
        route = served.route = inference.route
        if admitted is None:
            self.admit(route, version)
        deadline = deadline_seconds(call, inference.parameters)
        if inference.deadline_s is not None:
            budget = inference.deadline_s
            deadline = budget if deadline is None else min(deadline, budget)
        served.ctx = ctx = request_context(
            call, route, protocol, inference.parameters, deadline, inference.body_bytes,
            self.router,
        )  # fmt: skip
        served.data = inference.data
        served.deadline_s = deadline
        # Resolved again (the table may have changed while the body was read; a lookup costs
        # well under 1 µs), and entered in the same step: a reload never releases an
        # instance a request is about to use. Counted in for the shutdown drain only now
        # that its body is in: a client still uploading never holds a shutdown up.
        chain = self._resolve_or_needs(call, route, version, inference)
        if not isinstance(chain, Chain):  # what it needs loads on its first request
            resolve = functools.partial(self._resolve, call, route, version, inference)
            chain = await self.loaded(resolve, chain, deadline)
        served.chain = chain
        drain = self.drain
        drain.enter()
        chain.enter()
        REQUEST_CHAIN.set(chain)
        ctx.versions = dict(chain.versions)
        span = None
        if tracing.TRACER is not None:
            span = _request_span(call, route, chain)
            span.__enter__()
        try:
            if deadline is None or inference.streams:
                return await answer(served)
            bound = asyncio.timeout(deadline)
            try:
                async with bound:
                    return await answer(served)
            except TimeoutError:
                # Stage errors arrive wrapped (PluginError): this can only be the deadline.
                raise late(deadline) from None
            except Exception:
                if bound.expired():  # what a stage raised as the deadline stopped it
                    raise late(deadline) from None
                raise
        finally:
            chain.leave()
            drain.leave()
            if version is None and inference.parameters:
                self.pins.settle(route, inference.parameters)
            if span is not None:
                span.__exit__(*sys.exc_info())

    def _resolve(
        self, call: Incoming, route: str, version: str | None, inference: Inference
    ) -> Chain:
        routes = self.registry.routes
        if version is None and inference.parameters and "sequence_id" in inference.parameters:
            return self.pins.chain(
                route,
                inference.parameters,
                lambda key: routes.resolve(route, None, call.headers, key),
            )
        return routes.resolve(route, version, call.headers)

    def _resolve_or_needs(
        self, call: Incoming, route: str, version: str | None, inference: Inference
    ) -> Chain | tuple[Key, ...]:
        """The chain, or the versions it needs loaded first (they load on demand). The
        :class:`NotLoaded` ends here: its traceback holds the route table it was raised
        from, and with it every version that table served, which a wait for a load must
        not keep from eviction (their memory would outlive the budget's count)."""
        try:
            return self._resolve(call, route, version, inference)
        except NotLoaded as exc:
            return exc.keys

    async def loaded(
        self, resolve: Callable[[], Chain], needs: tuple[Key, ...], deadline_s: float | None
    ) -> Chain:
        """``resolve()``'s chain, once ``needs`` (what it needs that loads on its first
        request) has loaded: waiting for up to :data:`DEMAND_ATTEMPTS` loads (a version
        evicted again before this request ran). The chain is returned in the step that
        resolved it: its caller enters it before a reload can release it."""
        for _ in range(DEMAND_ATTEMPTS):
            await self.demand(needs, deadline_s)
            found = _resolved_or_needs(resolve)
            if isinstance(found, Chain):
                return found
            needs = found
        return resolve()  # NotLoaded: a 503

    async def route_chain(self, route: str, version: str | None, deadline_s: float | None) -> Chain:
        """The chain serving ``route`` for ``ctx.infer``: resolved as a client's request to
        it is, loading what loads on its first request through :meth:`loaded` (the memory
        budget's evictions included), waiting at most ``deadline_s``."""
        resolve = functools.partial(self._route, route, version)
        found = _resolved_or_needs(resolve)
        if isinstance(found, Chain):
            return found
        return await self.loaded(resolve, found, deadline_s)

    def _route(self, route: str, version: str | None) -> Chain:
        return self.registry.routes.resolve(route, version)

    async def demand(self, needs: tuple[Key, ...], deadline_s: float | None) -> None:
        """Load what a route needs that loads on its first request, waiting at most the
        load timeout (or the request's deadline, if sooner); every request needing the same
        version waits for the same load."""
        registry = self.registry
        bound = deadline_s is not None and deadline_s < registry.load_timeout
        within = deadline_s if deadline_s is not None and bound else registry.load_timeout
        started = time.perf_counter()
        try:
            await registry.demand(needs, within)
        except Unavailable:
            # The wait that ran out was the request's own: its deadline passed (504).
            if bound and time.perf_counter() - started >= within - TIMER_SLACK_S:
                raise DeadlineExceeded(
                    "the request's deadline passed while what it needs was loading"
                ) from None
            raise
        self.metrics.cold_load.observe(time.perf_counter() - started)

    async def chain_of(self, route: str, version: str | None) -> Chain:
        """The chain serving ``route`` for a metadata or configuration call: like a request,
        it loads what loads on its first request (a client reads the metadata first)."""
        return await self.route_chain(route, version, None)

    def admit(self, route: str, version: str | None) -> None:
        """404/503 for a route or version not served here, 429 for a route over its rate
        limit. A route whose runner loads on its first request is admitted, its load begun
        while the request's body is read."""
        registry = self.registry
        try:
            registry.routes.resolve(route, version)
        except NotLoaded as exc:
            registry.prefetch(exc.keys)
        bucket = registry.buckets.get(route)
        if bucket is not None and (wait := bucket.take()) > 0:
            raise TooManyRequests(
                f"route {route!r} is over its rate limit of {bucket.limit.rps:g} requests/s",
                retry_after_s=math.ceil(wait),
            )


def _resolved_or_needs(resolve: Callable[[], Chain]) -> Chain | tuple[Key, ...]:
    """``resolve()``'s chain, or the versions it needs loaded first (see
    :meth:`DataPlane._resolve_or_needs`: the :class:`NotLoaded` ends here)."""
    try:
        return resolve()
    except NotLoaded as exc:
        return exc.keys


def _gated_time(served: Served, took: float) -> float:
    """What a rollout's latency gates judge of a request: its time, less its wait in the
    runner's queue (the version taking more of the traffic waits longer there: that is
    the share it takes, not the version)."""
    ctx = getattr(served, "ctx", None)
    queued = 0.0 if ctx is None else ctx.timings.get("queue", 0.0)
    return max(took - queued, 0.0)


def _placed_by(sticky: str | None, call: Incoming, served: Served) -> bytes | None:
    """The key a weighted route placed the request by (its sticky header, else its
    sequence): the client's choice, and so the cohort it counts in for a rollout."""
    key = sticky_key(sticky, call.headers)
    ctx = getattr(served, "ctx", None)
    if key is None and ctx is not None:
        sequence_id = ctx.parameters.get("sequence_id")
        if is_sequence_id(sequence_id):
            key = sequence_key(sequence_id)
    return key


DEMAND_ATTEMPTS = 3
"""Loads a request waits for, at most, when what it needs is evicted again before it runs."""


def late(deadline_s: float | None) -> DeadlineExceeded:
    """The error of a request whose deadline passed."""
    return DeadlineExceeded(f"the request's deadline of {deadline_s:g} s passed")


def _request_span(call: Incoming, route: str, chain: Chain) -> Any:
    """A server span for the request, continuing the caller's W3C ``traceparent``."""
    from opentelemetry import propagate, trace

    return tracing.TRACER.start_as_current_span(
        f"infer {route}",
        context=propagate.extract(call.headers),
        kind=trace.SpanKind.SERVER,
        attributes={"plugserve.route": route, "plugserve.chain": chain.label},
    )


async def run_chain(cache: ResponseCache, chain: Chain, data: Any, ctx: RequestContext) -> Any:
    """``chain.run(data, ctx)``, answered from ``cache`` when the chain's runner asks for it.

    A hit runs no stage; it counts in the runner version's statistics as a
    success with ``cache_hit`` and no execution, a miss as ``cache_miss`` (the
    lookup and the insertion) besides its run. A result that cannot be cached
    (:func:`plugserve.server.dataplane.cache.freeze`) is returned as it is.
    """
    if not cache.wants(chain):
        return await chain.run(data, ctx)
    started = time.perf_counter()
    key = cache.key(chain, data, ctx)
    if key is None:
        return await chain.run(data, ctx)
    entry = cache.get(key)
    stats = chain.runner.stats
    if entry is not None:
        runner = chain.runner
        if runner.manifest.runner is not None:  # what the runner's queue would refuse: 400
            priority_level(ctx.priority, batch_policy(runner.manifest.runner), runner.label)
        ctx.rows = entry.rows
        result = entry.result()
        if stats is not None:
            took = time.perf_counter() - started
            stats.record_cache_hit(took, took, entry.rows)
        return result
    spent = time.perf_counter() - started
    try:
        result = await chain.run(data, ctx)
        mark = time.perf_counter()
        cache.put(key, result, ctx.rows)
        spent += time.perf_counter() - mark
        return result
    finally:
        if stats is not None:
            stats.cache_miss.add(spent)


DATA_PLANE = web.AppKey("data_plane", DataPlane)
"""The request path every front end serves inference through."""
