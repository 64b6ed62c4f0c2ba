"""One version's instance replaced (the new one loaded beside the old, swapped in, the old
one drained and released) or taken down (the version unloaded or evicted); under the
memory budget, a version that loads on demand is admitted before its load and measured
after it."""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from plugserve.registry.errors import PluginLoadError, PlugserveError, Unavailable
from plugserve.registry.execution.components.base import LoadedPlugin
from plugserve.registry.lifecycle import gpu
from plugserve.registry.lifecycle.budget import (
    Admission,
    Budget,
    Growth,
    release_memory,
    resident,
)
from plugserve.registry.lifecycle.ledger import HOST, Cost
from plugserve.registry.lifecycle.lifecycle_events import LifecycleEvent, Outcome
from plugserve.registry.lifecycle.loader import Loader
from plugserve.registry.routing.records import State, VersionRecord

log = structlog.get_logger("plugserve.registry")


class _Under(NamedTuple):
    """A load under a memory budget: the budget, the load's admission, and the bytes its
    model files take (the least it can cost)."""

    budget: Budget
    admission: Admission
    least: int


class Swapper:
    """Replaces or takes down the instance of one version, its caller holding the
    version's lock.

    The new instance loads beside the old one and is swapped in with one route-table
    rebuild (``rebuild``); the old one drains, at most :attr:`drain_timeout` seconds,
    then is released. A failed load is recorded on the version, and whatever was serving
    keeps serving. Every outcome is told to :attr:`listeners`.
    """

    def __init__(
        self,
        loader: Loader,
        budget: Budget | None,
        rebuild: Callable[[], None],
        drain_timeout: float,
    ) -> None:
        self.loader = loader
        self.budget = budget
        """The memory budget the versions that load on demand load under, if any."""
        self.rebuild = rebuild
        self.drain_timeout = drain_timeout
        self.listeners: list[Callable[[LifecycleEvent], None]] = []
        self.loads: collections.Counter[str] = collections.Counter()
        """Versions loaded, by reason: ``demand`` (a request), ``eager`` (found on disk),
        ``reload`` (changed, or asked) and ``explicit`` (an admin or repository load)."""
        self.released = 0
        """Bytes this process gave back as it released versions (an in-worker load's
        measure adds what was released beside it)."""
        self.growth = Growth(lambda: self.released)
        """This process's growth, shared out among the in-process loads under way."""

    async def load(
        self,
        record: VersionRecord,
        folder: Path,
        overrides: Mapping[str, Any] | None = None,
        reason: str = "eager",
    ) -> Outcome:
        """Load ``folder`` into ``record`` and swap it in. A version that loads on demand,
        under a memory budget, however the load was asked for (a request, an admin or
        repository load, a change to its files): its manifest and model are checked first
        (a load that will fail evicts nothing), the budget makes room (it evicts the least
        recently used idle versions), and is told what the load measured before the
        version serves (one over the whole budget alone is refused). Such loads run side
        by side, each holding its estimate; every admission is measured or cancelled."""
        started = time.perf_counter()
        budget = self.budget if record.on_demand else None
        if budget is None:
            return await self._swap_in(record, folder, overrides, reason, started, None)
        try:
            least = await asyncio.to_thread(self.loader.preflight, folder, overrides)
        except Exception as exc:  # the load would fail: nothing is evicted for it
            return self.failed(record, exc, started)
        try:
            # A budget that cannot answer (its supervisor gone) raises Unavailable.
            admission = await budget.admit(record.key, record.isolated, least)
        except PluginLoadError as exc:  # over the whole budget alone
            return self.failed(record, exc, started)
        under = _Under(budget, admission, least)
        return await self._swap_in(record, folder, overrides, reason, started, under)

    async def _swap_in(
        self,
        record: VersionRecord,
        folder: Path,
        overrides: Mapping[str, Any] | None,
        reason: str,
        started: float,
        under: _Under | None,
    ) -> Outcome:
        bound = log.bind(plugin=record.label)
        if record.current is None:
            record.state = "loading"
        settled = under is None  # under a budget: once measured (a refusal is cancelled)
        try:
            devices = None
            if under is not None and under.budget.gpus:
                devices = await asyncio.to_thread(gpu.read)
            token = self.growth.begin() if under is not None and not record.isolated else None
            try:
                new = await self.loader.load(
                    folder, content=record.fingerprint, overrides=overrides
                )
            except Exception as exc:
                return self.failed(record, exc, started)
            finally:
                grown, alone = self.growth.end(token) if token is not None else (0, True)
            if under is not None:
                cost, totals = await _measure(new, grown, under.least, devices)
                try:
                    await under.budget.measured(under.admission, cost, totals, sure=alone)
                    settled = True
                except PluginLoadError as exc:  # over the whole budget alone: not served
                    # Its estimate stays held until the instance is let go (the finally).
                    retiring = [new]
                    del new
                    await self.retire(record, retiring)
                    return self.failed(record, exc, started)
                except Unavailable as exc:  # the supervisor is going away: serve, uncounted
                    bound.warning("plugin_measure_lost", error=exc.message)
                record.memory_bytes = cost[HOST]
                bound.info("plugin_measured", bytes=cost[HOST],
                           **({"gpu_bytes": {d: n for d, n in cost.items() if d != HOST}}
                              if under.budget.gpus else {}))  # fmt: skip
        finally:
            if not settled and under is not None:
                await under.budget.cancel(under.admission)
        old = record.current
        if old is not None:  # a reload is as recently used as what it replaces
            new.last_use = old.last_use
        if under is not None:  # loaded to be used: not the next to go
            new.last_use = max(new.last_use, time.monotonic())
        record.current, record.state, record.last_error = new, "ready", None
        self.rebuild()
        outcome: Outcome = "reloaded" if old is not None else "loaded"
        self.loads[reason] += 1
        bound.info("plugin_ready", outcome=outcome, seconds=round(time.perf_counter() - started, 4))
        self.emit(record, outcome, started)
        if old is not None:
            retiring = [old]
            del old
            await self.retire(record, retiring)
        return outcome

    async def take_down(self, record: VersionRecord, state: State) -> int | None:
        """Stop routing to ``record``'s instance, if it has one, drain and release it, and
        leave the version in ``state``; the budget hears it is gone. Returns the bytes the
        version was measured at (under a budget), if it was."""
        retiring = [record.current] if record.current is not None else []
        record.current, record.state = None, "draining"
        self.rebuild()
        if retiring:
            await self.retire(record, retiring)
        freed, record.memory_bytes = record.memory_bytes, None
        record.state = state
        if self.budget is not None:
            await self.budget.gone(record.key)
        return freed

    def failed(self, record: VersionRecord, exc: Exception, started: float) -> Outcome:
        """Record a failed load: what was serving keeps serving; the error is kept and logged."""
        if isinstance(exc, PlugserveError):
            message, exc_info = exc.message, None
        else:  # not an error of ours: a bug somewhere, keep its traceback in the log
            message, exc_info = f"{record.label}: {type(exc).__name__}: {exc}", exc
        record.last_error = message
        if record.current is None:
            record.state = "failed"
        log.error(
            "plugin_load_failed",
            plugin=record.label,
            error=message,
            keeps_serving=record.current is not None,
            exc_info=exc_info,
        )
        self.rebuild()
        self.emit(record, "failed", started, message)
        return "failed"

    async def retire(self, record: VersionRecord, retiring: list[LoadedPlugin]) -> None:
        """Drain and release the instance in ``retiring``, a list of one that this empties:
        the last reference is this call's, so the instance's memory comes back here, and
        how much is added to :attr:`released`."""
        old = retiring.pop()
        record.draining.append(old)
        try:
            if not await old.wait_idle(self.drain_timeout):
                log.warning(
                    "drain_timeout",
                    plugin=record.label,
                    in_flight=old.in_flight,
                    timeout_s=self.drain_timeout,
                )
            await self.loader.release(old)
        finally:
            record.draining.remove(old)
        before = resident()
        del old
        release_memory()
        self.released += max(before - resident(), 0)

    def emit(
        self, record: VersionRecord, outcome: Outcome, started: float, error: str | None = None
    ) -> None:
        """Tell the listeners what became of ``record`` (``started``: ``perf_counter()``)."""
        event = LifecycleEvent(record, outcome, time.perf_counter() - started, error)
        for listener in self.listeners:
            listener(event)


