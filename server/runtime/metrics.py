"""Prometheus metrics, in a registry of the app's own (two apps in one process never collide)."""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from plugserve.registry.execution.stats import LATENCY_BUCKETS
from plugserve.registry.fleet.etcd_store import EtcdRouteStore
from plugserve.registry.fleet.route_store import RouteStore, RouteTarget
from plugserve.registry.lifecycle.lifecycle_events import LifecycleEvent
from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.refs import PLUGIN_TYPES
from plugserve.registry.routing.route_specs import RouteSpec


class CacheFigures(Protocol):
    """What the metrics read of a response cache (``server/dataplane/cache.py``)."""

    @property
    def hits(self) -> Mapping[str, int]: ...
    @property
    def misses(self) -> Mapping[str, int]: ...
    @property
    def evictions(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    def __len__(self) -> int: ...


class ListenerFigures(Protocol):
    """What the metrics read of a listener's connections (``server/http/connections.py``)."""

    @property
    def name(self) -> str: ...
    @property
    def open(self) -> Sized: ...
    @property
    def idle(self) -> Sized: ...
    @property
    def refused(self) -> int: ...
    @property
    def evicted(self) -> int: ...
    @property
    def timed_out(self) -> Mapping[str, int]: ...


STATES = ("loading", "ready", "failed", "draining", "unloaded", "available")


class Metrics:
    """The metrics plugserve exports at ``/metrics``."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        # Label children per (route, protocol, status): labels() costs a lock and a lookup.
        self._children: dict[tuple[str, str, int, str], tuple[Counter, Histogram]] = {}
        self._route_totals: dict[str, int] = {}
        # The *_created series only add noise to every scrape; the function is unannotated.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "plugserve_requests",
            "Inference requests answered, by route, protocol, HTTP status and the runner "
            "version that served them (variant; empty when none was chosen).",
            ["route", "protocol", "status", "variant"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "plugserve_request_duration_seconds",
            "End-to-end time of inference requests (decode, chain, encode), by route.",
            ["route", "protocol"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

        self.lifecycle = Counter(
            "plugserve_plugin_lifecycle",
            "Plugin version loads, reloads, failed loads and unloads, by plugin.",
            ["type", "name", "outcome"],
            registry=self.registry,
        )
        self.lifecycle_seconds = Histogram(
            "plugserve_plugin_lifecycle_duration_seconds",
            "Time to load (import, create, warm up) or unload (drain, close) a version.",
            ["outcome"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.cold_load = Histogram(
            "plugserve_cold_load_wait_seconds",
            "How long requests waited for a runner version that loads on its first request "
            "(load = on_demand): the first one its whole load, those beside it the rest of it.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.versions = Gauge(
            "plugserve_plugin_versions",
            "Plugin versions known to the registry, by type and state.",
            ["type", "state"],
            registry=self.registry,
        )

        self.first_token = Histogram(
            "plugserve_time_to_first_token_seconds",
            "Time from a streamed request's start to its first response (token), by route.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "plugserve_inter_token_latency_seconds",
            "Time between consecutive responses (tokens) of a stream, by route.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "plugserve_generated_tokens",
            "Responses (tokens) made by streaming runners, by route: rate() is tokens/s.",
            ["route"],
            registry=self.registry,
        )
        self.streams = Gauge(
            "plugserve_streams_in_flight",
            "Streamed requests being answered now, by route.",
            ["route"],
            registry=self.registry,
        )

        self._decisions: Counter | None = None
        self._shadow_children: dict[tuple[str, str], Counter] = {}
        self.shadow = Counter(
            "plugserve_shadow_requests",
            "Shadow copies of a rollout's stable requests run on its canary, by outcome: "
            "agreed, differed, failed (the canary raised), skipped (not run).",
            ["route", "outcome"],
            registry=self.registry,
        )

    def shadowed(self, route: str, outcome: str) -> None:
        """One shadow copy's outcome (its series found once, as :meth:`observe`'s)."""
        child = self._shadow_children.get((route, outcome))
        if child is None:
            child = self._shadow_children[(route, outcome)] = self.shadow.labels(route, outcome)
        child.inc()

    def decisions(self) -> Counter:
        """The rollout decisions made by this process (registered when first asked: a
        worker never decides, its supervisor counts them)."""
        if self._decisions is None:
            self._decisions = decisions_counter(self.registry)
        return self._decisions

    def stream(self, route: str) -> StreamClock:
        """Time one stream of ``route``, counted in flight until :meth:`StreamClock.done`."""
        return StreamClock(self, route)

    def collect_from(
        self, registry: Registry, store: RouteStore | None = None, rollouts: bool = True
    ) -> None:
        """Add the gauges read from the registry at scrape time (always current, and an
        unloaded version's series are gone with it), the rollouts' unless a supervisor
        gives them, and the fleet's in fleet mode."""
        self.registry.register(_RegistryCollector(registry))
        if rollouts:
            self.registry.register(RolloutCollector(registry))
        if isinstance(store, EtcdRouteStore):
            self.registry.register(_FleetCollector(store))

    def collect_connections(self, listeners: Sequence[ListenerFigures]) -> None:
        """Add the client connections of the server's listeners (open, refused, timed out)."""
        self.registry.register(_ConnectionCollector(listeners))

    def collect_cache(self, cache: CacheFigures) -> None:
        """Add the response cache's hits, misses, evictions, bytes and entries."""
        self.registry.register(_CacheCollector(cache))

    def lifecycle_listener(self, registry: Registry) -> Callable[[LifecycleEvent], None]:
        """A registry listener that counts lifecycle events and refreshes the state gauge."""

        def listen(event: LifecycleEvent) -> None:
            record = event.record
            self.lifecycle.labels(record.type, record.name, event.outcome).inc()
            self.lifecycle_seconds.labels(event.outcome).observe(event.seconds)
            states: Tally[tuple[str, str]] = Tally(
                (r.type, r.state) for r in registry.records.values()
            )
            for kind in PLUGIN_TYPES:
                for state in STATES:
                    self.versions.labels(kind, state).set(states[(kind, state)])

        return listen

    def observe(
        self, route: str, protocol: str, status: int, seconds: float, variant: str = ""
    ) -> None:
        key = (route, protocol, status, variant)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.requests.labels(route, protocol, str(status), variant),
                self.latency.labels(route, protocol),
            )
        children[0].inc()
        children[1].observe(seconds)
        self._route_totals[route] = self._route_totals.get(route, 0) + 1

    def requests_by_route(self) -> dict[str, int]:
        """Requests answered per route since start, every protocol and status together."""
        return dict(self._route_totals)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StreamClock:
    """The generation figures of one stream: first token, gaps between tokens, tokens made."""

    __slots__ = ("_counted", "_first", "_gaps", "_in_flight", "_last", "_started", "_tokens")

    def __init__(self, metrics: Metrics, route: str) -> None:
        self._first = metrics.first_token.labels(route)
        self._gaps = metrics.inter_token.labels(route)
        self._tokens = metrics.tokens.labels(route)
        self._in_flight = metrics.streams.labels(route)
        self._in_flight.inc()
        self._started = time.perf_counter()
        self._last: float | None = None
        self._counted = 0

    def response(self, tokens: int) -> None:
        """A response was sent; ``tokens``: the stream's runner responses so far."""
        now = time.perf_counter()
        if self._last is None:
            self._first.observe(now - self._started)
        else:
            self._gaps.observe(now - self._last)
        self._last = now
        if tokens > self._counted:
            self._tokens.inc(tokens - self._counted)
            self._counted = tokens

    def done(self, tokens: int) -> None:
        if tokens > self._counted:
            self._tokens.inc(tokens - self._counted)
            self._counted = tokens
        self._in_flight.dec()


