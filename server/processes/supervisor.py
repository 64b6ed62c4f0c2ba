"""The supervisor: N worker processes on one port, and every control decision made once.

It binds the listening sockets, starts the workers (each a fresh interpreter,
``python -m plugserve.server.processes.worker``, handed its sockets and settings), keeps
them running (a worker that ends unasked is replaced, with backoff), and owns
what a single process owns besides serving: the watcher, the runtime route
store (a file, or etcd in fleet mode) and the answers for the whole server
(server/processes/control.py). It loads no plugin itself.

Sockets: each worker listens on a data socket of its own, bound to the port
with ``SO_REUSEPORT``, so the kernel spreads connections over the workers
(tests/benchmarks/spread.py: one socket the workers inherit is one-sided on
asyncio's loop, 64 connections to one worker of two, and uneven on uvloop's;
``SO_REUSEPORT`` spreads them on either). The supervisor holds the port with a
socket bound the same way but never listening (the kernel gives connections
to listening sockets only). A worker's socket ends with it, so while a worker
is replaced the kernel gives new connections to the others; a worker listens
only once its plugins are loaded. Until the first worker is, the supervisor
answers on the port itself as a single process does while it loads
(``/v2/health/live`` 200, anything else 503 with ``Retry-After``), then stops
listening: no client is told "starting" by one worker while another serves.
The control plane's own port (``admin_port``) is one socket all workers share.

Stalls: every few seconds the supervisor asks each worker's event loop for a sign
of life (``/_control/alive``); a worker whose loop does not answer within
``worker_stall_timeout_s`` (plugin code stuck on it: a synchronous processor, or a
runner run on the loop) is killed and replaced like one that died.

No orphans: each worker holds the read end of a pipe whose write end only the
supervisor holds; when the supervisor ends, however it ends, the kernel closes
it and every worker drains and exits (and Linux's parent-death signal backs
that up while a worker is still starting).

The restart loop, its backoff, the stall check and the parent-death signal are
:mod:`plugserve.registry.execution.isolation.supervision`'s, as the runner host's are.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from plugserve.registry.errors import ConfigError
from plugserve.registry.execution.isolation.host import RunnerHost
from plugserve.registry.execution.isolation.supervision import Restarts, keep_running, watch_stalls
from plugserve.registry.lifecycle.watcher import Watcher
from plugserve.server.app import process_settings, route_store
from plugserve.server.config import Settings
from plugserve.server.http.connections import ConnectionLimits
from plugserve.server.http.startup import Starting, bind, raise_open_files_limit
from plugserve.server.processes import shared_runners
from plugserve.server.processes.control import (
    BUDGET,
    SUPERVISOR_METRICS,
    control_app,
    rollout_controller,
)
from plugserve.server.processes.link import WorkerSpec
from plugserve.server.processes.pool import Worker, WorkerPool
from plugserve.server.processes.tree_budget import BudgetCollector, TreeBudget
from plugserve.server.rollouts.controller import ROLLOUTS
from plugserve.server.runtime.shutdown import SHUTDOWN_MARGIN_S
from plugserve.server.triton.shared_memory import Regions
from plugserve.server.triton.shm_table import SharedTable

log = structlog.get_logger("plugserve.supervisor")

STARTING_CONNECTIONS = 256
"""Connections the supervisor answers at once while no worker serves yet."""


class Supervisor:
    """Starts, watches and stops the workers; owns the watcher and the route store."""

    def __init__(self, settings: Settings, workers: int, port: socket.socket,
                 admin: socket.socket | None) -> None:  # fmt: skip
        self.settings = settings
        self.count = workers
        self.port = port
        self.address = (settings.host, int(port.getsockname()[1]))
        self.admin = admin
        self.dir = Path(tempfile.mkdtemp(prefix="plugserve-"))  # mode 0700: ours alone
        self.socket_path = self.dir / "supervisor.sock"
        # A change may load a version, then drain and close the one it replaces.
        self.change_timeout_s = (
            settings.load_timeout_s + settings.drain_timeout_s + settings.close_timeout_s + 10
        )
        self.pool = WorkerPool(
            settings.plugins_dir, settings.models_dir, self.change_timeout_s, self._unresponsive
        )
        self.store = route_store(settings, self.pool)
        self.stopping = asyncio.Event()
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.lifelines: dict[int, int] = {}
        self.restarts = dict.fromkeys(range(workers), 0)
        self.pool.restarts = self.restarts
        # What the workers run with: the supervisor watches, and keeps the route state.
        self.worker_settings = settings.model_copy(
            update={"watch": False, "registry": "local", "runtime_routes_file": None}
        )
        self.regions = Regions(SharedTable(self.dir), access="any")
        """Every worker's shared memory regions, their objects held here: a worker opens
        this process's descriptor, whenever it starts (server/triton/shared_memory.py)."""
        self.app = control_app(
            self.pool, self.store, settings.watch, self._registered, self._drained, self.regions
        )
        self.rollouts = rollout_controller(
            self.store, self.pool, self.app[SUPERVISOR_METRICS], settings.rollout_interval_s
        )
        """Every rollout's steps, decided from every worker's figures."""
        self.app[ROLLOUTS] = self.rollouts
        self.runners = RunnerHost(process_settings(settings))
        """Isolated runners' processes, shared by every worker (``shared_runners.py``)."""
        shared_runners.add_routes(self.app, self.runners)
        self.budget = TreeBudget(
            settings.memory_budget_bytes, settings.gpu_memory_budget_value, self.pool,
            settings.drain_timeout_s + settings.close_timeout_s + 15, settings.load_timeout_s,
        )  # fmt: skip
        """The memory budget of every worker and their runner processes (0: none)."""
        if settings.memory_budget_bytes or settings.gpu_memory_budget_value:
            self.budget.add_routes(self.app)
            self.app[BUDGET] = self.budget
            self.app[SUPERVISOR_METRICS].registry.register(BudgetCollector(self.budget))
        self._starting: asyncio.AbstractServer | None = None
        self._starting_fd: int | None = None
        self._first = set(range(workers))
        """The first workers not loaded yet: they listen together once none is left."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._drained_workers: set[int] = set()
        self._all_drained = asyncio.Event()

    def _registered(self, index: int, pid: int) -> bool | None:
        """A worker has loaded the plugins: ``None`` if it is not one this supervisor
        started; else whether it may listen now. The first workers listen together,
        once all have loaded, as one process is ready once everything is loaded."""
        proc = self.procs.get(index)
        if proc is None or proc.pid != pid:
            return None
        self._first.discard(index)
        if self._starting is None:
            return True
        if not self._first:
            self._background(self._all_loaded())
        return False

    def _unresponsive(self, worker: Worker) -> None:
        """A worker that did not apply a change is replaced, not left serving the past."""
        proc = self.procs.get(worker.index)
        if proc is not None and proc.pid == worker.pid and not self.stopping.is_set():
            log.error("worker_unresponsive", worker=worker.index, pid=worker.pid)
            _signal(proc, signal.SIGKILL)

    async def _watch_stalls(self) -> None:
        """Replace a worker whose event loop stopped answering ``/_control/alive`` for
        ``worker_stall_timeout_s``: a request's plugin code stuck on the loop would
        otherwise hold its connections, and its share of new ones, for good (no deadline
        can fire on a loop that does not turn). An ask that fails otherwise (the worker is
        gone, or going) is its keeper's business."""
        limit = self.settings.worker_stall_timeout_s

        def stalled(worker: Worker) -> None:
            proc = self.procs.get(worker.index)
            if proc is not None and proc.pid == worker.pid:
                log.error("worker_stalled", worker=worker.index, pid=worker.pid, seconds=limit)
                _signal(proc, signal.SIGKILL)

        await watch_stalls(
            targets=lambda: list(self.pool.workers.values()),
            ask=lambda worker: worker.client.call("GET", "/_control/alive", timeout_s=limit),
            stall_timeout_s=limit,
            on_stall=stalled,
            stopping=self.stopping.is_set,
        )

    async def _all_loaded(self) -> None:
        """Every first worker has loaded: the supervisor stops answering, they listen.

        The supervisor's listening socket lives on in worker 0, which inherited it:
        what arrives between the two steps waits in its backlog, neither refused nor
        told "starting"."""
        starting, self._starting = self._starting, None
        if starting is None:
            return
        starting.close()
        self._starting_fd = None
        await self.pool.call_all("POST", "/_control/listen")
        log.info("workers_listening", workers=len(self.pool.workers))

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drained(self, index: int) -> None:
        """Hold a drained worker until every worker has drained (or the drain's bound):
        while one still drains, the others keep answering new connections 503."""
        if not self.stopping.is_set():
            return  # this worker alone was asked to stop
        self._drained_workers.add(index)
        if self._drained_workers >= set(self.procs):
            self._all_drained.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_drained.wait(), self.settings.drain_timeout_s)

    async def _answer_while_starting(self) -> None:
        """Answer on the port, as a single process does while its plugins first load."""
        settings = self.settings
        limits = ConnectionLimits(
            settings.header_timeout_s, settings.body_timeout_s, STARTING_CONNECTIONS
        )
        answering: set[Starting] = set()
        loop = asyncio.get_running_loop()
        sock = bind(*self.address, reuse_port=True)
        sock.listen(1024)
        self._starting_fd = sock.fileno()  # worker 0 inherits it (see _all_loaded)
        self._starting = await loop.create_server(
            lambda: Starting(limits, answering), sock=sock, backlog=1024
        )

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signalled, sig)
        runner = web.AppRunner(self.app, access_log=None)
        await runner.setup()
        await web.UnixSite(runner, str(self.socket_path)).start()
        try:
            await self.store.start()
        except ConfigError:
            await runner.cleanup()
            raise
        await self._answer_while_starting()
        self.rollouts.start()
        keepers = [asyncio.create_task(self._keep(i)) for i in range(self.count)]
        self._background(self._watch_stalls())
        watcher = Watcher(self.pool, self.settings.reload_debounce_ms / 1000)
        watching = asyncio.create_task(watcher.run()) if self.settings.watch else None
        log.info("supervising", workers=self.count, pid=os.getpid())
        await self.stopping.wait()
        log.info("stopping_workers", workers=len(self.procs))
        if watching is not None:
            watcher.stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watching, 5)
        for proc in list(self.procs.values()):
            _signal(proc, signal.SIGTERM)
        bound = self.settings.drain_timeout_s + SHUTDOWN_MARGIN_S + 2
        _, pending = await asyncio.wait(keepers, timeout=bound)
        for proc in list(self.procs.values()):
            log.error("worker_overdue", pid=proc.pid, seconds=bound)
            _signal(proc, signal.SIGKILL)
        if pending:
            await asyncio.wait(pending, timeout=5)
        await self.rollouts.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.store.close(), self.settings.close_timeout_s)
        await self.runners.close()
        await self.pool.close()
        await runner.cleanup()
        shutil.rmtree(self.dir, ignore_errors=True)
        log.info("stopped")
        return 0

    def _signalled(self, sig: signal.Signals) -> None:
        if self.stopping.is_set():  # a second signal: stop the workers without waiting
            for proc in list(self.procs.values()):
                _signal(proc, signal.SIGINT)
            return
        log.info("signal", signal=sig.name)
        self.stopping.set()

    async def _keep(self, index: int) -> None:
        """Run worker ``index`` until the supervisor stops; start it again when it ends
        (or fails to start), with backoff."""
        await keep_running(
            start=functools.partial(self._spawn, index),
            wait_for_exit=functools.partial(self._reap, index),
            stopping=self.stopping.is_set,
            on_exit=lambda proc, code, delay: self._died(index, code, delay),
            on_start_failure=functools.partial(self._start_failed, index),
            start_errors=(OSError,),
            restarts=Restarts(),
            woken_by=self.stopping,
        )

    async def _reap(self, index: int, proc: asyncio.subprocess.Process) -> int:
        """Wait for worker ``index`` to end, and let go of what it held; its exit code."""
        code = await proc.wait()
        self.procs.pop(index, None)
        if index in self._first:  # it never loaded: the others need not wait for it
            self._first.discard(index)
            if not self._first and self.pool.workers:
                self._background(self._all_loaded())
        if self.stopping.is_set() and self._drained_workers >= set(self.procs):
            self._all_drained.set()
        os.close(self.lifelines.pop(index))
        await self.pool.remove(index, proc.pid)
        self.budget.worker_gone(proc.pid)
        await self.runners.release_holder(str(proc.pid))
        self.app[SUPERVISOR_METRICS].workers.set(len(self.pool.workers))
        return code

    def _died(self, index: int, code: int | None, delay: float) -> None:
        """Count the restart of worker ``index``, which ended with ``code`` (``None``: it
        did not start), due in ``delay`` seconds."""
        self.restarts[index] += 1
        self.app[SUPERVISOR_METRICS].restarts.labels(str(index)).inc()
        log.error("worker_died", worker=index, exit=_ended(code),
                  restarts=self.restarts[index], restart_in_s=delay)  # fmt: skip

    def _start_failed(self, index: int, error: BaseException, failures: int, delay: float) -> bool:
        """A worker that cannot be started is counted as one that died, and tried again
        unless the supervisor is stopping."""
        log.error("worker_start_failed", worker=index, error=repr(error))
        if self.stopping.is_set():
            return False
        self._died(index, None, delay)
        return True

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        listen = [] if self.admin is None else [self.admin.fileno()]
        data_fd = self._starting_fd if index == 0 else None
        read_end, write_end = os.pipe()
        spec = WorkerSpec(
            settings=self.worker_settings,
            index=index,
            workers=self.count,
            address=self.address,
            data_fd=data_fd,
            admin_fds=tuple(listen),
            lifeline_fd=read_end,
            supervisor_socket=self.socket_path,
            control_dir=self.dir,
            supervisor_pid=os.getpid(),
            change_timeout_s=self.change_timeout_s,
            fleet=self.settings.registry != "local",
        )
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "plugserve.server.processes.worker",
                stdin=asyncio.subprocess.PIPE,
                pass_fds=(*listen, read_end, *([] if data_fd is None else [data_fd])),
                start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor alone
            )  # fmt: skip
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self.procs[index] = proc
        self.lifelines[index] = write_end
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps(spec))
        with contextlib.suppress(ConnectionError):
            await proc.stdin.drain()
        proc.stdin.close()
        log.info("worker_started", worker=index, pid=proc.pid)
        return proc


