"""The registry: every plugin version's record, its lifecycle, and the route table built from them.

Lifecycle of a version (one lock each, so the watcher, admin calls and startup
cannot race): load the new instance beside the old one, swap it in with one
route-table rebuild, let the old instance drain, then release it
(:class:`Swapper`). A failed load leaves whatever was serving untouched. Whether a
folder needs loading at all is decided by its content fingerprint
(:class:`VersionFolders`), never by the event that pointed at it. Versions that load
on their first request, and their memory budget, are :class:`OnDemand`'s; the route
table is :class:`RouteKeeper`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from plugserve.registry.errors import NotFound
from plugserve.registry.execution.components.streaming import StreamingRunner
from plugserve.registry.execution.isolation.groups import Runners
from plugserve.registry.execution.layout import TensorBounds
from plugserve.registry.lifecycle.budget import Budget, Held, Holder, LocalBudget
from plugserve.registry.lifecycle.lifecycle_events import Key, LifecycleEvent, Outcome
from plugserve.registry.lifecycle.loader import Loader
from plugserve.registry.lifecycle.on_demand import OnDemand
from plugserve.registry.lifecycle.route_keeper import RouteKeeper
from plugserve.registry.lifecycle.swapper import Swapper
from plugserve.registry.lifecycle.version_folders import VersionFolders
from plugserve.registry.plugins.fingerprint import Fingerprinter
from plugserve.registry.plugins.hooks import PluginHooks
from plugserve.registry.refs import PluginType
from plugserve.registry.routing.records import VersionRecord

log = structlog.get_logger("plugserve.registry")

CLOSE_SLACK_S = 0.5
"""How much longer than its own bound ``close()`` waits for the plugin closes it started."""

BudgetFactory = Callable[[Holder], Budget]
"""Makes a registry's memory budget, given what it budgets (the registry)."""


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