async def _measure(
    loaded: LoadedPlugin, grown: int, least: int, devices: gpu.Devices | None
) -> tuple[Cost, dict[str, int]]:
    """What ``loaded`` costs, and each GPU's size: for an isolated runner, its processes'
    memory (all of it comes back at their end); in the worker, its share of the
    worker's growth while it loaded (``grown``); ``least`` (its model files' size) at
    least. On the GPUs (``devices``: the reading before the load), what its processes
    use, or, where the driver does not know our pids (a container), the growth of the
    devices."""
    remote = loaded.remote
    if remote is not None:
        pids = remote.group.pids
        cost = {HOST: max(sum(resident(pid) for pid in pids), least)}
    else:
        pids = [os.getpid()]
        cost = {HOST: max(grown, least)}
    if devices is None:
        return cost, {}
    now = await asyncio.to_thread(gpu.read)
    if now is None:
        return cost, {}
    used = now.of(pids)
    if remote is None:  # this process held GPU memory before: its growth
        earlier = devices.of(pids)
        used = {d: n - earlier.get(d, 0) for d, n in used.items()}
    if not any(used.values()) and not now.by_pid.keys() & set(pids):
        placed = set(remote.group.devices) if remote is not None else set(now.used)
        used = {d: now.used[d] - devices.used.get(d, 0) for d in placed if d in now.used}
    cost.update({d: n for d, n in used.items() if n > 0})
    return cost, now.total