def _signal(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


def _ended(code: int | None) -> str:
    if code is None:
        return "not started"
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit {code}"


def bind_workers(settings: Settings) -> tuple[socket.socket, socket.socket | None]:
    """The port, held for the workers (bound with ``SO_REUSEPORT``, not listening), and the
    control plane's own listening socket when it has a port.

    Raises :class:`ConfigError` when an address cannot be listened on.
    """
    # Free first, as one process would find it: SO_REUSEPORT alone would share the port
    # with another server of the same user listening there.
    probe = bind(settings.host, settings.port, reuse_port=False)
    number = probe.getsockname()[1]
    probe.close()
    port = bind(settings.host, number, reuse_port=True)
    try:
        admin = None
        if settings.admin_port is not None:
            admin = bind(settings.admin_host or settings.host, settings.admin_port, False)
            admin.listen(1024)
    except BaseException:
        port.close()
        raise
    return port, admin


def supervise(settings: Settings, workers: int, loop: asyncio.AbstractEventLoop) -> int:
    """Serve with ``workers`` worker processes until a signal; the exit code.

    The supervisor's open-files limit is raised as a worker's is: it holds a descriptor
    per shared memory region besides its sockets.
    """
    raise_open_files_limit()
    port, admin = bind_workers(settings)
    try:
        grpc_port = hold_grpc_port(settings)
    except BaseException:
        port.close()
        if admin is not None:
            admin.close()
        raise
    supervisor = Supervisor(settings, workers, port, admin)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(supervisor.run())
    finally:
        if grpc_port is not None:
            grpc_port.close()
        shutil.rmtree(supervisor.dir, ignore_errors=True)
        loop.close()


def hold_grpc_port(settings: Settings) -> socket.socket | None:
    """The gRPC port, checked free and held (``SO_REUSEPORT``, not listening) while the
    workers run: each worker's gRPC server binds it beside this one; ``None`` when off."""
    if not settings.grpc_port:
        return None
    bind(settings.host, settings.grpc_port, reuse_port=False).close()
    return bind(settings.host, settings.grpc_port, reuse_port=True)
