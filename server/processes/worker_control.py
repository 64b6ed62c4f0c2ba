"""What the supervisor calls on a worker, on the worker's control socket: its own state
(the single-process admin and statistics handlers, which answer for this worker alone)
and the changes to apply (``/_control/*``). Built by the assembly (``server/app.py``) and
served by the worker's :class:`~plugserve.server.processes.link.WorkerLink`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from aiohttp import web

from plugserve.registry.errors import InvalidInput
from plugserve.server.dataplane.plane import DATA_PLANE
from plugserve.server.http.bodies import BODIES
from plugserve.server.http.middleware import request_middleware
from plugserve.server.http_api import admin, v2
from plugserve.server.processes import tree_budget
from plugserve.server.processes.link import LISTEN_WAIT_S, WorkerLink, set_lost_roots
from plugserve.server.state import DRAIN, METRICS, REGISTRY, ROUTE_STORE, SETTINGS
from plugserve.server.triton.answers import READINESS
from plugserve.server.triton.repository import REPOSITORY, LocalRepository
from plugserve.server.triton.statistics import STATISTICS, LocalStatistics


def control_app(app: web.Application, link: WorkerLink) -> web.Application:
    """The worker's control application, sharing ``app``'s parts."""
    control = web.Application(
        middlewares=[request_middleware], client_max_size=app[SETTINGS].max_body_bytes
    )
    control[SETTINGS], control[REGISTRY] = app[SETTINGS], app[REGISTRY]
    control[METRICS], control[DRAIN] = app[METRICS], app[DRAIN]
    control[ROUTE_STORE], control[BODIES] = app[ROUTE_STORE], app[BODIES]
    control[admin.STARTED] = app[admin.STARTED]
    control[admin.PROFILING] = app[admin.PROFILING]
    control[READINESS] = app[READINESS]
    control[REPOSITORY] = LocalRepository(app[REGISTRY])
    control[STATISTICS] = LocalStatistics(app[REGISTRY])
    _add_control_routes(control, link)
    windows = app[DATA_PLANE].windows

    async def rollout_figures(request: web.Request) -> web.Response:
        """This worker's rollout windows: the supervisor merges every worker's."""
        return web.json_response(windows.as_json())

    control.router.add_get("/_control/rollouts/figures", rollout_figures)
    return control


def _add_control_routes(control: web.Application, link: WorkerLink) -> None:
    """What the supervisor calls on this worker: its own state, and the changes to apply."""
    registry = control[REGISTRY]

    async def sync_version(request: web.Request) -> web.Response:
        key = (await request.json())["key"]
        if not (isinstance(key, list) and len(key) == 3):
            raise InvalidInput("key must be [type, name, version]")
        outcome = await registry.sync_version((str(key[0]), str(key[1]), str(key[2])))
        return web.json_response({"outcome": outcome})

    async def sync_model(request: web.Request) -> web.Response:
        outcomes = await registry.sync_model(str((await request.json())["name"]))
        return web.json_response({"outcomes": outcomes})

    async def sync_routes_file(request: web.Request) -> web.Response:
        return web.json_response({"result": await registry.sync_routes_file()})

    async def runtime_routes(request: web.Request) -> web.Response:
        applied = link.apply_routes(registry, await request.json())
        return web.json_response({"applied": applied, "generation": link.generation})

    async def listen(request: web.Request) -> web.Response:
        link.go()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(link.listening.wait(), LISTEN_WAIT_S)
        return web.json_response({"listening": link.listening.is_set()})

    async def lost_roots(request: web.Request) -> web.Response:
        set_lost_roots(registry, await request.json())
        return web.json_response({"lost_roots": len(registry.lost_roots)})

    async def local_metrics(request: web.Request) -> web.Response:
        return web.Response(body=control[METRICS].render(), content_type="text/plain")

    async def alive(request: web.Request) -> web.Response:
        """A sign of life from this worker's event loop (the supervisor's stall check)."""
        return web.json_response({"pid": os.getpid()})

    router = control.router
    router.add_get("/_control/alive", alive)
    router.add_post("/_control/sync_version", sync_version)
    router.add_post("/_control/sync_model", sync_model)
    router.add_post("/_control/sync_routes_file", sync_routes_file)
    router.add_put("/_control/runtime_routes", runtime_routes)
    router.add_put("/_control/lost_roots", lost_roots)
    router.add_post("/_control/listen", listen)
    router.add_get("/metrics", local_metrics)
    tree_budget.add_worker_routes(control, registry)
    # This worker's own answers, as a single-process server gives them.
    router.add_get("/admin/plugins", admin.list_plugins)
    router.add_get("/admin/routes", admin.list_routes)
    router.add_get("/admin/status", admin.status)
    router.add_post("/admin/reload", admin.reload_all)
    version = "/admin/plugins/{type}/{name}/{version}"
    router.add_post(version + "/reload", admin.reload_version)
    router.add_post(version + "/unload", admin.unload_version)
    v2.add_stats_routes(control, v2.statistics)
    v2.add_repository_routes(control, lambda handler: handler)  # the supervisor checked
