"""The supervisor's control app: whole-server answers to what any worker forwards.

Workers forward the admin API, ``/metrics`` and the statistics extension here
(over the supervisor's Unix socket); each call is answered from every worker's
own answer, merged, or made once here (route changes, fleet) and applied by
every worker before it answers.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from plugserve.registry import checks
from plugserve.registry.errors import NotFound, PlugserveError, Unavailable
from plugserve.registry.execution.isolation.host import RunnerHost
from plugserve.registry.execution.stats import RunnerStats
from plugserve.registry.fleet.etcd_store import EtcdRouteStore
from plugserve.registry.fleet.route_store import RouteStore
from plugserve.registry.routing.figures import WindowFigures, parse_windows
from plugserve.server import __version__
from plugserve.server.http.middleware import error_response
from plugserve.server.http_api import admin, v2
from plugserve.server.processes import merge
from plugserve.server.processes.pool import Worker, WorkerPool
from plugserve.server.processes.shared_runners import RUNNERS
from plugserve.server.processes.shared_runners import metrics_text as runner_metrics
from plugserve.server.processes.tree_budget import TreeBudget
from plugserve.server.processes.unix import Reply, UnixClient
from plugserve.server.rollouts.controller import (
    ACTIONS,
    ROLLOUTS,
    RolloutController,
    check_status,
    operate,
)
from plugserve.server.runtime.metrics import (
    Metrics,
    RolloutCollector,
    _FleetCollector,
    decisions_counter,
)
from plugserve.server.triton.shared_memory import Regions
from plugserve.server.triton.statistics import ISOLATED_RUNNER

POOL = web.AppKey("pool", WorkerPool)
STORE = web.AppKey("store", RouteStore)
WATCHING = web.AppKey("watching", bool)
STARTED = web.AppKey("started", float)
ON_REGISTER: web.AppKey[Callable[[int, int], bool | None]] = web.AppKey("on_register")
"""The supervisor's answer to a worker that registers: ``None`` when it is not one it
started, else whether it may listen at once (``False`` until every first worker loaded)."""
ON_DRAINED: web.AppKey[Callable[[int], Awaitable[None]]] = web.AppKey("on_drained")
BUDGET = web.AppKey("budget", TreeBudget)
"""Set with a memory budget: the tree's (server/processes/tree_budget.py)."""
SHM_REGIONS = web.AppKey("shm_regions", Regions)
"""Every worker's shared memory regions: registered, and their objects held, here."""


class SupervisorMetrics:
    """What only the supervisor knows: its workers, their restarts, and the fleet."""

    def __init__(self, store: RouteStore) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.workers = Gauge(
            "plugserve_workers", "Worker processes serving now.", registry=self.registry
        )
        self.restarts = Counter(
            "plugserve_worker_restarts",
            "Worker processes started again after one ended unasked.",
            ["worker"],
            registry=self.registry,
        )
        self.decisions = decisions_counter(self.registry)
        self.registry.register(RolloutCollector(store.registry))
        if isinstance(store, EtcdRouteStore):
            self.registry.register(_FleetCollector(store))

    def render(self) -> str:
        return generate_latest(self.registry).decode()