PLUGIN_LABELS = ["type", "name", "version"]


def execution_families() -> tuple[
    GaugeMetricFamily, GaugeMetricFamily, HistogramMetricFamily, CounterMetricFamily
]:
    """What a runner's executions show (in its worker, or in its runner processes):
    queued requests, circuit, batch sizes, executions."""
    labels = PLUGIN_LABELS
    return (
        GaugeMetricFamily(
            "plugserve_queued", "Requests waiting in a runner version's queue.", labels=labels
        ),
        GaugeMetricFamily(
            "plugserve_circuit_open",
            "1 while a runner version's circuit breaker is open or half-open, else 0.",
            labels=labels,
        ),
        HistogramMetricFamily("plugserve_batch_size", "Rows per runner execution.", labels=labels),
        CounterMetricFamily("plugserve_executions", "Runner executions (batches).", labels=labels),
    )


def add_process_figures(
    gauges: tuple[GaugeMetricFamily, GaugeMetricFamily], key: list[str], figures: dict[str, Any]
) -> None:
    """An isolated runner's queue and circuit, from its processes' figures."""
    queued, circuit = gauges
    queued.add_metric(key, figures.get("queued", 0))
    circuit.add_metric(key, 0 if figures.get("circuit", "closed") == "closed" else 1)


