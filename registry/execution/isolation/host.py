"""Starts, supervises and stops runner processes
(``python -m plugserve.server.processes.runner_process``).

A load of an isolated runner version acquires a *group*: one process per
``[runner] instances``, each started with the version's folder, loaded and
warmed before :meth:`RunnerHost.acquire` returns. The load that replaces it
acquires a new group beside it; releasing the old one (after its drain) ends
its processes, so whatever they leaked goes back to the operating system.

A process that ends unasked is started again with backoff (0.5 s doubling to
30 s; back to 0.5 s after a minute up), counted in ``restarts``. One that
cannot be started :data:`MAX_START_FAILURES` times in a row leaves its group
``failed``: requests are refused with the reason instead of a restart loop. One
whose event loop leaves a sign-of-life request unanswered for
``ProcessSettings.stall_timeout_s`` is killed, and started again as one that
ended. The loop, the backoff and the stall check are
:mod:`plugserve.registry.execution.isolation.supervision`'s, as the worker supervisor's are.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import structlog

from plugserve.registry.errors import PluginLoadError, PlugserveError, Unavailable
from plugserve.registry.execution.isolation.groups import (
    ProcessSettings,
    RunnerGroup,
    RunnerProcess,
    RunnerSpec,
    describe_exit,
)
from plugserve.registry.execution.isolation.remote import Connection, ConnectionLost
from plugserve.registry.execution.isolation.supervision import Restarts, keep_running, watch_stalls
from plugserve.registry.execution.stats import RunnerStats

log = structlog.get_logger("plugserve.registry")

RUNNER_MODULE = "plugserve.server.processes.runner_process"
MAX_START_FAILURES = 3
START_SLACK_S = 10.0
"""Beyond ``load_timeout_s``: the time a new interpreter takes to import what it needs."""
STOP_SLACK_S = 5.0
RESTART_WAIT_S = 5.0
"""How long a request waits for its runner process to be back (after a crash) before 503."""
MONITOR_BYTES = 4096
"""The shared memory of a connection that only reads figures."""
MONITOR_OPEN_S = 10.0
"""How long a new process's monitor connection may take to open (it is idle then)."""


