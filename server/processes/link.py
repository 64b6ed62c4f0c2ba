"""A worker's side of the supervisor: its control socket, registration and forwarding.

A worker serves the data plane from its own registry. Control calls reach it
from the supervisor on a Unix socket of its own (``/_control/*``, and the
single-process admin handlers, which answer for this worker alone); the
admin API, ``/metrics`` and the statistics a client calls on the worker are
forwarded to the supervisor, which answers them for the whole server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from plugserve.registry.errors import InvalidInput, Unavailable
from plugserve.registry.registry import Registry
from plugserve.server import admin, v2
from plugserve.server.config import Settings
from plugserve.server.middleware import request_middleware
from plugserve.server.processes.pool import routes_from_json
from plugserve.server.processes.unix import READ_TIMEOUT_S, UnixClient
from plugserve.server.state import (
    BODIES,
    DRAIN,
    METRICS,
    REGISTRY,
    REPOSITORY,
    ROUTE_STORE,
    SETTINGS,
)
from plugserve.server.triton.repository import LocalRepository, relayed

log = structlog.get_logger("plugserve.worker")

FORWARDED_HEADERS = ("Content-Type", "If-Match")
LISTEN_WAIT_S = 5.0
"""How long the supervisor's "listen now" waits for the socket to listen."""


@dataclass(frozen=True)
class WorkerSpec:
    """What the supervisor hands a worker it starts (pickled on the worker's stdin)."""

    settings: Settings
    index: int
    workers: int
    address: tuple[str, int]
    """Where the data plane listens: each worker binds it with ``SO_REUSEPORT``."""
    data_fd: int | None
    """Worker 0 of the first start: the socket the supervisor answered on while the
    workers loaded, listening already (the others bind their own)."""
    admin_fds: tuple[int, ...]
    """The control plane's own listening socket (``admin_port``), shared by every worker."""
    lifeline_fd: int
    supervisor_socket: Path
    control_dir: Path
    supervisor_pid: int
    change_timeout_s: float = 600.0
    """How long the supervisor gives every worker to apply a change."""
    fleet: bool = False
    """Fleet mode: the supervisor follows etcd; readiness asks it."""