NO_BUDGET = {"budget_bytes": 0, "resident_bytes": 0, "reserved_bytes": 0, "resident": []}


def budget_families(state: dict[str, Any] | None) -> Iterator[Metric]:
    """The memory budget's gauges (``state``: its ``/admin/status`` ``memory``)."""
    if state is None:
        return
    yield GaugeMetricFamily(
        "plugserve_memory_budget_bytes",
        "The memory budget of the runner versions that load on demand.",
        value=state["budget_bytes"],
    )
    yield GaugeMetricFamily(
        "plugserve_memory_resident_bytes",
        "Memory of the versions resident under the budget: their measured costs, and what"
        " the processes holding them use beyond those.",
        value=state["resident_bytes"],
    )
    yield GaugeMetricFamily(
        "plugserve_memory_reserved_bytes",
        "Estimated memory of the loads under way under the budget.",
        value=state["reserved_bytes"],
    )
    yield GaugeMetricFamily(
        "plugserve_memory_resident_versions",
        "Versions resident under the budget (a version loaded in several workers counts in each).",
        value=len(state["resident"]),
    )


class _RegistryCollector(Collector):
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def describe(self) -> list[Metric]:
        return []  # collected lazily, so registration never calls collect()

    def collect(self) -> Iterator[Metric]:
        labels = PLUGIN_LABELS
        in_flight = GaugeMetricFamily(
            "plugserve_in_flight", "Requests using a plugin version now.", labels=labels
        )
        queued, circuit, batch, executions = execution_families()
        stage = HistogramMetricFamily(
            "plugserve_stage_duration_seconds",
            "Time per request in each stage: queue, compute_input (preprocessors), "
            "compute_infer (runner), compute_output (postprocessors).",
            labels=[*labels, "stage"],
        )
        outcomes = CounterMetricFamily(
            "plugserve_inferences",
            "Requests through a runner version, by outcome (success, fail: a stage raised "
            "or timed out).",
            labels=[*labels, "outcome"],
        )
        fallbacks = CounterMetricFamily(
            "plugserve_batch_fallbacks",
            "Batches that failed and were run again one request at a time (a model that "
            "cannot batch what the server sends it: /admin/plugins says why).",
            labels=labels,
        )
        for record in self._registry.records.values():
            current = record.current
            if current is None:
                continue
            key = [record.type, record.name, record.version]
            in_flight.add_metric(key, current.in_flight)
            stats = current.stats
            remote = current.remote
            ran = stats if remote is None else remote.executions  # None: the supervisor's
            if ran is not None:
                sizes = ran.batch_sizes
                batch.add_metric(key, sizes.cumulative(), sum_value=sizes.total)
                executions.add_metric(key, ran.execution_count)
                fallbacks.add_metric(key, ran.batch_fallbacks)
            if remote is not None and ran is not None:
                add_process_figures((queued, circuit), key, remote.figures)
            if stats is not None:
                outcomes.add_metric([*key, "success"], stats.success.count)
                outcomes.add_metric([*key, "fail"], stats.fail.count)
                for name, histogram in stats.latency.items():
                    stage.add_metric(
                        [*key, name], histogram.cumulative(), sum_value=histogram.total
                    )
            waiting = current.queued  # requests, or streams waiting for a place (max_streams)
            if waiting is not None:
                queued.add_metric(key, waiting)
            if current.breaker is not None and current.breaker.enabled:
                circuit.add_metric(key, 0 if current.breaker.state == "closed" else 1)
        yield from (in_flight, queued, circuit, batch, stage, executions, fallbacks, outcomes)
        registry = self._registry
        yield _by_reason(
            "plugserve_plugin_loads",
            "Versions loaded, by reason: demand (a request), eager (found on disk), reload "
            "(changed or asked) and explicit (an admin or repository load).",
            registry.loads,
        )
        yield _by_reason(
            "plugserve_plugin_evictions",
            "Versions evicted under the memory budget, by reason: room (for a load) or "
            "overshoot (a load measured more than its estimate).",
            registry.evictions,
        )
        budget = registry.budget  # a worker's among several: its supervisor gives the figures
        yield from budget_families(NO_BUDGET if budget is None else budget.describe())