class RunnerHost:
    """The runner processes of one server: a single process's, or a supervisor's for all
    its workers (each worker a *holder*)."""

    def __init__(self, settings: ProcessSettings | None = None) -> None:
        self.settings = settings or ProcessSettings()
        self.groups: dict[str, RunnerGroup] = {}
        self.current: dict[str, RunnerGroup] = {}
        """The group holders join, by content (``label@fingerprint``)."""
        self._starting: dict[str, asyncio.Future[None]] = {}
        self._folder: Path | None = None
        self._sockets = 0
        self._loads = 0
        self._monitors: dict[int, Connection] = {}
        """A connection to each process, by pid, to read its figures."""
        self._connecting: dict[int, asyncio.Future[Connection]] = {}
        self._spare: asyncio.Task[asyncio.subprocess.Process] | None = None
        self._closing = False
        self._started: set[asyncio.subprocess.Process] = set()
        """Every process started: a shutdown kills those its stops did not end."""

    def _socket_path(self) -> Path:
        if self._folder is None:
            under = socket_root()
            sweep_folders(under)
            prefix = f"{FOLDER_PREFIX}{os.getpid()}-"
            self._folder = Path(tempfile.mkdtemp(prefix=prefix, dir=under))  # 0700: ours alone
        self._sockets += 1
        return self._folder / f"{self._sockets}.sock"

    async def acquire(self, content: str, spec: RunnerSpec, holder: str = "") -> RunnerGroup:
        """A group of processes serving ``content``, loaded; raises :class:`PluginLoadError`.

        A holder joins the group other holders use for that content; one that holds it
        already (a reload of unchanged content) gets a new group, which the others then
        join: every worker reloading together ends up on the same new processes.
        """
        while True:
            starting = self._starting.get(content)
            if starting is not None:
                await asyncio.shield(starting)  # raises what the start raised
                continue
            group = self.current.get(content)
            if group is not None and not group.stopping and holder not in group.holders:
                group.holders.add(holder)
                return group
            break
        done = self._starting[content] = asyncio.get_running_loop().create_future()
        try:
            group = await self._start_group(content, spec)
        except BaseException as exc:
            failure = exc if isinstance(exc, Exception) else Unavailable("the load was cancelled")
            done.set_exception(failure)
            done.exception()  # retrieved: only the waiters care
            raise
        finally:
            del self._starting[content]
        done.set_result(None)
        self.current[content] = group
        group.holders.add(holder)
        return group

    async def _start_group(self, content: str, spec: RunnerSpec) -> RunnerGroup:
        devices = spec.devices
        processes = [
            RunnerProcess(i, devices[i % len(devices)] if devices else None, self._socket_path())
            for i in range(spec.instances)
        ]
        self._loads += 1
        group = RunnerGroup(f"{spec.label}#{self._loads}", content, spec, processes)
        results = await asyncio.gather(
            *(self._spawn(group, p) for p in processes), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            group.stopping = True
            await asyncio.gather(*(self._stop(p, spec.close_timeout) for p in processes))
            error = errors[0]
            if isinstance(error, PluginLoadError):
                raise error
            raise PluginLoadError(f"{spec.label}: its runner process failed: {error!r}")
        self.groups[group.key] = group
        for process in processes:
            process.watch = asyncio.create_task(self._watch(group, process))
            if self.settings.stall_timeout_s > 0:
                process.stall_watch = asyncio.create_task(self._watch_stalls(group, process))
        return group

    async def _spawn(
        self, group: RunnerGroup, process: RunnerProcess
    ) -> asyncio.subprocess.Process:
        """Start one process and wait for its answer: loaded (with its metadata) or not;
        the process, serving."""
        spec, settings = group.spec, self.settings
        env = dict(os.environ)
        if process.device is not None:  # before any CUDA library loads in the child
            env["CUDA_VISIBLE_DEVICES"] = process.device.split(":", 1)[1]
        with contextlib.suppress(FileNotFoundError):
            process.socket.unlink()
        proc = self._take_spare() if process.device is None else None
        if proc is None:
            proc = await _start(env, self._started)
        self._keep_spare()
        assert proc.stdin is not None
        assert proc.stdout is not None
        request = {
            "folder": str(spec.folder),
            "label": spec.label,
            "models_dir": str(spec.models_dir),
            "plugins_dir": None if spec.plugins_dir is None else str(spec.plugins_dir),
            "load_timeout": spec.load_timeout,
            "close_timeout": spec.close_timeout,
            "socket": str(process.socket),
            "instance": process.index,
            "parent": os.getpid(),
            "log_format": settings.log_format,
            "log_level": settings.log_level,
            "event_loop": settings.event_loop,
            "shm_bytes": settings.shm_bytes,
            "max_tensor_elements": settings.tensor_bounds.max_elements,
            "max_bytes_elements": settings.tensor_bounds.max_bytes_elements,
        }
        proc.stdin.write(orjson.dumps(request) + b"\n")  # stdin stays open: the lifeline
        try:
            await proc.stdin.drain()
            line = await asyncio.wait_for(proc.stdout.readline(), spec.load_timeout + START_SLACK_S)
        except (TimeoutError, ConnectionError, asyncio.CancelledError) as exc:
            await _kill(proc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise PluginLoadError(
                f"{spec.label}: its runner process did not load within "
                f"{spec.load_timeout + START_SLACK_S:g} s"
            ) from None
        answer = _answer(line)
        if answer is None or not answer.get("ready"):
            returncode = await _reap(proc)
            how = describe_exit(returncode)
            if answer is not None and answer.get("error"):
                raise PluginLoadError(str(answer["error"]), exit=how)
            raise PluginLoadError(
                f"{spec.label}: its runner process ended while loading ({how})", exit=how
            )
        process.proc, process.pid, process.started_at = proc, proc.pid, time.monotonic()
        process.ended.pop(proc.pid, None)  # a pid number used again: not how this one ends
        if settings.stall_timeout_s > 0:
            await self._open_monitor(group, process, proc.pid)
        group.metadata = answer.get("metadata")
        process.up.set()
        log.info("runner_process_started", plugin=spec.label, pid=proc.pid, instance=process.index)
        return proc

    def _take_spare(self) -> asyncio.subprocess.Process | None:
        """The spare process, started ahead and waiting for a spec, if it is ready."""
        task, self._spare = self._spare, None
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            if task is not None:
                task.cancel()
            return None
        proc = task.result()
        return proc if proc.returncode is None else None

    def _keep_spare(self) -> None:
        """Start the next spare: a runner process that imports what it needs and waits for
        a spec, so that a reload does not wait for an interpreter to start (about 0.7 s)."""
        if self._spare is None and not self._closing:
            self._spare = asyncio.create_task(_start(dict(os.environ), self._started))

    async def _watch(self, group: RunnerGroup, process: RunnerProcess) -> None:
        """Wait for the process to end; unasked, start it again with backoff, until its
        group stops or :data:`MAX_START_FAILURES` starts in a row failed."""
        await keep_running(
            start=functools.partial(self._spawn, group, process),
            wait_for_exit=lambda proc: proc.wait(),
            stopping=lambda: group.stopping,
            on_exit=functools.partial(self._died, group, process),
            on_start_failure=functools.partial(self._start_failed, group, process),
            start_errors=(PluginLoadError,),
            restarts=Restarts(),
            running=process.proc,
            running_since=process.started_at,
        )

    def _died(
        self,
        group: RunnerGroup,
        process: RunnerProcess,
        proc: asyncio.subprocess.Process,
        returncode: int,
        delay: float,
    ) -> None:
        # A stall check that killed it has said why already.
        how = process.ended.setdefault(proc.pid, describe_exit(returncode))
        process.up.clear()
        monitor = self._monitors.pop(proc.pid, None)
        if monitor is not None:
            monitor.close()
        process.restarts += 1
        log.error(
            "runner_process_died",
            plugin=group.spec.label,
            pid=proc.pid,
            instance=process.index,
            exit=how,
            restart_in_s=delay,
        )

    def _start_failed(
        self,
        group: RunnerGroup,
        process: RunnerProcess,
        error: BaseException,
        failures: int,
        delay: float,
    ) -> bool:
        """Whether to try again: not after :data:`MAX_START_FAILURES` in a row (the group
        is ``failed`` then)."""
        message = error.message if isinstance(error, PlugserveError) else repr(error)
        log.error(
            "runner_process_start_failed",
            plugin=group.spec.label,
            instance=process.index,
            error=message,
            failures=failures,
        )
        if failures < MAX_START_FAILURES:
            return True
        group.failed = (
            f"{group.spec.label}: its runner process failed to start "
            f"{failures} times in a row: {message}"
        )
        process.pid = process.proc = None
        process.up.set()  # wake the waiters: they read ``failed``
        return False

    async def _watch_stalls(self, group: RunnerGroup, process: RunnerProcess) -> None:
        """Kill the instance's process once its event loop has left a sign-of-life request
        (its figures) unanswered for ``stall_timeout_s``
        (:func:`~plugserve.registry.execution.isolation.supervision.watch_stalls`): a batch stuck in
        the plugin's code (a sync runner runs on that loop) would otherwise hold its
        requests forever. :meth:`_watch` then answers them with the reason and starts it
        again.

        The monitor connection is opened as the process starts, before any request
        reaches it (:meth:`_spawn`): opening one later takes a handshake that the same
        stuck loop would have to answer. An ask that fails otherwise (the connection
        cannot be opened, this process is out of files) is not counted."""
        limit = self.settings.stall_timeout_s

        def serving() -> list[tuple[asyncio.subprocess.Process, int]]:
            proc, pid = process.proc, process.pid
            if pid is None or proc is None or not process.up.is_set():
                return []  # starting, or failed: nothing to ask
            return [(proc, pid)]

        def stalled(serving: tuple[asyncio.subprocess.Process, int]) -> None:
            proc, pid = serving
            if process.pid != pid or proc.returncode is not None:
                return
            process.ended[pid] = (
                f"killed by SIGKILL: stalled, its event loop did not answer for {limit:g} s"
            )
            log.error(
                "runner_process_stalled",
                plugin=group.spec.label,
                pid=pid,
                instance=process.index,
                seconds=limit,
            )
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

        def unasked(serving: tuple[asyncio.subprocess.Process, int], exc: Exception) -> None:
            # it ended (_watch's business), or cannot be asked
            log.debug("runner_process_not_asked", pid=serving[1], error=repr(exc))

        await watch_stalls(
            targets=serving,
            ask=lambda serving: self._ask(process, serving[1]),
            stall_timeout_s=limit,
            on_stall=stalled,
            stopping=lambda: group.stopping,
            on_unasked=unasked,
        )

    async def _monitor(self, process: RunnerProcess, pid: int, within: float) -> Connection:
        """The connection that reads the figures of ``pid`` (the process serving now); one
        connection a process, however many callers ask at once."""
        monitor = self._monitors.get(pid)
        if monitor is not None and monitor.alive:
            return monitor
        connecting = self._connecting.get(pid)
        if connecting is None:
            connecting = asyncio.ensure_future(self._connect_monitor(process, pid))
            self._connecting[pid] = connecting

            def done(task: asyncio.Future[Connection]) -> None:
                self._connecting.pop(pid, None)
                if not task.cancelled():
                    task.exception()  # retrieved: the callers that waited saw it

            connecting.add_done_callback(done)
        return await asyncio.wait_for(asyncio.shield(connecting), within)

    async def _connect_monitor(self, process: RunnerProcess, pid: int) -> Connection:
        monitor = await Connection.connect(process.socket, pid, MONITOR_BYTES)
        proc = process.proc
        ended = pid in process.ended or proc is None or proc.returncode is not None
        if process.pid != pid or ended:  # it ended, or was stopped, meanwhile
            monitor.close()
            raise ConnectionLost(pid)
        self._monitors[pid] = monitor
        return monitor

    async def _open_monitor(self, group: RunnerGroup, process: RunnerProcess, pid: int) -> None:
        """The stall check's connection, opened while the new process is idle: once
        requests reach it, a stuck batch would keep the handshake from being answered."""
        try:
            await self._monitor(process, pid, MONITOR_OPEN_S)
        except (PlugserveError, ConnectionLost, TimeoutError, OSError) as exc:
            log.warning(
                "runner_monitor_unopened", plugin=group.spec.label, pid=pid, error=repr(exc)
            )

    async def _ask(self, process: RunnerProcess, pid: int) -> dict[str, Any]:
        return await (await self._monitor(process, pid, self.settings.stall_timeout_s)).figures()

    async def ready(self, key: str, index: int, within: float | None = None) -> RunnerProcess:
        """Instance ``index`` of ``key`` once it serves (after a restart, when it is back);
        :class:`Unavailable` when its group failed or was released, or ``within`` passed."""
        group = self.groups.get(key)
        if group is None or group.stopping:
            raise Unavailable(f"runner process {key} is not running")
        process = group.processes[index]
        wait = RESTART_WAIT_S if within is None else within
        if not process.up.is_set():
            try:
                await asyncio.wait_for(process.up.wait(), wait)
            except TimeoutError:
                raise Unavailable(
                    f"{group.spec.label}: its runner process is restarting", retry_after_s=1
                ) from None
        if group.failed is not None:
            raise Unavailable(group.failed)
        return process

    async def ended(self, key: str, index: int, pid: int, within: float = 2.0) -> str | None:
        """How process ``pid`` of instance ``index`` ended (waiting ``within`` s for it);
        ``None`` when it did not end meanwhile (only a connection to it closed)."""
        group = self.groups.get(key)
        if group is None:
            return "stopped"
        process = group.processes[index]
        deadline = time.monotonic() + within
        while pid not in process.ended and time.monotonic() < deadline:
            if group.stopping:
                return "stopped"
            await asyncio.sleep(0.01)
        return process.ended.get(pid)

    async def release(self, key: str, holder: str = "") -> None:
        """``holder`` is done with the group; the last one ends its processes (SIGTERM,
        then SIGKILL past ``close_timeout_s``)."""
        group = self.groups.get(key)
        if group is None:
            return
        group.holders.discard(holder)
        if group.holders:
            return
        group.stopping = True
        del self.groups[key]
        if self.current.get(group.content) is group:
            del self.current[group.content]
        await asyncio.gather(*(self._stop(p, group.spec.close_timeout) for p in group.processes))
        log.info("runner_processes_stopped", plugin=group.spec.label, key=key)

    async def _stop(self, process: RunnerProcess, within: float) -> None:
        for task in (process.watch, process.stall_watch):
            if task is not None:
                task.cancel()
        monitor = self._monitors.pop(process.pid, None) if process.pid is not None else None
        if monitor is not None:
            monitor.close()
        proc = process.proc
        process.up.clear()
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), within + STOP_SLACK_S)
            except TimeoutError:
                log.warning("runner_process_kill", pid=proc.pid, timeout_s=within + STOP_SLACK_S)
                await _kill(proc)
            except asyncio.CancelledError:  # whoever waited gave up (a shutdown's budget)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                raise
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()
        late = self._monitors.pop(process.pid, None) if process.pid is not None else None
        if late is not None:  # opened (by a figures call) while it was stopping
            late.close()
        with contextlib.suppress(FileNotFoundError):
            process.socket.unlink()

    async def figures(self, key: str, within: float = 2.0) -> dict[str, Any]:
        """The group's processes' own figures, summed: ``queued``, ``executions``,
        ``batched_rows``, ``circuit`` (the worst of theirs), ``stats`` (a
        :class:`RunnerStats` of their executions and batch sizes), ``cannot_batch``
        (batches cut apart, and a reason), ``batch_fallbacks`` (failed batches run again one
        by one), ``batching_check`` and ``sequences`` (each figure summed over the
        processes, ``max_sequences`` included: each process keeps that many). A process that does
        not answer within ``within`` s (restarting, busy) is left out."""
        group = self.groups.get(key)
        total: dict[str, Any] = {"queued": 0, "executions": 0, "batched_rows": 0}
        if group is None:
            return total
        circuits = []
        answered = 0
        fallback_why = None
        executions = RunnerStats()
        total["stats"] = executions
        for process in group.processes:
            pid = process.pid
            if pid is None or not process.up.is_set():
                continue
            try:
                monitor = await self._monitor(process, pid, within)
                figures = await asyncio.wait_for(monitor.figures(), within)
            except (PlugserveError, ConnectionLost, TimeoutError, OSError):
                continue
            answered += 1
            total["queued"] += figures["queued"]
            total["executions"] += figures["executions"]
            total["batched_rows"] += figures["rows"]
            if figures.get("stats") is not None:
                executions.add_executions(figures["stats"])
            if figures.get("circuit") is not None:
                circuits.append(figures["circuit"])
            if figures.get("sequences"):  # each process keeps its own: summed
                kept = total.setdefault("sequences", {})
                for name, value in figures["sequences"].items():
                    kept[name] = kept.get(name, 0) + value
            if figures.get("apart"):
                said = total.setdefault("cannot_batch", {"count": 0, "why": None})
                said["count"] += figures["apart"]
                said["why"] = figures.get("apart_why")
            if figures.get("fallback_why"):
                fallback_why = figures["fallback_why"]
            if figures.get("batching_check"):  # each process checks at its load: the same
                total["batching_check"] = figures["batching_check"]
        if not answered:  # busy or restarting: unknown, not zero
            return {}
        if executions.batch_fallbacks:
            total["batch_fallbacks"] = {
                "count": executions.batch_fallbacks,
                "requests": executions.fallback_requests,
                "why": fallback_why,
            }
        if circuits:
            total["circuit"] = next(
                (c for c in ("open", "half-open") if c in circuits), circuits[0]
            )
        return total

    async def release_holder(self, holder: str) -> None:
        """Release every group ``holder`` holds (a worker that ended)."""
        held = [key for key, group in self.groups.items() if holder in group.holders]
        await asyncio.gather(*(self.release(key, holder) for key in held))

    async def close(self) -> None:
        """End every process (shutdown): each group as if its last holder released it, then
        SIGKILL to any still running (one a cancelled stop left, the spare)."""
        self._closing = True
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.cancel()
            if spare.done() and not spare.cancelled() and spare.exception() is None:
                await _kill(spare.result())
        for key, group in list(self.groups.items()):
            group.holders.clear()
            await self.release(key)
        left = [proc for proc in self._started if proc.returncode is None]
        await asyncio.gather(*(_kill(proc) for proc in left))
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