log = structlog.get_logger("plugserve.supervisor")


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Errors as the workers answer them: ``{"error": ...}`` with the status that fits."""
    try:
        return await handler(request)
    except PlugserveError as exc:
        return error_response(exc)
    except web.HTTPException:
        raise
    except Exception:
        log.exception("control_call_failed", path=request.path)
        return web.json_response({"error": "internal server error"}, status=500)


SUPERVISOR_METRICS = web.AppKey("supervisor_metrics", SupervisorMetrics)


def _reply(reply: Reply) -> web.Response:
    return web.Response(status=reply.status, body=reply.body, headers=reply.headers)


def _first_refusal(answers: list[tuple[Worker, Reply]]) -> web.Response | None:
    if not answers:
        raise Unavailable("no worker is serving yet")
    for _, reply in answers:
        if reply.status != 200:
            return _reply(reply)
    return None


async def register(request: web.Request) -> web.Response:
    """A worker that has loaded the plugins dir joins: it gets the runtime routes and the
    versions unloaded through the API, and takes part in every change from now on."""
    body = await request.json()
    index, pid = int(body["index"]), int(body["pid"])
    listen = request.app[ON_REGISTER](index, pid)
    if listen is None:
        return web.json_response({"error": f"no worker {index} with pid {pid}"}, status=409)
    pool = request.app[POOL]
    worker = Worker(index, pid, float(body["started_at"]), UnixClient(Path(body["socket"])))
    async with pool.changing:  # a change under way reaches it, or is over and in records
        unloaded = [list(k) for k, r in pool.records.items() if r.state == "unloaded"]
        pool.add(worker)
    request.app[SUPERVISOR_METRICS].workers.set(len(pool.workers))
    return web.json_response(
        {
            "routes": pool.routes_for_new_worker(),
            "unloaded": unloaded,
            "lost_roots": pool.lost_roots_as_json(),
            "listen": listen,
        }
    )


async def drained(request: web.Request) -> web.Response:
    """A worker has drained: it waits here until every worker has (they stop together)."""
    await request.app[ON_DRAINED](int((await request.json())["index"]))
    return web.json_response({"stop": True})


async def shm_register(request: web.Request) -> web.Response:
    """A region a worker's client registers: opened here, held until unregistered, and in
    the table every worker reads (each opens this process's descriptor of it)."""
    body = await request.json()
    request.app[SHM_REGIONS].register(
        body.get("name"), body.get("key"), body.get("offset"), body.get("byte_size")
    )
    return web.json_response({})


async def shm_unregister(request: web.Request) -> web.Response:
    request.app[SHM_REGIONS].unregister((await request.json()).get("name"))
    return web.json_response({})


async def fleet_health(request: web.Request) -> web.Response:
    store = request.app[STORE]
    return web.json_response({"ready": store.ready, "health": store.health()})


async def list_plugins(request: web.Request) -> web.Response:
    rows = await request.app[POOL].refresh()
    runners = request.app.get(RUNNERS)
    if runners is not None:
        for row in rows:
            if row.get("isolation") == "process":  # the processes as they are now
                label = f"{row['type']}/{row['name']}@{row['version']}"
                groups = [g for g in runners.groups.values() if g.spec.label == label]
                row["pids"] = sorted(p for g in groups for p in g.pids)
                row["restarts"] = sum(g.restarts for g in groups)
                current = next((g for g in groups if runners.current.get(g.content) is g), None)
                if current is not None:  # the processes' own figures, counted once
                    figures = await runners.figures(current.key)
                    row.update({k: v for k, v in figures.items() if k != "stats"})
    return web.json_response({"plugins": rows})


async def list_routes(request: web.Request) -> web.Response:
    reply = await request.app[POOL].call_one("GET", "/admin/routes")
    if reply is None:
        raise Unavailable("no worker is serving yet")
    if reply.status != 200:
        return _reply(reply)
    store = request.app[STORE]
    answer = reply.json()
    answer["routes"] = _with_rollouts(request.app, answer["routes"])
    return web.json_response({**answer, "runtime": {**store.health(), "invalid": store.invalid}})


def _with_rollouts(app: web.Application, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each rollout's row with its window's figures, merged here from every worker's."""
    controller, specs = app[ROLLOUTS], app[STORE].registry.runtime_routes
    for row in rows:
        spec = specs.get(row["name"])
        if "rollout" in row and spec is not None:
            row["rollout"].update(controller.describe(row["name"], spec.rollout) or {})
    return rows


async def get_rollout(request: web.Request) -> web.Response:
    name = admin.route_name(request)
    described = await _described(request.app[POOL], name)
    spec = request.app[STORE].registry.runtime_routes.get(name)
    if described is None or "rollout" not in described or spec is None:
        raise NotFound(f"route {name!r} has no rollout")
    row = _with_rollouts(request.app, [described])[0]
    return web.json_response(
        {"route": name, "revision": spec.revision, "rollout": row["rollout"]},
        headers={"ETag": f'"{spec.revision}"'},
    )


async def rollout_action(request: web.Request) -> web.Response:
    name = admin.route_name(request)
    action = request.match_info["action"]
    if action not in ACTIONS:
        raise NotFound(f"no rollout action {checks.shown(action)}; known: {sorted(ACTIONS)}")
    reason = await admin.action_reason(request)
    pool = request.app[POOL]
    counted = request.app[ROLLOUTS].counted
    stored = await operate(
        request.app[STORE], name, action, reason, admin.if_match(request), counted
    )
    await pool.settled()
    described = await _described(pool, name) or {}
    return admin.put_answer(stored, _with_rollouts(request.app, [described])[0])


def rollout_controller(
    store: RouteStore, pool: WorkerPool, metrics: SupervisorMetrics, interval_s: float
) -> RolloutController:
    """The server's rollouts decided here, from every worker's figures merged."""

    async def figures() -> dict[str, tuple[str, WindowFigures]]:
        wanted = {
            name: spec.rollout.key
            for name, spec in store.registry.runtime_routes.items()
            if spec.rollout is not None
        }
        merged = {route: (key, WindowFigures()) for route, key in wanted.items()}
        for worker, reply in await pool.call_all("GET", "/_control/rollouts/figures"):
            if reply.status != 200:
                continue
            try:
                windows = parse_windows(reply.json())
            except ValueError as exc:
                log.warning("rollout_figures_invalid", worker=worker.index, error=str(exc))
                continue
            for route, (key, each) in windows.items():
                if wanted.get(route) == key:  # a worker still on the last window: left out
                    merged[route][1].add(each)
        return merged

    def counted(route: str, decision: str) -> None:
        metrics.decisions.labels(route, decision).inc()

    return RolloutController(store, figures, interval_s, counted)


async def _described(pool: WorkerPool, name: str) -> dict[str, Any] | None:
    reply = await pool.call_one("GET", "/admin/routes")
    routes = reply.json()["routes"] if reply is not None and reply.status == 200 else []
    return next((r for r in routes if r["name"] == name), None)


async def put_route(request: web.Request) -> web.Response:
    spec = await admin.route_entry(request)
    pool = request.app[POOL]
    store = request.app[STORE]
    check_status(store.registry.runtime_routes.get(spec.name), spec)
    stored = await store.put(spec, admin.if_match(request))
    await pool.settled()
    return admin.put_answer(stored, await _described(pool, spec.name) or {})


async def delete_route(request: web.Request) -> web.Response:
    name = admin.route_name(request)
    pool = request.app[POOL]
    revision = await request.app[STORE].delete(name, admin.if_match(request))
    await pool.settled()
    return admin.delete_answer(name, revision, await _described(pool, name))


async def fleet(request: web.Request) -> web.Response:
    return web.json_response(await request.app[STORE].fleet())


async def reload_all(request: web.Request) -> web.Response:
    force = request.query.get("force", "false").lower() in ("1", "true", "yes")
    pool = request.app[POOL]
    if not pool.workers:
        raise Unavailable("no worker is serving yet")
    report = await pool.sync(force=force)
    if not report.as_json():
        raise Unavailable("no worker answered the rescan")
    return web.json_response(report.as_json())


async def version_call(request: web.Request) -> web.Response:
    """Reload or unload one version on every worker; answers when all have."""
    pool = request.app[POOL]
    async with pool.changing:
        answers = await pool.call_all("POST", request.rel_url.raw_path_qs)
        refused = _first_refusal(answers)
        if refused is not None:
            await pool.refresh()
            return refused
        first = answers[0][1].json()
        rows = merge.plugins([(w.pid, [r.json()["plugin"]]) for w, r in answers])
        plugin = first["plugin"]
        await pool.changed(
            {first["outcome"]: [f"{plugin['type']}/{plugin['name']}@{plugin['version']}"]}
        )
    return web.json_response({**first, "plugin": rows[0]})


async def repository_index(request: web.Request) -> web.Response:
    """Triton's repository index: any worker's (every worker serves the same routes)."""
    reply = await request.app[POOL].call_one("POST", "/v2/repository/index", await request.read())
    if reply is None:
        raise Unavailable("no worker is serving yet")
    return _reply(reply)


async def repository_change(request: web.Request) -> web.Response:
    """Triton's repository load or unload of a route, on every worker; answers when all have."""
    pool = request.app[POOL]
    body = await request.read()
    async with pool.changing:
        answers = await pool.call_all("POST", request.rel_url.raw_path_qs, body=body)
        refused = _first_refusal(answers)
        if refused is not None:
            await pool.refresh()
            return refused
        first = answers[0][1].json()
        await pool.changed(first)
    return web.json_response(first)


async def status(request: web.Request) -> web.Response:
    pool, store, budget = request.app[POOL], request.app[STORE], request.app.get(BUDGET)
    answers = await pool.call_all("GET", "/admin/status")
    refused = _first_refusal(answers)
    if refused is not None:
        return refused
    docs = [r.json() for _, r in answers]
    requests: dict[str, int] = {}
    for doc in docs:
        for route, count in doc["requests"].items():
            requests[route] = requests.get(route, 0) + count
    return web.json_response(
        {
            "version": __version__,
            "uptime_s": time.monotonic() - request.app[STARTED],
            "plugins": merge.plugins([(w.pid, r.json()["plugins"]) for w, r in answers]),
            "routes": docs[0]["routes"],
            "readiness": docs[0]["readiness"],
            "requests": requests,
            "fleet": store.health(),
            "memory": budget.describe() if budget is not None else None,
            "watch": {
                "enabled": request.app[WATCHING],
                "lost": [
                    {"path": str(path), "since": since}
                    for path, since in sorted(pool.lost_roots.items())
                ],
            },
            "workers": [
                {
                    **w.as_json(pool.restarts.get(w.index, 0)),
                    "requests": sum(doc["requests"].values()),
                    "ready": doc["readiness"]["ready"],
                }
                for (w, _), doc in zip(answers, docs, strict=True)
            ],
        }
    )


async def metrics(request: web.Request) -> web.Response:
    pool = request.app[POOL]
    texts = await pool.metrics()
    runners = request.app.get(RUNNERS)
    if runners is not None and runners.current:  # isolated runners' executions: counted here
        texts.append(("", await runner_metrics(runners)))
    body = merge.metrics(texts, pool.retired_metrics) + request.app[SUPERVISOR_METRICS].render()
    response = web.Response(body=body.encode())
    response.headers["Content-Type"] = Metrics.content_type
    return response


async def statistics(request: web.Request) -> web.Response:
    answers = await request.app[POOL].call_all("GET", request.rel_url.raw_path_qs)
    refused = _first_refusal(answers)
    if refused is not None:
        return refused
    merged = merge.model_stats(r.json() for _, r in answers)
    runners = request.app.get(RUNNERS)
    for entry in merged["model_stats"]:
        label = entry.pop(ISOLATED_RUNNER, None)
        if label is not None and runners is not None:  # executions: the processes' own
            executions = await _executions(runners, label)
            entry["execution_count"] = executions.execution_count
            entry["batch_stats"] = executions.as_triton("", "")["batch_stats"]
    return web.json_response(merged)


async def _executions(runners: RunnerHost, label: str) -> RunnerStats:
    group = next(
        (g for g in runners.current.values() if g.spec.label == label and not g.stopping), None
    )
    if group is None:
        return RunnerStats()
    stats = (await runners.figures(group.key)).get("stats")
    return stats if isinstance(stats, RunnerStats) else RunnerStats()


def control_app(
    pool: WorkerPool,
    store: RouteStore,
    watching: bool,
    on_register: Callable[[int, int], bool | None],
    on_drained: Callable[[int], Awaitable[None]],
    regions: Regions,
) -> web.Application:
    """The supervisor's app; its socket is reachable by this server's processes only."""
    app = web.Application(middlewares=[errors], client_max_size=64 * 1024 * 1024)
    app[POOL] = pool
    app[STORE] = store
    app[SUPERVISOR_METRICS] = SupervisorMetrics(store)
    app[WATCHING] = watching
    app[STARTED] = time.monotonic()
    app[ON_REGISTER] = on_register
    app[ON_DRAINED] = on_drained
    app[SHM_REGIONS] = regions
    r = app.router
    r.add_post("/_supervisor/register", register)
    r.add_get("/_supervisor/fleet", fleet_health)
    r.add_post("/_supervisor/drained", drained)
    r.add_post("/_supervisor/shm/register", shm_register)
    r.add_post("/_supervisor/shm/unregister", shm_unregister)
    r.add_get("/admin/plugins", list_plugins)
    r.add_get("/admin/routes", list_routes)
    r.add_put("/admin/routes/{route}", put_route)
    r.add_delete("/admin/routes/{route}", delete_route)
    r.add_get("/admin/routes/{route}/rollout", get_rollout)
    r.add_post("/admin/routes/{route}/rollout/{action}", rollout_action)
    r.add_get("/admin/fleet", fleet)
    r.add_post("/admin/reload", reload_all)
    version = "/admin/plugins/{type}/{name}/{version}"
    r.add_post(version + "/reload", version_call)
    r.add_post(version + "/unload", version_call)
    r.add_get("/admin/status", status)
    r.add_get("/metrics", metrics)
    v2.add_stats_routes(app, statistics)
    r.add_post("/v2/repository/index", repository_index)
    r.add_post("/v2/repository/models/{route}/load", repository_change)
    r.add_post("/v2/repository/models/{route}/unload", repository_change)
    return app