def _by_reason(name: str, documentation: str, counts: Mapping[str, int]) -> Metric:
    family = CounterMetricFamily(name, documentation, labels=["reason"])
    for reason, count in sorted(counts.items()):
        family.add_metric([reason], count)
    return family


def decisions_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "plugserve_rollout_decisions",
        "Rollout decisions made here, by route: advance, promote, roll_back (the gates'), "
        "restart (a window begun again), pause, resume, abort (an operator's).",
        ["route", "decision"],
        registry=registry,
    )


class RolloutCollector(Collector):
    """Each rollout's canary weight, step and state, from the runtime routes (of the
    process that decides them: the server, or with workers their supervisor)."""

    def __init__(self, registry: RouteTarget) -> None:
        self._registry = registry

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from rollout_families(self._registry.runtime_routes.values())


def rollout_families(specs: Iterable[RouteSpec]) -> Iterator[Metric]:
    weight = GaugeMetricFamily(
        "plugserve_rollout_canary_weight_percent",
        "The share of a route's traffic its rollout's canary takes now.",
        labels=["route", "canary", "stable"],
    )
    step = GaugeMetricFamily(
        "plugserve_rollout_step", "The step a route's rollout is at (0: its first).",
        labels=["route"],
    )  # fmt: skip
    state = GaugeMetricFamily(
        "plugserve_rollout_state",
        "1 for the state each route's rollout is in (running, paused, promoted, rolled_back, "
        "aborted).",
        labels=["route", "state"],
    )
    for spec in specs:
        rollout = spec.rollout
        if rollout is None:
            continue
        weight.add_metric([spec.name, str(rollout.canary), str(rollout.stable)], rollout.weight)
        step.add_metric([spec.name], rollout.status.step)
        state.add_metric([spec.name, rollout.status.state], 1)
    yield from (weight, step, state)


