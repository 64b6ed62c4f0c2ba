"""The registry: every plugin version's record, its lifecycle, and the route table built from them.

Lifecycle of a version (one lock each, so the watcher, admin calls and startup
cannot race): load the new instance beside the old one, swap it in with one
route-table rebuild, let the old instance drain, then release it. A failed load
leaves whatever was serving untouched. Whether a folder needs loading at all is
decided by its content fingerprint, never by the event that pointed at it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import structlog

from plugserve.registry.errors import (
    NotFound,
    PluginLoadError,
    PlugserveError,
    RoutesFileError,
    Unavailable,
)
from plugserve.registry.execution.chain import Chain
from plugserve.registry.execution.components.base import LoadedPlugin
from plugserve.registry.execution.components.streaming import StreamingRunner
from plugserve.registry.lifecycle import gpu
from plugserve.registry.lifecycle.budget import (
    HOST,
    Admission,
    Budget,
    Cost,
    Growth,
    Held,
    LocalBudget,
    release_memory,
    resident,
)
from plugserve.registry.lifecycle.loader import Loader
from plugserve.registry.manifest import load_manifest
from plugserve.registry.plugins.fingerprint import Fingerprinter
from plugserve.registry.plugins.hooks import PluginHooks
from plugserve.registry.ratelimit import SharedTokenBucket, TokenBucket, shared_bucket_path
from plugserve.registry.refs import PLUGIN_TYPES, PluginType, is_ignored_name
from plugserve.registry.routing.records import VersionRecord
from plugserve.registry.routing.routes import (
    ROUTES_FILE,
    RouteSpec,
    RouteTable,
    build_route_table,
    load_routes_file,
)
from plugserve.registry.versions import Version

log = structlog.get_logger("plugserve.registry")

Key = tuple[str, str, str]
Outcome = Literal[
    "loaded", "reloaded", "unchanged", "failed", "unloaded", "held", "available", "evicted"
]
CLOSE_SLACK_S = 0.5
"""How much longer than its own bound ``close()`` waits for the plugin closes it started."""


@dataclass(frozen=True)
class LifecycleEvent:
    """What listeners (metrics) hear after every load, reload or unload."""

    record: VersionRecord
    outcome: Outcome
    seconds: float
    error: str | None = None


@dataclass
class SyncReport:
    """What a rescan did: the answer of ``POST /admin/reload``."""

    loaded: list[str] = field(default_factory=list)
    reloaded: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    failed: list[dict[str, str]] = field(default_factory=list)
    available: list[str] = field(default_factory=list)
    """Versions that load on their first request (``load = "on_demand"``), not loaded."""
    unchanged: int = 0
    routes_file: str = "unchanged"

    def add(self, record: VersionRecord, outcome: Outcome) -> None:
        if outcome == "failed":
            self.failed.append({"plugin": record.label, "error": record.last_error or ""})
        elif outcome in ("loaded", "reloaded", "unloaded", "available"):
            getattr(self, outcome).append(record.label)
        else:
            self.unchanged += 1

    def as_json(self) -> dict[str, Any]:
        return {
            "loaded": self.loaded,
            "reloaded": self.reloaded,
            "unloaded": self.unloaded,
            "failed": self.failed,
            "available": self.available,
            "unchanged": self.unchanged,
            "routes_file": self.routes_file,
        }


def _demand_ended(task: asyncio.Task[Outcome]) -> None:
    """An on-demand load that raised (its budget not answering) is logged, once, whether
    or not a request waited for it (a load's own failure is an outcome, not an error)."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.warning("plugin_demand_failed", error=str(error))


class _Under(NamedTuple):
    """A load under a memory budget: the budget, the load's admission, and the bytes its
    model files take (the least it can cost)."""

    budget: Budget
    admission: Admission
    least: int


def _busy(record: VersionRecord, awaited: Mapping[Key, int]) -> bool:
    """A request uses, awaits or waits for the load of the version, an older instance of
    it still drains, or a change to it is under way (its lock held: a budget waits for no
    version's lock, so that it never waits on a load that waits for the budget)."""
    current = record.current
    return current is not None and bool(
        current.in_flight or current.queued or record.draining or awaited.get(record.key)
        or record.lock.locked()
    )  # fmt: skip


class Registry:
    """Discovers, loads, serves and releases plugin versions."""

    def __init__(
        self,
        plugins_dir: Path,
        models_dir: Path,
        host: PluginHooks | None = None,
        drain_timeout: float = 30.0,
        load_timeout: float = 120.0,
        close_timeout: float = 10.0,
        default_load: str = "eager",
        memory_budget: int = 0,
        gpu_memory_budget: int | float = 0,
    ) -> None:
        self.plugins_dir = plugins_dir
        self.default_load = default_load
        """When a runner version whose manifest does not say loads (``[runner] load``)."""
        self.load_timeout = load_timeout
        self.budget: Budget | None = None
        if memory_budget or gpu_memory_budget:
            self.budget = LocalBudget(memory_budget, gpu_memory_budget, self, load_timeout)
        """With a budget: what each version loaded on demand costs, and which go first (a
        worker among several is given its supervisor's, one for the whole tree)."""
        self._watching: asyncio.Task[None] | None = None
        """The budget's watch over the memory of what it counts (:meth:`Budget.watch`)."""
        self.growth = Growth(lambda: self.released)
        """This process's growth, shared out among the in-process loads under way."""
        self.loads: collections.Counter[str] = collections.Counter()
        """Versions loaded, by reason: ``demand`` (a request), ``eager`` (found on disk),
        ``reload`` (changed, or asked) and ``explicit`` (an admin or repository load)."""
        self.awaited: collections.Counter[Key] = collections.Counter()
        """Requests waiting for each version's on-demand load: it is busy for the budget
        until they have resumed and entered it (a load beside must not evict it first)."""
        self.released = 0
        """Bytes this process gave back as it released versions (an in-worker load's
        measure adds what was released beside it)."""
        self.evictions: collections.Counter[str] = collections.Counter()
        """Versions evicted under the budget, by reason: ``room`` (for a load) or
        ``overshoot`` (a load measured more than its estimate)."""
        self._demands: dict[Key, asyncio.Task[Outcome]] = {}
        """The on-demand loads under way: every request that needs one waits for it."""
        self.models_dir = models_dir
        self.host = host or PluginHooks()
        self.fingerprinter = Fingerprinter()
        self.loader = Loader(
            self.host, models_dir, self.fingerprinter, plugins_dir, load_timeout, close_timeout
        )
        self.drain_timeout = drain_timeout
        self.records: dict[Key, VersionRecord] = {}
        self.routes = RouteTable()
        self.waiting: dict[tuple[str, str], tuple[str, ...]] = {}
        """What each ready runner version not yet eligible for its route waits for, by
        ``(route, name@version)``: the table's :meth:`RouteTable.waiting`, logged on change."""
        self.file_routes: dict[str, RouteSpec] = {}
        self.runtime_routes: Mapping[str, RouteSpec] = {}
        self.routes_file_error: str | None = None
        self._routes_fingerprint: str | None = None
        self._routes_reading = asyncio.Lock()
        """One read of ``routes.toml`` at a time: an older read never lands after a newer."""
        self.listeners: list[Callable[[LifecycleEvent], None]] = []
        self.on_routes: list[Callable[[], None]] = []
        """Called after every rebuild of the route table."""
        self.buckets: dict[str, TokenBucket | SharedTokenBucket] = {}
        self.shared_buckets: Path | None = None
        """With several workers: the folder of the rate-limit state they share."""
        self.started = False
        self.unserved: dict[str, str] = {}
        self.served = False
        """Every route has served once since start (strict readiness holds until then)."""
        self.served_marker: Path | None = None
        """With several workers: the file that says so for the whole server."""
        self.closing = False
        """Each route that cannot serve, and why (:meth:`RouteTable.unserved`), once started."""
        # Watched folders that went missing (path: since, epoch s); the watcher keeps it.
        self.lost_roots: dict[Path, float] = {}

    @property
    def routes_file(self) -> Path:
        return self.plugins_dir / ROUTES_FILE

    # -- discovery ---------------------------------------------------------------------

    def discover(self) -> list[Path]:
        """Every folder ``<plugins_dir>/<type>/<name>/<version>/``, ignored names skipped."""
        found: list[Path] = []
        for kind in PLUGIN_TYPES:
            for name in _subdirs(self.plugins_dir / kind):
                found.extend(_subdirs(name))
        return found

    def _discover_declarative(self) -> tuple[list[Path], list[Path]]:
        """:meth:`discover`'s folders, and those among them without a module (blocking)."""
        folders = self.discover()
        return folders, [f for f in folders if _is_declarative(f)]

    def folder_of(self, key: Key) -> Path:
        return self.plugins_dir.joinpath(*key)

    @staticmethod
    def key_of(folder: Path) -> Key:
        return (folder.parent.parent.name, folder.parent.name, folder.name)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Register built-ins and entry points, read ``routes.toml``, load every version."""
        self.host.load_builtins()
        self.host.load_entry_points()
        await self.sync()
        if self.budget is not None and self._watching is None:
            self._watching = asyncio.create_task(self.budget.watch())
        self.started = True
        log.info("registry_started", versions=len(self.records), routes=len(self.routes.entries))
        self._note_unserved()

    async def sync(self, force: bool = False) -> SyncReport:
        """Make the registry match the disk: load new, reload changed, unload deleted.

        Plugins with a module load first: one may provide a backend that a
        declarative runner uses. ``force`` reloads unchanged versions too
        (versions unloaded through the admin API stay unloaded). While the
        plugins dir is missing (being replaced), nothing is rescanned and what is
        loaded stays; the report lists the missing folder among the failures.
        """
        report = SyncReport()
        if self.records and not self.plugins_dir.is_dir():
            report.failed.append(
                {
                    "plugins_dir": str(self.plugins_dir),
                    "error": f"the plugins dir {self.plugins_dir} is missing: nothing "
                    "rescanned, what is loaded keeps serving until it is back",
                }
            )
            report.unchanged = len(self.records)
            return report
        report.routes_file = await self.sync_routes_file()
        # Listing folders and reading manifests cost as much as there are and as long as
        # they are: a thread's work, never the event loop's.
        folders, declarative = await asyncio.to_thread(self._discover_declarative)
        with_module = [f for f in folders if f not in declarative]
        for batch in (with_module, declarative):
            outcomes = await asyncio.gather(*(self.load(f, force=force) for f in batch))
            for folder, outcome in zip(batch, outcomes, strict=True):
                record = self.records.get(self.key_of(folder))
                if record is not None:  # else its folder went, and the watcher with it
                    report.add(record, outcome)
        on_disk = {self.key_of(f) for f in folders}
        for key in [k for k in self.records if k not in on_disk]:
            record = self.records.get(key)
            if record is not None:  # else unloaded meanwhile
                report.add(record, await self.unload(key, forget=True))
        return report

    async def sync_version(self, key: Key) -> Outcome:
        """Bring one version in line with its folder (the watcher calls this)."""
        folder = self.folder_of(key)
        if folder.is_dir():
            return await self.load(folder)
        if key in self.records:
            return await self.unload(key, forget=True)
        return "unchanged"

    async def sync_model(self, name: str) -> list[tuple[str, Outcome]]:
        """Reload every runner using model ``name`` whose resolved model changed, and try
        again each version that failed to load and names it (its manifest read again)."""
        records = list(self.records.values())
        users = [
            r
            for r in records
            if r.current is not None and self.loader.model_name(r.current.manifest) == name
        ]
        failed = [r for r in records if r.current is None and r.state == "failed"]
        if failed:
            names = await asyncio.to_thread(lambda: [self._model_named(r.folder) for r in failed])
            for record, named in zip(failed, names, strict=True):
                # One the watcher removed meanwhile stays gone (a load would make it again).
                gone = self.records.get(self.key_of(record.folder)) is not record
                if named == name and not gone:
                    log.info("retrying_failed_version", plugin=record.label, model=name,
                             last_error=record.last_error)  # fmt: skip
                    users.append(record)
        outcomes = await asyncio.gather(*(self.load(r.folder) for r in users))
        return [(r.label, o) for r, o in zip(users, outcomes, strict=True)]

    def _model_named(self, folder: Path) -> str | None:
        """The model repository name a version's manifest uses, if it can be read (blocking)."""
        try:
            return self.loader.model_name(load_manifest(folder))
        except Exception:  # a manifest that does not parse names no model
            return None

    def fingerprint(self, folder: Path) -> str:
        """The folder's files and, for a runner, the model file it resolves to now."""
        extra: list[Path] = []
        try:
            model = self.loader.model_path(load_manifest(folder))
        except Exception:  # the load reports it
            model = None
        if model is not None and not model.is_relative_to(folder):
            extra.append(model)
        return self.fingerprinter.folder(folder, extra)

    async def load(
        self,
        folder: Path,
        force: bool = False,
        explicit: bool = False,
        overrides: Mapping[str, Any] | None = None,
        demanded: bool = False,
    ) -> Outcome:
        """Load, or reload, the version in ``folder`` if its content changed.

        A failure keeps what was serving; the next change to the folder is tried
        again. ``force`` reloads unchanged content; ``explicit`` (an admin call
        for this version) also brings back a version unloaded through the API.
        ``overrides`` replace ``[runner]`` keys of its manifest for this load
        only (a model repository load's ``config``; give ``explicit`` with them).
        A runner version that loads on demand (``[runner] load``) is registered as
        ``available`` and loaded only ``demanded`` (its first request), ``explicit``
        or once loaded (a change reloads it).
        Whatever goes wrong becomes the outcome ``failed`` with the record's
        ``last_error``: nothing raises out of here (but :class:`Unavailable` when the
        memory budget of a version that loads on demand cannot be reached), no version
        stays ``loading``.
        """
        key = self.key_of(folder)
        record = self.records.get(key)
        if record is None:
            kind: PluginType = key[0]  # type: ignore[assignment]  # discover() yields PLUGIN_TYPES
            record = self.records[key] = VersionRecord(kind, key[1], key[2], folder)
            self._rebuild()
        async with record.lock:
            try:
                fingerprint, on_demand, isolated = await asyncio.to_thread(self._inspect, folder)
            except Exception as exc:  # the folder went away or cannot be read
                record.fingerprint = None
                return self._failed(record, exc, time.perf_counter())
            if record.state == "unloaded" and not explicit and fingerprint == record.fingerprint:
                return "held"
            if not (force or explicit or demanded) and fingerprint == record.fingerprint:
                return "unchanged"
            record.fingerprint = fingerprint
            record.on_demand, record.isolated = on_demand, isolated
            if on_demand and record.current is None and not (explicit or demanded):
                record.state, record.last_error = "available", None
                self._rebuild()
                return "available"
            reason = (
                "demand" if demanded
                else "explicit" if explicit
                else "reload" if record.current is not None
                else "eager"
            )  # fmt: skip
            return await self._load_locked(record, folder, overrides, reason)

    async def _measure(
        self, loaded: LoadedPlugin, grown: int, least: int, devices: gpu.Devices | None
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

    def budgeted(self) -> list[Held]:
        """The loaded versions that load on demand, which a budget counts: their last use
        (``time.monotonic()``), whether they are busy (a request uses, awaits or waits for
        the load of the version, an older instance still drains, or a change to it is under
        way), whether a budget may evict them (not pinned), and an isolated runner's
        processes' resident memory now, and whether it has served a request (its first
        use's memory resident)."""
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
                record.key, current.last_use, _busy(record, self.awaited),
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
        if only_idle and _busy(record, self.awaited):
            return "unchanged"
        started = time.perf_counter()
        async with record.lock:
            if record.current is None:
                return "unchanged"
            retiring, record.current = [record.current], None
            record.state = "draining"
            self._rebuild()
            await self._retire(record, retiring)
            record.state = "available"
            freed, record.memory_bytes = record.memory_bytes, None
            if self.budget is not None:
                await self.budget.gone(key)
            self.evictions[reason] += 1
            self._rebuild()
        log.info("plugin_evicted", plugin=record.label, reason=reason, bytes=freed,
                 seconds=round(time.perf_counter() - started, 4))  # fmt: skip
        self._emit(record, "evicted", started)
        return "evicted"

    def _inspect(self, folder: Path) -> tuple[str, bool, bool]:
        """The folder's fingerprint, whether it holds a runner that loads on demand, and
        whether that runner runs in processes of its own."""
        fingerprint = self.fingerprint(folder)
        try:
            runner = load_manifest(folder).runner
        except Exception:  # the load reports it
            return fingerprint, False, False
        if runner is None:
            return fingerprint, False, False
        return fingerprint, (runner.load or self.default_load) == "on_demand", runner.isolated

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
            outcome = await self.load(record.folder, demanded=True)
            log.info("plugin_demanded", plugin=record.label, outcome=outcome,
                     seconds=round(time.perf_counter() - started, 4))  # fmt: skip
            return outcome
        finally:
            self._demands.pop(key, None)

    async def _load_locked(
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
            return self._failed(record, exc, started)
        try:
            # A budget that cannot answer (its supervisor gone) raises Unavailable.
            admission = await budget.admit(record.key, record.isolated, least)
        except PluginLoadError as exc:  # over the whole budget alone
            return self._failed(record, exc, started)
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
                return self._failed(record, exc, started)
            finally:
                grown, alone = self.growth.end(token) if token is not None else (0, True)
            if under is not None:
                cost, totals = await self._measure(new, grown, under.least, devices)
                try:
                    await under.budget.measured(under.admission, cost, totals, sure=alone)
                    settled = True
                except PluginLoadError as exc:  # over the whole budget alone: not served
                    # Its estimate stays held until the instance is let go (the finally).
                    retiring = [new]
                    del new
                    await self._retire(record, retiring)
                    return self._failed(record, exc, started)
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
        self._rebuild()
        outcome: Outcome = "reloaded" if old is not None else "loaded"
        self.loads[reason] += 1
        bound.info("plugin_ready", outcome=outcome, seconds=round(time.perf_counter() - started, 4))
        self._emit(record, outcome, started)
        if old is not None:
            retiring = [old]
            del old
            await self._retire(record, retiring)
        return outcome

    def _failed(self, record: VersionRecord, exc: Exception, started: float) -> Outcome:
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
        self._rebuild()
        self._emit(record, "failed", started, message)
        return "failed"

    async def unload(self, key: Key, forget: bool = False) -> Outcome:
        """Stop routing to a version, drain it, release it.

        ``forget`` (its folder is gone) drops the record; otherwise it stays as
        ``unloaded`` and rescans leave it so until its content changes or an
        admin reload brings it back.
        """
        record = self.records.get(key)
        if record is None:
            raise NotFound(f"no plugin {key[0]}/{key[1]}@{key[2]}")
        started = time.perf_counter()
        async with record.lock:
            retiring = [record.current] if record.current is not None else []
            record.current, record.state = None, "draining"
            self._rebuild()
            if retiring:
                await self._retire(record, retiring)
            record.memory_bytes = None
            record.state = "unloaded"
            if self.budget is not None:
                await self.budget.gone(key)
            if forget and self.records.get(key) is record:
                del self.records[key]
                self.fingerprinter.forget(record.folder)
            self._rebuild()
        log.info("plugin_unloaded", plugin=record.label)
        self._emit(record, "unloaded", started)
        return "unloaded"

    def end_streams(self, reason: str) -> int:
        """End every stream still open, on every loaded runner (draining ones too), with a
        503 saying ``reason``; returns how many runners had streams. For a shutdown whose
        drain ran out: their clients get a last event rather than a cut connection."""
        ended = 0
        for record in self.records.values():
            for loaded in [record.current, *record.draining]:
                if not isinstance(loaded, StreamingRunner):
                    continue
                streams = loaded.streams
                if streams.running or streams.waiting:
                    streams.close(reason)
                    ended += 1
        return ended

    async def close(self, within: float | None = None) -> None:
        """Unload everything at shutdown, within ``within`` seconds (default: the close timeout).

        The server has drained already: no second wait for requests. Every
        ``close()`` runs at once, each bounded; a version whose lock a load
        still holds past the bound is left as it is (logged as ``close_timeout``).
        """
        self.drain_timeout = 0.0
        self.closing = True  # routes go as their versions do: nothing to report
        if self._watching is not None:  # nothing left to evict for
            self._watching.cancel()
            self._watching = None
        budget = self.loader.close_timeout if within is None else max(within, 0.0)
        self.loader.close_timeout = min(self.loader.close_timeout, budget)
        unloads = {
            asyncio.create_task(self.unload(key, forget=True)): self.records[key].label
            for key in list(self.records)
        }
        if not unloads:
            await self._close_runners()
            return
        done, pending = await asyncio.wait(unloads, timeout=budget + CLOSE_SLACK_S)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log.error("plugin_unload_failed", plugin=unloads[task], exc_info=task.exception())
        if pending:
            stuck = sorted(unloads[t] for t in pending)
            log.error("close_timeout", plugins=stuck, timeout_s=budget)
            for task in pending:
                task.cancel()
        await self._close_runners()

    async def _close_runners(self) -> None:
        """End whatever runner processes are left (their versions released them already)."""
        if self.loader.runners is not None:
            await self.loader.runners.close()

    async def refresh_isolated(self) -> None:
        """Read the figures of every isolated runner's processes (the admin API shows them)."""
        remotes = [
            p.remote
            for r in self.records.values()
            for p in [*r.draining, *([r.current] if r.current else [])]
            if p.remote is not None
        ]
        await asyncio.gather(*(remote.refresh() for remote in remotes))

    async def _retire(self, record: VersionRecord, retiring: list[LoadedPlugin]) -> None:
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

    def _emit(
        self, record: VersionRecord, outcome: Outcome, started: float, error: str | None = None
    ) -> None:
        event = LifecycleEvent(record, outcome, time.perf_counter() - started, error)
        for listener in self.listeners:
            listener(event)

    # -- routes ------------------------------------------------------------------------

    async def sync_routes_file(self) -> str:
        """Re-read ``routes.toml`` if its content changed: unchanged, applied or invalid.

        Its digest and its parse (of at most 16 MiB) cost as much as the file is
        long: both run on a thread, and the event loop only applies the result.
        The content counts as seen only once it has been judged, so a read that
        did not finish is tried again by the next rescan.
        """
        async with self._routes_reading:
            read = await asyncio.to_thread(self._read_routes_file, self._routes_fingerprint)
            if read is None:
                return "unchanged"
            fingerprint, parsed = read
            applied = self._apply_routes_file(parsed)
            self._routes_fingerprint = fingerprint
            return "applied" if applied else "invalid"

    async def reload_routes_file(self) -> bool:
        """Re-read ``routes.toml`` whether or not it changed (on a thread, as
        :meth:`sync_routes_file` does); an invalid file keeps the previous routes and
        says why (``routes_file_error``: in ``GET /admin/routes`` and the log)."""
        async with self._routes_reading:
            return self._apply_routes_file(await asyncio.to_thread(self._parse_routes_file))

    def _read_routes_file(
        self, seen: str | None
    ) -> tuple[str, dict[str, RouteSpec] | RoutesFileError] | None:
        """``routes.toml``'s digest and parse, or ``None`` when its digest is ``seen``
        (blocking)."""
        fingerprint = self.fingerprinter.file(self.routes_file)
        if fingerprint == seen:
            return None
        return fingerprint, self._parse_routes_file()

    def _parse_routes_file(self) -> dict[str, RouteSpec] | RoutesFileError:
        """``routes.toml``'s routes, or why it is invalid (blocking)."""
        try:
            return load_routes_file(self.routes_file)
        except RoutesFileError as exc:
            return exc

    def _apply_routes_file(self, parsed: dict[str, RouteSpec] | RoutesFileError) -> bool:
        """Serve ``routes.toml``'s routes, or keep the previous ones and say why."""
        if isinstance(parsed, RoutesFileError):
            self.routes_file_error = parsed.message
            log.error("routes_file_invalid", error=parsed.message)
            return False
        self.file_routes = parsed
        self.routes_file_error = None
        self._rebuild()
        log.info("routes_file_applied", routes=sorted(self.file_routes))
        return True

    def set_runtime_routes(self, routes: Mapping[str, RouteSpec]) -> None:
        """Replace the runtime layer (admin API, etcd) in one step: one table rebuild.

        Layers, lowest first: routes runners declare, ``routes.toml``, runtime
        entries. A runtime entry wins over a ``routes.toml`` entry of the same name
        until it is deleted, whatever the file does meanwhile.
        """
        self.runtime_routes = dict(routes)
        self._rebuild()

    def _rebuild(self) -> None:
        # One assignment: a request sees the old table or the new one, never a mix.
        specs = {**self.file_routes, **self.runtime_routes}
        self.routes = build_route_table(self.records.values(), specs)
        self._note_waiting()
        if self.started and not self.closing:
            self._note_unserved()
        buckets = {}
        for name, entry in self.routes.entries.items():
            limit = entry.rate_limit
            if limit is not None:
                kept = self.buckets.get(name)
                if kept is not None and kept.limit == limit:
                    buckets[name] = kept
                elif self.shared_buckets is not None:
                    path = shared_bucket_path(self.shared_buckets, name, limit)
                    buckets[name] = SharedTokenBucket(limit, path)
                else:
                    buckets[name] = TokenBucket(limit)
        self.buckets = buckets
        for listener in self.on_routes:
            listener()

    def _note_waiting(self) -> None:
        """Log each runner version that starts waiting for its chain (or waits for something
        else), and each that stops waiting: its chain is whole and it serves its route.

        A warning once the registry has started; at start, while versions load side by
        side, a runner often waits a moment for its processors: info.
        """
        waiting = self.routes.waiting()
        note = log.warning if self.started else log.info
        for (route, runner), reasons in waiting.items():
            if self.waiting.get((route, runner)) != reasons:
                serving = self.routes.entries[route].default
                note(
                    "route_waiting",
                    route=route,
                    runner=runner,
                    waiting_for=list(reasons),
                    serving=serving.label if isinstance(serving, Chain) else None,
                )
        for route, runner in self.waiting.keys() - waiting.keys():
            entry = self.routes.entries.get(route)
            chain = entry.by_version.get(runner.rpartition("@")[2]) if entry else None
            if isinstance(chain, Chain):
                log.info("route_chain_whole", route=route, runner=runner, chain=chain.label)
        self.waiting = waiting

    def _note_unserved(self) -> None:
        """Log each route that cannot serve (at start, then as one starts or stops failing)."""
        unserved = self.routes.unserved()
        for route, why in unserved.items():
            if self.unserved.get(route) != why:
                log.warning("route_cannot_serve", route=route, why=why)
        for route in self.unserved.keys() - unserved.keys():
            if route in self.routes.entries:
                log.info("route_serves", route=route)
        self.unserved = unserved
        if not unserved and not self.served:
            self.served = True
            if self.served_marker is not None:
                with contextlib.suppress(OSError):  # readiness then stays this worker's own
                    self.served_marker.touch()

    def has_served(self) -> bool:
        """Whether every route has served once since start: here, or (with several
        workers) in another worker of this server, as :attr:`served_marker` says."""
        if not self.served and self.served_marker is not None:
            self.served = self.served_marker.exists()
        return self.served

    # -- views -------------------------------------------------------------------------

    def plugins(self) -> list[VersionRecord]:
        return sorted(
            self.records.values(),
            key=lambda r: (
                PLUGIN_TYPES.index(r.type),
                r.name,
                r.sort_version is not None,
                r.sort_version or Version(0, 0, 0),
                r.version,
            ),
        )


def _subdirs(folder: Path) -> Iterable[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and not is_ignored_name(p.name))


def _is_declarative(folder: Path) -> bool:
    """A plugin without a module; a broken manifest counts as not (it fails on load anyway)."""
    try:
        return load_manifest(folder).module is None
    except Exception:
        return False