class Registry(RouteKeeper):
    """Discovers, loads, serves and releases plugin versions.

    Complete when built. ``memory_budget`` and ``gpu_memory_budget`` give it a budget
    of its own for the versions that load on demand; ``budget`` makes it one instead
    (a worker among several: its supervisor's). ``runners`` (where isolated runners
    run; by default a host of this process, made at the first such load), ``workers``,
    ``loop_budget`` and ``tensor_bounds`` are its :class:`Loader`'s;
    ``shared_buckets`` and ``served_marker`` its route table's (:class:`RouteKeeper`).
    """

    key_of = staticmethod(VersionFolders.key_of)

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
        *,
        budget: BudgetFactory | None = None,
        runners: Runners | None = None,
        workers: int = 1,
        loop_budget: float = 0.0,
        tensor_bounds: TensorBounds | None = None,
        shared_buckets: Path | None = None,
        served_marker: Path | None = None,
    ) -> None:
        self.fingerprinter = Fingerprinter()
        super().__init__(plugins_dir, self.fingerprinter, shared_buckets, served_marker)
        self.plugins_dir = plugins_dir
        self.models_dir = models_dir
        self.load_timeout = load_timeout
        self.host = host or PluginHooks()
        self.loader = Loader(
            self.host, models_dir, self.fingerprinter, plugins_dir, load_timeout, close_timeout
        )
        self.loader.runners = runners
        self.loader.workers = workers
        self.loader.loop_budget = loop_budget
        if tensor_bounds is not None:
            self.loader.tensor_bounds = tensor_bounds
        self.folders = VersionFolders(plugins_dir, self.loader, self.fingerprinter, default_load)
        if budget is None and (memory_budget or gpu_memory_budget):
            budget = _local_budget(memory_budget, gpu_memory_budget, load_timeout)
        self.budget = None if budget is None else budget(self)
        """With a budget: what each version loaded on demand costs, and which go first (a
        worker among several is given its supervisor's, one for the whole tree)."""
        self.swapper = Swapper(self.loader, self.budget, self._rebuild, drain_timeout)
        self.listeners: list[Callable[[LifecycleEvent], None]] = self.swapper.listeners
        self.loads = self.swapper.loads
        """Versions loaded, by reason (:attr:`Swapper.loads`)."""
        self.on_demand = OnDemand(
            self.records, lambda folder: self.load(folder, demanded=True), self.swapper
        )
        self.evictions = self.on_demand.evictions
        """Versions evicted under the budget, by reason (:attr:`OnDemand.evictions`)."""
        # Watched folders that went missing (path: since, epoch s); the watcher keeps it.
        self.lost_roots: dict[Path, float] = {}

    @property
    def drain_timeout(self) -> float:
        """How long a replaced or unloaded instance may drain before it is released."""
        return self.swapper.drain_timeout

    @drain_timeout.setter
    def drain_timeout(self, seconds: float) -> None:
        self.swapper.drain_timeout = seconds

    def discover(self) -> list[Path]:
        """Every version folder of the plugins dir (:meth:`VersionFolders.discover`)."""
        return self.folders.discover()

    def folder_of(self, key: Key) -> Path:
        return self.folders.folder_of(key)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Register built-ins and entry points, read ``routes.toml``, load every version."""
        self.host.load_builtins()
        self.host.load_entry_points()
        await self.sync()
        self.on_demand.watch()
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
        folders, declarative = await asyncio.to_thread(self.folders.discover_declarative)
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
            names = await asyncio.to_thread(
                lambda: [self.folders.model_named(r.folder) for r in failed]
            )
            for record, named in zip(failed, names, strict=True):
                # One the watcher removed meanwhile stays gone (a load would make it again).
                gone = self.records.get(self.key_of(record.folder)) is not record
                if named == name and not gone:
                    log.info("retrying_failed_version", plugin=record.label, model=name,
                             last_error=record.last_error)  # fmt: skip
                    users.append(record)
        outcomes = await asyncio.gather(*(self.load(r.folder) for r in users))
        return [(r.label, o) for r, o in zip(users, outcomes, strict=True)]

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
                inspected = await asyncio.to_thread(self.folders.inspect, folder)
            except Exception as exc:  # the folder went away or cannot be read
                record.fingerprint = None
                return self.swapper.failed(record, exc, time.perf_counter())
            fingerprint, on_demand, isolated = inspected
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
            return await self.swapper.load(record, folder, overrides, reason)

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
            await self.swapper.take_down(record, "unloaded")
            if forget and self.records.get(key) is record:
                del self.records[key]
                self.fingerprinter.forget(record.folder)
            self._rebuild()
        log.info("plugin_unloaded", plugin=record.label)
        self.swapper.emit(record, "unloaded", started)
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
        self.on_demand.stop_watching()  # nothing left to evict for
        budget = self.loader.close_timeout if within is None else max(within, 0.0)
        self.loader.close_timeout = min(self.loader.close_timeout, budget)
        unloads = {
            asyncio.create_task(self.unload(key, forget=True)): self.records[key].label
            for key in list(self.records)
        }
        if unloads:
            done, pending = await asyncio.wait(unloads, timeout=budget + CLOSE_SLACK_S)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.error("plugin_unload_failed", plugin=unloads[task],
                              exc_info=task.exception())  # fmt: skip
            if pending:
                stuck = sorted(unloads[t] for t in pending)
                log.error("close_timeout", plugins=stuck, timeout_s=budget)
                for task in pending:
                    task.cancel()
        # Whatever runner processes are left (their versions released them already).
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

    # -- versions that load on demand (:class:`OnDemand`) ------------------------------

    def prefetch(self, keys: Iterable[Key]) -> list[asyncio.Task[Outcome]]:
        """:meth:`OnDemand.prefetch`: begin loading ``keys``, once each."""
        return self.on_demand.prefetch(keys)

    async def demand(self, keys: Iterable[Key], within: float) -> None:
        """:meth:`OnDemand.demand`: load ``keys``, waiting at most ``within`` seconds."""
        await self.on_demand.demand(keys, within)

    async def evict(self, key: Key, reason: str, only_idle: bool = False) -> Outcome:
        """:meth:`OnDemand.evict`: ``key`` back to ``available``."""
        return await self.on_demand.evict(key, reason, only_idle)

    def budgeted(self) -> list[Held]:
        """:meth:`OnDemand.budgeted`: the loaded versions a budget counts."""
        return self.on_demand.budgeted()

    def evictable(self) -> list[tuple[float, Key, bool]]:
        """:meth:`OnDemand.evictable`: the loaded versions a budget may evict."""
        return self.on_demand.evictable()


def _local_budget(memory: int, gpu_memory: int | float, load_timeout: float) -> BudgetFactory:
    """A budget of this process's own: ``memory`` bytes, ``gpu_memory`` on each GPU."""

    def local(holder: Holder) -> Budget:
        return LocalBudget(memory, gpu_memory, holder, load_timeout)

    return local