class _FleetCollector(Collector):
    """Fleet mode: whether etcd is reachable, the revision served, the replicas seen."""

    def __init__(self, store: EtcdRouteStore) -> None:
        self._store = store

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        store = self._store
        yield GaugeMetricFamily(
            "plugserve_fleet_connected",
            "1 while this replica is connected to etcd and watching the route table, else 0 "
            "(it then serves the last table it read).",
            value=1 if store.connected else 0,
        )
        yield GaugeMetricFamily(
            "plugserve_fleet_revision",
            "The etcd revision of the route table this replica serves.",
            value=store.revision,
        )
        yield GaugeMetricFamily(
            "plugserve_fleet_replicas",
            "Replicas publishing under the fleet prefix, as last seen from etcd.",
            value=len(store.replicas),
        )
        yield GaugeMetricFamily(
            "plugserve_fleet_invalid_entries",
            "Keys under the fleet prefix whose value is not a valid route entry or replica "
            "record (listed with their reasons in GET /admin/fleet).",
            value=len(store.invalid) + len(store.invalid_replicas),
        )
        yield CounterMetricFamily(
            "plugserve_fleet_disconnects",
            "Times this replica lost etcd after having been connected.",
            value=store.disconnects,
        )


class _CacheCollector(Collector):
    """The response cache of this process (with workers, the supervisor sums them)."""

    def __init__(self, cache: CacheFigures) -> None:
        self._cache = cache

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        cache = self._cache
        hits = CounterMetricFamily(
            "plugserve_response_cache_hits",
            "Requests answered from the response cache, without running the chain, by route.",
            labels=["route"],
        )
        misses = CounterMetricFamily(
            "plugserve_response_cache_misses",
            "Requests of a route with the response cache that it did not hold, by route.",
            labels=["route"],
        )
        for route, count in cache.hits.items():
            hits.add_metric([route], count)
        for route, count in cache.misses.items():
            misses.add_metric([route], count)
        yield from (hits, misses)
        yield CounterMetricFamily(
            "plugserve_response_cache_evictions",
            "Entries the response cache dropped to stay within response_cache_bytes.",
            value=cache.evictions,
        )
        yield GaugeMetricFamily(
            "plugserve_response_cache_bytes",
            "Bytes the response cache holds now (inputs, outputs and overhead of its entries).",
            value=cache.bytes,
        )
        yield GaugeMetricFamily(
            "plugserve_response_cache_entries",
            "Entries the response cache holds now.",
            value=len(cache),
        )
        yield GaugeMetricFamily(
            "plugserve_response_cache_capacity_bytes",
            "The response cache's bound (response_cache_bytes), summed over worker processes.",
            value=cache.capacity,
        )


class _ConnectionCollector(Collector):
    """Client connections per listener (``data``, and ``admin`` with its own port)."""

    def __init__(self, listeners: Sequence[ListenerFigures]) -> None:
        self._listeners = listeners

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        opened = GaugeMetricFamily(
            "plugserve_connections_open", "Client connections open now.", labels=["listener"]
        )
        idle = GaugeMetricFamily(
            "plugserve_connections_idle",
            "Open keep-alive connections between requests: those the cap may close.",
            labels=["listener"],
        )
        refused = CounterMetricFamily(
            "plugserve_connections_refused",
            "Connections answered 503 and closed because max_connections were open.",
            labels=["listener"],
        )
        evicted = CounterMetricFamily(
            "plugserve_connections_evicted",
            "Idle keep-alive connections closed to make room for a new one at max_connections.",
            labels=["listener"],
        )
        timed_out = CounterMetricFamily(
            "plugserve_connections_timed_out",
            "Connections closed because a request's headers (header_timeout_s) or body "
            "(body_timeout_s) took too long (408), or its answer went unread (send).",
            labels=["listener", "phase"],
        )
        for listener in self._listeners:
            opened.add_metric([listener.name], len(listener.open))
            idle.add_metric([listener.name], len(listener.idle))
            refused.add_metric([listener.name], listener.refused)
            evicted.add_metric([listener.name], listener.evicted)
            for phase, count in listener.timed_out.items():
                timed_out.add_metric([listener.name, phase], count)
        yield from (opened, idle, refused, evicted, timed_out)
