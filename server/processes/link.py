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

from plugserve.registry.errors import Unavailable
from plugserve.registry.lifecycle.registry import Registry
from plugserve.server.config import Settings
from plugserve.server.processes.pool import routes_from_json
from plugserve.server.processes.unix import READ_TIMEOUT_S, UnixClient
from plugserve.server.triton.repository import relayed

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

    async def start(self, registry: Registry, control: web.Application) -> None:
        """Serve ``control`` (what the supervisor calls on this worker: built by
        ``server/processes/worker_control.py``) on the control socket, register, take the
        server's state, catch up with the disk.

        Called once this worker's registry has loaded the plugins dir: it serves
        nothing before it has what every other worker serves.
        """
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
        for key in state["unloaded"]:
            await registry.unload((key[0], key[1], key[2]))
        self.apply_routes(registry, state["routes"])
        set_lost_roots(registry, state["lost_roots"])
        await registry.sync()  # what changed on disk since this worker's first scan
        log.info("worker_registered", worker=self.index, versions=len(registry.records))
        if not state["listen"]:  # the first workers listen together, once all have loaded
            await self._go.wait()

    def go(self) -> None:
        """The supervisor's "listen now": every first worker has loaded."""
        self._go.set()

    async def drained(self) -> None:
        """This worker has drained; wait until every worker has, then stop (together)."""
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            await self.supervisor.call(
                "POST", "/_supervisor/drained", json_body={"index": self.index}
            )

    def apply_routes(self, registry: Registry, state: dict[str, Any]) -> bool:
        generation = int(state["generation"])
        if generation <= self.generation:
            return False  # an older change that arrived late
        self.generation = generation
        registry.set_runtime_routes(routes_from_json(state["routes"]))
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


WORKER = web.AppKey("worker", WorkerLink)
"""Set in a worker among several: its link to the supervisor."""
