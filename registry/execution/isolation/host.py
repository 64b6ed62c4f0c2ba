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
:mod:`plugserve.registry.execution.isolation.supervision`'s, as the worker supervisor's are;
the connections that ask a process for its figures (the stall check's sign of life too)
are :mod:`plugserve.registry.execution.isolation.monitors`', and starting a process (its
socket, a spare started ahead, the handshake that hands it its spec)
:mod:`plugserve.registry.execution.isolation.launcher`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import time
from typing import Any

import structlog

from plugserve.registry.errors import PluginLoadError, PlugserveError, Unavailable
from plugserve.registry.execution.isolation.groups import (
    ProcessSettings,
    RunnerGroup,
    RunnerProcess,
    RunnerSpec,
    describe_exit,
)
from plugserve.registry.execution.isolation.launcher import (
    RUNNER_MODULE,
    ProcessLauncher,
    kill,
    sweep_folders,
)
from plugserve.registry.execution.isolation.monitors import ProcessMonitors
from plugserve.registry.execution.isolation.supervision import Restarts, keep_running

__all__ = ["MAX_START_FAILURES", "RUNNER_MODULE", "RunnerHost", "sweep_folders"]

log = structlog.get_logger("plugserve.registry")

MAX_START_FAILURES = 3
STOP_SLACK_S = 5.0
RESTART_WAIT_S = 5.0
"""How long a request waits for its runner process to be back (after a crash) before 503."""


class RunnerHost:
    """The runner processes of one server: a single process's, or a supervisor's for all
    its workers (each worker a *holder*)."""

    def __init__(self, settings: ProcessSettings | None = None) -> None:
        self.settings = settings or ProcessSettings()
        self.groups: dict[str, RunnerGroup] = {}
        self.current: dict[str, RunnerGroup] = {}
        """The group holders join, by content (``label@fingerprint``)."""
        self._starting: dict[str, asyncio.Future[None]] = {}
        self._loads = 0
        self._monitors = ProcessMonitors(self.settings.stall_timeout_s)
        """The connections that read each process's figures (and the stall check's)."""
        self._launcher = ProcessLauncher(self.settings)
        """Starts the processes: their sockets, a spare, the handshake of each."""

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
            RunnerProcess(
                i, devices[i % len(devices)] if devices else None, self._launcher.socket_path()
            )
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
                process.stall_watch = asyncio.create_task(
                    self._monitors.watch_stalls(group, process)
                )
        return group

    async def _spawn(
        self, group: RunnerGroup, process: RunnerProcess
    ) -> asyncio.subprocess.Process:
        """Start one process and wait for its answer: loaded (with its metadata) or not;
        the process, serving."""
        spec, settings = group.spec, self.settings
        proc, answer = await self._launcher.launch(spec, process)
        process.proc, process.pid, process.started_at = proc, proc.pid, time.monotonic()
        process.ended.pop(proc.pid, None)  # a pid number used again: not how this one ends
        if settings.stall_timeout_s > 0:
            await self._monitors.open(group, process, proc.pid)
        group.metadata = answer.get("metadata")
        process.up.set()
        log.info("runner_process_started", plugin=spec.label, pid=proc.pid, instance=process.index)
        return proc

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
        self._monitors.drop(proc.pid)
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
        self._monitors.drop(process.pid)
        proc = process.proc
        process.up.clear()
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), within + STOP_SLACK_S)
            except TimeoutError:
                log.warning("runner_process_kill", pid=proc.pid, timeout_s=within + STOP_SLACK_S)
                await kill(proc)
            except asyncio.CancelledError:  # whoever waited gave up (a shutdown's budget)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                raise
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()
        self._monitors.drop(process.pid)  # one opened (by a figures call) while it stopped
        with contextlib.suppress(FileNotFoundError):
            process.socket.unlink()

    async def figures(self, key: str, within: float = 2.0) -> dict[str, Any]:
        """The figures of group ``key``'s processes, summed
        (:meth:`~plugserve.registry.execution.isolation.monitors.ProcessMonitors.figures`);
        a process that does not answer within ``within`` s (restarting, busy) is left out."""
        return await self._monitors.figures(self.groups.get(key), within)

    async def release_holder(self, holder: str) -> None:
        """Release every group ``holder`` holds (a worker that ended)."""
        held = [key for key, group in self.groups.items() if holder in group.holders]
        await asyncio.gather(*(self.release(key, holder) for key in held))

    async def close(self) -> None:
        """End every process (shutdown): each group as if its last holder released it, then
        SIGKILL to any still running (one a cancelled stop left, the spare)."""
        await self._launcher.stop_spare()
        for key, group in list(self.groups.items()):
            group.holders.clear()
            await self.release(key)
        await self._launcher.close()