class WorkerLink:
    """The worker's connection to its supervisor."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.index = spec.index
        self.pid = os.getpid()
        self.started_at = time.time()
        self.socket_path = spec.control_dir / f"worker-{spec.index}-{self.pid}.sock"
        # A forwarded change may load, swap and drain on every worker (the supervisor's bound).
        self.supervisor = UnixClient(spec.supervisor_socket, spec.change_timeout_s + 15)
        self.generation = -1
        self.listening = asyncio.Event()
        """Set once this worker's data socket listens."""
        self._go = asyncio.Event()
        self._runner: web.AppRunner | None = None

    # -- lifetime ----------------------------------------------------------------------

    def watch_supervisor(self) -> None:
        """Drain and exit when the supervisor is gone (its end of the lifeline closes)."""
        loop = asyncio.get_running_loop()
        fd = self.spec.lifeline_fd

        def readable() -> None:
            try:
                data = os.read(fd, 64)
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(fd)
                log.error("supervisor_gone", worker=self.index)
                os.kill(os.getpid(), signal.SIGTERM)

        loop.add_reader(fd, readable)

    async def start(self, app: web.Application) -> None:
        """Open the control socket, register, take the server's state, catch up with the disk.

        Called once this worker's registry has loaded the plugins dir: it serves
        nothing before it has what every other worker serves.
        """
        control = web.Application(
            middlewares=[request_middleware], client_max_size=app[SETTINGS].max_body_bytes
        )
        control[SETTINGS], control[REGISTRY] = app[SETTINGS], app[REGISTRY]
        control[METRICS], control[DRAIN] = app[METRICS], app[DRAIN]
        control[ROUTE_STORE], control[BODIES] = app[ROUTE_STORE], app[BODIES]
        control[admin.STARTED] = app[admin.STARTED]
        control[admin.PROFILING] = app[admin.PROFILING]
        control[REPOSITORY] = LocalRepository(app[REGISTRY])
        _add_control_routes(control, self)
        self._runner = web.AppRunner(control, access_log=None)
        await self._runner.setup()
        await web.UnixSite(self._runner, str(self.socket_path)).start()
        reply = await self.supervisor.call(
            "POST",
            "/_supervisor/register",
            json_body={
                "index": self.index,
                "pid": self.pid,
                "socket": str(self.socket_path),
                "started_at": self.started_at,
            },
        )
        if reply.status != 200:
            raise RuntimeError(f"the supervisor refused this worker: {reply.body[:500]!r}")
        state = reply.json()
        registry = app[REGISTRY]
        for key in state["unloaded"]:
            await registry.unload((key[0], key[1], key[2]))
        self.apply_routes(app, state["routes"])
        set_lost_roots(registry, state["lost_roots"])
        await registry.sync()  # what changed on disk since this worker's first scan
        log.info("worker_registered", worker=self.index, versions=len(registry.records))
        if not state["listen"]:  # the first workers listen together, once all have loaded
            await self._go.wait()

    async def drained(self) -> None:
        """This worker has drained; wait until every worker has, then stop (together)."""
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            await self.supervisor.call(
                "POST", "/_supervisor/drained", json_body={"index": self.index}
            )

    def apply_routes(self, app: web.Application, state: dict[str, Any]) -> bool:
        generation = int(state["generation"])
        if generation <= self.generation:
            return False  # an older change that arrived late
        self.generation = generation
        app[REGISTRY].set_runtime_routes(routes_from_json(state["routes"]))
        return True

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self.supervisor.close()
        with contextlib.suppress(OSError):
            self.socket_path.unlink()
        if os.getppid() != self.spec.supervisor_pid:  # it died: nobody else clears its folder
            shutil.rmtree(self.spec.control_dir, ignore_errors=True)

    async def fleet_health(self) -> tuple[bool, dict[str, Any]]:
        """Whether the supervisor has read the fleet's route table, and its sync state."""
        try:
            reply = await self.supervisor.call(
                "GET", "/_supervisor/fleet", timeout_s=READ_TIMEOUT_S
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise Unavailable(f"the supervisor is not answering: {exc!r}") from None
        state = reply.json()
        return bool(state["ready"]), state["health"]

    # -- forwarding --------------------------------------------------------------------

    async def shared_memory(self, call: str, body: dict[str, Any]) -> None:
        """A shared memory register or unregister, made by the supervisor, which holds every
        region's object for all workers (server/triton/shared_memory.py); its error as ours."""
        try:
            reply = await self.supervisor.call(
                "POST", f"/_supervisor/shm/{call}", json_body=body, timeout_s=READ_TIMEOUT_S
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise Unavailable(f"the supervisor is not answering: {exc!r}") from None
        if reply.status != 200:
            answer = reply.json()
            raise relayed(reply.status, answer.get("error", "") if isinstance(answer, dict) else "")

    async def forward(self, request: web.Request) -> web.Response:
        """Answer a whole-server call (admin, metrics, statistics) through the supervisor."""
        body = await request.read() if request.can_read_body else None
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        try:
            reply = await self.supervisor.call(
                request.method, request.rel_url.raw_path_qs, body, headers
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise Unavailable(f"the supervisor is not answering: {exc!r}") from None
        return web.Response(status=reply.status, body=reply.body, headers=reply.headers)


def set_lost_roots(registry: Registry, paths: dict[str, float]) -> None:
    """What the supervisor's watcher found missing: this worker is not ready meanwhile."""
    registry.lost_roots = {Path(path): float(since) for path, since in paths.items()}


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
        return web.json_response({"result": registry.sync_routes_file()})

    async def runtime_routes(request: web.Request) -> web.Response:
        applied = link.apply_routes(control, await request.json())
        return web.json_response({"applied": applied, "generation": link.generation})

    async def listen(request: web.Request) -> web.Response:
        link._go.set()
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