async def _start(
    env: dict[str, str], started: set[asyncio.subprocess.Process]
) -> asyncio.subprocess.Process:
    """A runner process (added to ``started``, the ended ones dropped from it); it imports
    what it needs, then waits for its spec on stdin."""
    started.difference_update([p for p in started if p.returncode is not None])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", RUNNER_MODULE,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    started.add(proc)
    return proc


FOLDER_PREFIX = "plugserve-runners-"


UNIX_PATH_MAX = 107
"""The longest path a Unix socket may bind (108 bytes with its terminating zero, Linux)."""


def socket_root() -> Path:
    """Where runner sockets go: the temporary dir, or ``/tmp`` when that one's path is too
    long for a socket inside it (a deep ``TMPDIR``: ``bind`` fails with "path too long")."""
    root = Path(tempfile.gettempdir())
    longest = f"{root}/{FOLDER_PREFIX}{os.getpid()}-xxxxxxxx/{10**6}.sock"
    return root if len(os.fsencode(longest)) <= UNIX_PATH_MAX else Path("/tmp")


def sweep_folders(under: Path | None = None) -> list[Path]:
    """Remove the runner-socket folders whose server is gone (killed: nothing of it could
    clean up), named ``plugserve-runners-<pid>-*``; returns those removed."""
    removed = []
    for folder in Path(under or tempfile.gettempdir()).glob(FOLDER_PREFIX + "*-*"):
        owner = folder.name[len(FOLDER_PREFIX) :].split("-", 1)[0]
        try:
            if not owner.isdigit() or folder.stat().st_uid != os.getuid():
                continue
            os.kill(int(owner), 0)  # raises when no such process
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        except (OSError, ValueError):
            continue
    return removed


def _answer(line: bytes) -> dict[str, Any] | None:
    try:
        answer = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return answer if isinstance(answer, dict) else None


async def _reap(proc: asyncio.subprocess.Process, within: float = 5.0) -> int | None:
    try:
        return await asyncio.wait_for(proc.wait(), within)
    except TimeoutError:
        await _kill(proc)
        return proc.returncode


async def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()
