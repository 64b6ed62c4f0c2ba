"""The aiohttp application: state, middlewares, routes and the registry's lifetime."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from plugserve.registry.execution import tracing
from plugserve.registry.execution.components import LOOP_BUDGET_S
from plugserve.registry.execution.isolation.groups import ProcessSettings, Runners
from plugserve.registry.execution.isolation.host import RunnerHost
from plugserve.registry.execution.layout import TensorBounds
from plugserve.registry.fleet.etcd_store import EtcdLocation, EtcdRouteStore
from plugserve.registry.fleet.route_store import Replica, RouteStore, RouteTarget
from plugserve.registry.lifecycle.budget import map_large_allocations
from plugserve.registry.lifecycle.registry import BudgetFactory, Registry
from plugserve.registry.lifecycle.watcher import Watcher
from plugserve.registry.routing.figures import WindowFigures
from plugserve.server.config import Settings
from plugserve.server.dataplane.cache import RESPONSE_CACHE, ResponseCache
from plugserve.server.dataplane.plane import DATA_PLANE, DataPlane
from plugserve.server.http import auth
from plugserve.server.http.bodies import BODIES, LARGE_BODY_BYTES, Bodies
from plugserve.server.http.budget import ByteBudget
from plugserve.server.http.connections import KEEPALIVE_TIMEOUT_S
from plugserve.server.http.fastpath import FAST_PATH, FastPath
from plugserve.server.http.middleware import ERROR_SHAPES, request_middleware
from plugserve.server.http_api import admin, generate, openapi, predict, shm_http, v2
from plugserve.server.openai_api import requests as openai_requests
from plugserve.server.openai_api import routes as openai_routes
from plugserve.server.processes.link import WORKER
from plugserve.server.processes.supervised import SupervisedRepository, SupervisedStatistics
from plugserve.server.processes.worker_control import control_app
from plugserve.server.rollouts.controller import ROLLOUTS, RolloutController
from plugserve.server.runtime import heap
from plugserve.server.runtime.metrics import Metrics
from plugserve.server.runtime.shutdown import CLOSE_FLOOR_S, Drain, within
from plugserve.server.state import DRAIN, METRICS, REGISTRY, ROUTE_STORE, SETTINGS
from plugserve.server.triton.answers import READINESS, SERVED_MARKER, Readiness
from plugserve.server.triton.repository import REPOSITORY, LocalRepository
from plugserve.server.triton.shared_memory import REGIONS, Regions
from plugserve.server.triton.shm_table import LocalTable, SharedTable
from plugserve.server.triton.statistics import STATISTICS, LocalStatistics

if TYPE_CHECKING:
    from plugserve.server.processes.link import WorkerLink

log = structlog.get_logger("plugserve.server")


def trace_provider() -> object:
    from opentelemetry import trace

    return trace.get_tracer_provider()


async def metrics(request: web.Request) -> web.Response:
    await request.app[REGISTRY].refresh_isolated()  # their processes count the executions
    body = request.app[METRICS].render()
    response = web.Response(body=body)
    response.headers["Content-Type"] = Metrics.content_type
    return response


async def _registry_lifetime(app: web.Application) -> AsyncIterator[None]:
    registry, settings = app[REGISTRY], app[SETTINGS]
    if tracing.configure():
        log.info("tracing", provider=type(trace_provider()).__name__)
    await registry.start()
    await registry.host.startup(app, settings.load_timeout_s)
    store = app[ROUTE_STORE]
    await store.start()
    controller = app.get(ROLLOUTS)
    if controller is not None:
        controller.start()
    worker = app.get(WORKER)
    if worker is not None:  # one of several workers: the supervisor has the rest of the state
        worker.watch_supervisor()
        await worker.start(registry, control_app(app, worker))
    heap.settle()  # the collector off the request path (server/runtime/heap.py)
    watcher = Watcher(registry, settings.reload_debounce_ms / 1000) if settings.watch else None
    task = asyncio.create_task(watcher.run()) if watcher else None
    yield
    await _shut_down(app, watcher, task)


async def _shut_down(
    app: web.Application, watcher: Watcher | None, watching: asyncio.Task[None] | None
) -> None:
    """Stop watching, close the route store, run the shutdown hooks, close every plugin.

    All of it within the closing budget (``close_timeout_s``, and after a signal
    what the drain left), whatever plugins do: each step stops being waited for
    when the budget runs out; plugin closes always get ``CLOSE_FLOOR_S`` at least.
    """
    registry = app[REGISTRY]
    loop = asyncio.get_running_loop()
    budget = app[DRAIN].closing_budget(app[SETTINGS].close_timeout_s)
    deadline = loop.time() + budget
    if watcher is not None and watching is not None:
        watcher.stop.set()
        await within(watching, budget, "watcher")
    controller = app.get(ROLLOUTS)
    if controller is not None:
        await within(controller.close(), deadline - loop.time(), "rollouts")
    await within(app[DATA_PLANE].shadow.close(), deadline - loop.time(), "shadow")
    await within(app[ROUTE_STORE].close(), deadline - loop.time(), "route_store")
    await registry.host.shutdown(app, deadline - loop.time())  # bounded, never raises
    await registry.close(max(deadline - loop.time(), CLOSE_FLOOR_S))
    worker = app.get(WORKER)
    if worker is not None:
        await worker.stop()


async def _close_bodies(app: web.Application) -> None:
    app[BODIES].close()


def build_registry(settings: Settings, worker: WorkerLink | None = None) -> Registry:
    """This server's registry, complete. One of several workers shares its supervisor's
    rate limits, memory budget, runner processes and readiness with the other workers."""
    control = None if worker is None else worker.spec.control_dir
    on_loop = settings.runners_on_loop and (worker is not None or settings.inline_runners == "on")
    return Registry(
        settings.plugins_dir,
        settings.models_dir,
        drain_timeout=settings.drain_timeout_s,
        load_timeout=settings.load_timeout_s,
        close_timeout=settings.close_timeout_s,
        default_load=settings.default_load,
        memory_budget=settings.memory_budget_bytes,
        gpu_memory_budget=settings.gpu_memory_budget_value,
        budget=_supervised_budget(settings, worker),
        runners=_isolated_runners(settings, worker),
        workers=1 if worker is None else settings.worker_count,
        loop_budget=LOOP_BUDGET_S if on_loop else 0.0,  # auto: one of several workers only
        tensor_bounds=tensor_bounds(settings),
        shared_buckets=control,  # one rate limit per server
        served_marker=None if control is None else control / SERVED_MARKER,
    )


def _supervised_budget(settings: Settings, worker: WorkerLink | None) -> BudgetFactory | None:
    """A worker's memory budget: its supervisor's, one for the whole tree (``None``: the
    registry's own, if the settings give one)."""
    if worker is None or not (settings.memory_budget_bytes or settings.gpu_memory_budget_value):
        return None
    from plugserve.server.processes.tree_budget import SupervisedBudget

    if settings.memory_budget_bytes:
        map_large_allocations()  # as a budget of this process's own would
    supervisor, index, pid = worker.supervisor, worker.index, worker.pid
    gpus = bool(settings.gpu_memory_budget_value)
    return lambda _: SupervisedBudget(supervisor, index, pid, gpus)


def _isolated_runners(settings: Settings, worker: WorkerLink | None) -> Runners:
    """Where isolated runners run: this process's own host, or the supervisor's for all."""
    if worker is None:
        return RunnerHost(process_settings(settings))
    from plugserve.server.processes.shared_runners import SupervisedRunners

    holder = str(os.getpid())
    return SupervisedRunners(worker.supervisor, holder, process_settings(settings))


def route_store(settings: Settings, registry: RouteTarget) -> RouteStore:
    """Where runtime route changes live: this process, or etcd in fleet mode."""
    replica = Replica.default(settings.host, settings.port, settings.replica_id)
    if settings.registry == "local":
        return RouteStore(registry, replica, settings.runtime_routes_file)
    return EtcdRouteStore(
        registry,
        replica,
        EtcdLocation.parse(settings.registry, settings.etcd_password),
        lease_ttl_s=settings.fleet_lease_ttl_s,
        startup_wait_s=settings.fleet_startup_wait_s,
    )


def rollout_controller(
    store: RouteStore, plane: DataPlane, metrics: Metrics, interval_s: float
) -> RolloutController:
    """The rollouts' decider of a server of one process: from its own figures."""

    async def figures() -> dict[str, tuple[str, WindowFigures]]:
        return plane.windows.held()

    decisions = metrics.decisions()

    def counted(route: str, decision: str) -> None:
        decisions.labels(route, decision).inc()

    return RolloutController(store, figures, interval_s, counted)


def tensor_bounds(settings: Settings) -> TensorBounds:
    """What one tensor may hold, and so each tensor a batch merges its requests into."""
    return TensorBounds(settings.max_tensor_elements, settings.max_bytes_elements)


def process_settings(settings: Settings) -> ProcessSettings:
    """How this server starts runner processes (``isolation = "process"``)."""
    return ProcessSettings(
        settings.log_format,
        settings.log_level,
        settings.event_loop,
        stall_timeout_s=settings.runner_stall_timeout_s,
        tensor_bounds=tensor_bounds(settings),
    )


def create_app(
    settings: Settings, registry: Registry | None = None, worker: WorkerLink | None = None
) -> web.Application:
    """Build the application; plugins load when it starts (``cleanup_ctx``).

    With ``worker`` it is one of several worker processes: the admin API,
    ``/metrics`` and the statistics go through its supervisor, which answers
    them for the whole server (server/processes/). ``registry``: one built already,
    complete (:func:`build_registry` builds this server's).
    """
    app = web.Application(
        middlewares=[request_middleware, *auth.middlewares(settings)],
        client_max_size=settings.max_body_bytes,
    )
    app[SETTINGS] = settings
    app[REGISTRY] = registry or build_registry(settings, worker)
    app[METRICS] = Metrics()
    app[DRAIN] = Drain(settings.drain_timeout_s)
    app[DRAIN].at_timeout = lambda: app[REGISTRY].end_streams("the server is shutting down")
    app[BODIES] = Bodies(
        settings.max_body_bytes,
        settings.body_threads,
        settings.max_large_bodies,
        settings.max_json_bytes,
        ByteBudget(settings.request_bytes),
    )
    app.on_cleanup.append(_close_bodies)
    # Workers share one table of shared memory regions (server/triton/shm_table.py), which
    # their supervisor keeps: it holds every region's object (server/triton/shared_memory.py).
    table = LocalTable() if worker is None else SharedTable(worker.spec.control_dir)
    forward = None if worker is None else worker.shared_memory
    app[REGIONS] = Regions(table, settings.shared_memory, settings.max_body_bytes, forward)
    app[REGISTRY].listeners.append(app[METRICS].lifecycle_listener(app[REGISTRY]))
    app[ROUTE_STORE] = route_store(settings, app[REGISTRY])
    app[METRICS].collect_from(app[REGISTRY], app[ROUTE_STORE], rollouts=worker is None)
    app[RESPONSE_CACHE] = ResponseCache(settings.response_cache_bytes)
    app[REGISTRY].listeners.append(app[RESPONSE_CACHE].listener(app[REGISTRY]))
    app[METRICS].collect_cache(app[RESPONSE_CACHE])
    app[DATA_PLANE] = DataPlane(app[REGISTRY], app[METRICS], app[DRAIN], app[RESPONSE_CACHE])
    if worker is None:  # with workers, the supervisor decides (server/processes/)
        app[ROLLOUTS] = rollout_controller(app[ROUTE_STORE], app[DATA_PLANE], app[METRICS],
                                           settings.rollout_interval_s)  # fmt: skip
    app.cleanup_ctx.append(_registry_lifetime)
    through = None
    if worker is not None:
        app[WORKER] = worker
        app[DRAIN].before_stop = worker.drained
        through = worker.forward
    fleet = worker.fleet_health if worker is not None and worker.spec.fleet else None
    app[READINESS] = Readiness(app[REGISTRY], app[DRAIN], app[ROUTE_STORE], fleet,
                               strict=settings.strict_readiness)  # fmt: skip
    if worker is None:
        app[REPOSITORY] = LocalRepository(app[REGISTRY])
        app[STATISTICS] = LocalStatistics(app[REGISTRY])
    else:  # the supervisor answers for the whole server
        app[REPOSITORY] = SupervisedRepository(worker.supervisor)
        app[STATISTICS] = SupervisedStatistics(worker.supervisor)
    v2.add_routes(app)
    generate.add_routes(app)
    openai_routes.add_routes(app)
    shm_http.add_routes(app)
    predict.add_routes(app)
    admin.add_routes(app, through)
    app.router.add_get("/metrics", through or metrics)
    openapi.add_routes(app, openai_requests.openapi_schemas)
    if settings.fast_path and not auth.middlewares(settings):  # a token: every call checked
        fast = app[FAST_PATH] = FastPath(
            min(settings.max_body_bytes, LARGE_BODY_BYTES),
            KEEPALIVE_TIMEOUT_S,
            app.get(ERROR_SHAPES),
            settings.access_log,
        )
        v2.add_fast_routes(app, fast)
    return app
