"""The connections that read runner processes' figures, one a process: the stall check
that asks each serving process for a sign of life through its own, and a group's figures
summed over its processes.

A monitor connection is opened as its process starts, before any request reaches it:
opening one later takes a handshake that a stuck event loop would have to answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

from plugserve.registry.errors import PlugserveError
from plugserve.registry.execution.isolation.groups import RunnerGroup, RunnerProcess
from plugserve.registry.execution.isolation.remote import Connection, ConnectionLost
from plugserve.registry.execution.isolation.supervision import watch_stalls
from plugserve.registry.execution.stats import RunnerStats

log = structlog.get_logger("plugserve.registry")

MONITOR_BYTES = 4096
"""The shared memory of a connection that only reads figures."""
MONITOR_OPEN_S = 10.0
"""How long a new process's monitor connection may take to open (it is idle then)."""


class ProcessMonitors:
    """The monitor connections of one host's runner processes, by pid (one a process,
    however many callers ask at once), what the stall check asks through them, and the
    figures they read."""

    def __init__(self, stall_timeout_s: float) -> None:
        self.stall_timeout_s = stall_timeout_s
        self._monitors: dict[int, Connection] = {}
        """A connection to each process, by pid, to read its figures."""
        self._connecting: dict[int, asyncio.Future[Connection]] = {}

    def drop(self, pid: int | None) -> None:
        """Close the connection to ``pid``, if one is open (it ended, or is stopping)."""
        monitor = self._monitors.pop(pid, None) if pid is not None else None
        if monitor is not None:
            monitor.close()

    async def connection(self, process: RunnerProcess, pid: int, within: float) -> Connection:
        """The connection that reads the figures of ``pid`` (the process serving now); one
        connection a process, however many callers ask at once."""
        monitor = self._monitors.get(pid)
        if monitor is not None and monitor.alive:
            return monitor
        connecting = self._connecting.get(pid)
        if connecting is None:
            connecting = asyncio.ensure_future(self._connect(process, pid))
            self._connecting[pid] = connecting

            def done(task: asyncio.Future[Connection]) -> None:
                self._connecting.pop(pid, None)
                if not task.cancelled():
                    task.exception()  # retrieved: the callers that waited saw it

            connecting.add_done_callback(done)
        return await asyncio.wait_for(asyncio.shield(connecting), within)

    async def _connect(self, process: RunnerProcess, pid: int) -> Connection:
        monitor = await Connection.connect(process.socket, pid, MONITOR_BYTES)
        proc = process.proc
        ended = pid in process.ended or proc is None or proc.returncode is not None
        if process.pid != pid or ended:  # it ended, or was stopped, meanwhile
            monitor.close()
            raise ConnectionLost(pid)
        self._monitors[pid] = monitor
        return monitor

    async def open(self, group: RunnerGroup, process: RunnerProcess, pid: int) -> None:
        """The stall check's connection, opened while the new process is idle: once
        requests reach it, a stuck batch would keep the handshake from being answered."""
        try:
            await self.connection(process, pid, MONITOR_OPEN_S)
        except (PlugserveError, ConnectionLost, TimeoutError, OSError) as exc:
            log.warning(
                "runner_monitor_unopened", plugin=group.spec.label, pid=pid, error=repr(exc)
            )

    async def _ask(self, process: RunnerProcess, pid: int) -> dict[str, Any]:
        monitor = await self.connection(process, pid, self.stall_timeout_s)
        return await monitor.figures()

    async def watch_stalls(self, group: RunnerGroup, process: RunnerProcess) -> None:
        """Kill the instance's process once its event loop has left a sign-of-life request
        (its figures) unanswered for ``stall_timeout_s``
        (:func:`~plugserve.registry.execution.isolation.supervision.watch_stalls`): a batch stuck in
        the plugin's code (a sync runner runs on that loop) would otherwise hold its
        requests forever. The host's restart loop then answers them with the reason and
        starts it again.

        The monitor connection is opened as the process starts (:meth:`open`), before any
        request reaches it: opening one later takes a handshake that the same stuck loop
        would have to answer. An ask that fails otherwise (the connection cannot be
        opened, this process is out of files) is not counted."""
        limit = self.stall_timeout_s

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
            # it ended (the restart loop's business), or cannot be asked
            log.debug("runner_process_not_asked", pid=serving[1], error=repr(exc))

        await watch_stalls(
            targets=serving,
            ask=lambda serving: self._ask(process, serving[1]),
            stall_timeout_s=limit,
            on_stall=stalled,
            stopping=lambda: group.stopping,
            on_unasked=unasked,
        )

    async def figures(self, group: RunnerGroup | None, within: float) -> dict[str, Any]:
        """The own figures of ``group``'s processes, summed (no group: zeros): ``queued``,
        ``executions``, ``batched_rows``, ``circuit`` (the worst of theirs), ``stats`` (a
        :class:`RunnerStats` of their executions and batch sizes), ``cannot_batch``
        (batches cut apart, and a reason), ``batch_fallbacks`` (failed batches run again one
        by one), ``batching_check`` and ``sequences`` (each figure summed over the
        processes, ``max_sequences`` included: each process keeps that many). A process
        that does not answer within ``within`` s (restarting, busy) is left out; none
        answering: ``{}``, unknown rather than zero."""
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
                monitor = await self.connection(process, pid, within)
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
