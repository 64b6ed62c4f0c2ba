"""The versions that load on their first request (``[runner] load = "on_demand"``): the
loads under way, which every request needing one waits for, what the memory budget
those versions load under sees of them (which are loaded, busy, evictable), and their
evictions, back to ``available``."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path

import structlog

from plugserve.registry.errors import Unavailable
from plugserve.registry.lifecycle.budget import Held, resident
from plugserve.registry.lifecycle.lifecycle_events import Key, Outcome
from plugserve.registry.lifecycle.swapper import Swapper
from plugserve.registry.routing.records import VersionRecord

log = structlog.get_logger("plugserve.registry")


class OnDemand:
    """The on-demand loads of the versions in ``records`` (``load`` loads one folder on
    demand), their memory budget's watch, and their evictions (``swapper`` takes their
    instances down)."""

    def __init__(
        self,
        records: Mapping[Key, VersionRecord],
        load: Callable[[Path], Awaitable[Outcome]],
        swapper: Swapper,
    ) -> None:
        self.records = records
        self._load = load
        self.swapper = swapper
        self.budget = swapper.budget
        """With a budget: what each version loaded on demand costs, and which go first (a
        worker among several is given its supervisor's, one for the whole tree)."""
        self._watching: asyncio.Task[None] | None = None
        """The budget's watch over the memory of what it counts (:meth:`Budget.watch`)."""
        self.awaited: collections.Counter[Key] = collections.Counter()
        """Requests waiting for each version's on-demand load: it is busy for the budget
        until they have resumed and entered it (a load beside must not evict it first)."""
        self._demands: dict[Key, asyncio.Task[Outcome]] = {}
        """The on-demand loads under way: every request that needs one waits for it."""
        self.evictions: collections.Counter[str] = collections.Counter()
        """Versions evicted under the budget, by reason: ``room`` (for a load) or
        ``overshoot`` (a load measured more than its estimate)."""

    def watch(self) -> None:
        """Start the budget's watch, if there is a budget and it is not watching yet."""
        if self.budget is not None and self._watching is None:
            self._watching = asyncio.create_task(self.budget.watch())

    def stop_watching(self) -> None:
        """End the budget's watch (nothing left to evict for)."""
        if self._watching is not None:
            self._watching.cancel()
            self._watching = None

    def busy(self, record: VersionRecord) -> bool:
        """A request uses, awaits or waits for the load of the version, an older instance of
        it still drains, or a change to it is under way (its lock held: a budget waits for
        no version's lock, so that it never waits on a load that waits for the budget)."""
        current = record.current
        return current is not None and bool(
            current.in_flight or current.queued or record.draining
            or self.awaited.get(record.key) or record.lock.locked()
        )  # fmt: skip

    def budgeted(self) -> list[Held]:
        """The loaded versions that load on demand, which a budget counts: their last use
        (``time.monotonic()``), whether they are busy (:meth:`busy`), whether a budget may
        evict them (not pinned), and an isolated runner's processes' resident memory now,
        and whether it has served a request (its first use's memory resident)."""
        rows = []
        for record in self.records.values():
            current = record.current
            if current is None or not record.on_demand:
                continue
            runner = current.manifest.runner
            remote = current.remote
            stats = current.stats
            served = stats is None or bool(
                stats.success.count or stats.fail.count or stats.execution_count
            )
            rows.append(Held(
                record.key, current.last_use, self.busy(record),
                not (runner is not None and runner.pinned), record.isolated,
                None if remote is None else sum(resident(pid) for pid in remote.group.pids),
                served,
            ))  # fmt: skip
        return rows

    def evictable(self) -> list[tuple[float, Key, bool]]:
        """The loaded versions a budget may evict (they load on demand, are not pinned):
        their last use, key, and whether they are busy (:meth:`budgeted`)."""
        return [(h.last_use, h.key, h.busy) for h in self.budgeted() if h.evictable]

    async def evict(self, key: Key, reason: str, only_idle: bool = False) -> Outcome:
        """Unload a version that loads on demand back to ``available``: its next request
        loads it again. ``only_idle``: not if a request uses or awaits it by the time the
        version is free to change (``unchanged``)."""
        record = self.records.get(key)
        if record is None:
            return "unchanged"
        if only_idle and self.busy(record):
            return "unchanged"
        started = time.perf_counter()
        async with record.lock:
            if record.current is None:
                return "unchanged"
            freed = await self.swapper.take_down(record, "available")
            self.evictions[reason] += 1
            self.swapper.rebuild()
        log.info("plugin_evicted", plugin=record.label, reason=reason, bytes=freed,
                 seconds=round(time.perf_counter() - started, 4))  # fmt: skip
        self.swapper.emit(record, "evicted", started)
        return "evicted"

    def prefetch(self, keys: Iterable[Key]) -> list[asyncio.Task[Outcome]]:
        """Begin loading ``keys`` (versions that load on their first request), once each."""
        tasks = []
        for key in keys:
            task = self._demands.get(key)
            if task is None:
                task = self._demands[key] = asyncio.create_task(self._demanded(key))
                task.add_done_callback(_demand_ended)
            tasks.append(task)
        return tasks

    async def demand(self, keys: Iterable[Key], within: float) -> None:
        """Load the versions ``keys`` that load on their first request, once each: every
        request needing one waits for the same load, at most ``within`` seconds
        (:class:`Unavailable`, to be retried, past it; the load goes on)."""
        keys = tuple(keys)
        tasks = self.prefetch(keys)
        if not tasks:
            return
        self.awaited.update(keys)
        try:
            done, _ = await asyncio.wait([asyncio.shield(t) for t in tasks], timeout=within)
        finally:
            self.awaited.subtract(keys)
            for key in keys:
                if self.awaited[key] <= 0:
                    del self.awaited[key]
        for future in done:  # a load that could not begin (its budget not answering)
            if not future.cancelled() and (error := future.exception()) is not None:
                raise error
        if len(done) < len(tasks):
            names = ", ".join(f"{k[0]}/{k[1]}@{k[2]}" for k in keys)
            raise Unavailable(
                f"{names} is loading on its first request (over {within:g} s so far): "
                "retry shortly", retry_after_s=1,
            )  # fmt: skip

    async def _demanded(self, key: Key) -> Outcome:
        record = self.records.get(key)
        try:
            if record is not None and record.state in ("loading", "draining"):
                async with record.lock:  # a load or an eviction under way: after it
                    pass
            if record is None or record.state != "available":
                return "unchanged"  # loaded (or gone) meanwhile
            started = time.perf_counter()
            outcome = await self._load(record.folder)
            log.info("plugin_demanded", plugin=record.label, outcome=outcome,
                     seconds=round(time.perf_counter() - started, 4))  # fmt: skip
            return outcome
        finally:
            self._demands.pop(key, None)


def _demand_ended(task: asyncio.Task[Outcome]) -> None:
    """An on-demand load that raised (its budget not answering) is logged, once, whether
    or not a request waited for it (a load's own failure is an outcome, not an error)."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.warning("plugin_demand_failed", error=str(error))
