"""The supervisor's view of its workers: every control decision, made once, applied by all.

:class:`WorkerPool` stands where a single process has its
:class:`plugserve.registry.lifecycle.registry.Registry`: the watcher, the route store and fleet mode
call it as they call a registry, and it hands each call to every worker that
serves, answering once all of them have applied it. What it says of the
plugins (``records``) is what the workers answered last, merged.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from plugserve.registry.lifecycle.lifecycle_events import Key, LifecycleEvent, Outcome
from plugserve.registry.routing.records import VersionRecord
from plugserve.registry.routing.route_specs import RouteSpec, parse_route
from plugserve.server.processes import merge
from plugserve.server.processes.unix import CONTROL_TIMEOUT_S, READ_TIMEOUT_S, Reply, UnixClient

log = structlog.get_logger("plugserve.supervisor")

OUTCOME_ORDER: tuple[Outcome, ...] = (
    "failed",
    "reloaded",
    "loaded",
    "unloaded",
    "held",
    "unchanged",
)
"""One outcome for a call all workers made: the first of these any of them had."""


@dataclass
class Worker:
    """One worker process as the supervisor knows it."""

    index: int
    pid: int
    started_at: float
    client: UnixClient
    registered_at: float = field(default_factory=time.time)

    def as_json(self, restarts: int) -> dict[str, Any]:
        return {
            "index": self.index,
            "pid": self.pid,
            "started_at": self.started_at,
            "restarts": restarts,
        }


@dataclass(frozen=True)
class MergedReport:
    """A rescan's report over every worker (what ``POST /admin/reload`` answers)."""

    report: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return self.report


def routes_as_json(routes: Mapping[str, RouteSpec]) -> dict[str, Any]:
    """Runtime entries as the workers receive them: entry, revision and source by route."""
    return {
        name: {"entry": spec.as_entry(), "revision": spec.revision, "source": spec.source}
        for name, spec in routes.items()
    }


def routes_from_json(data: Mapping[str, Any]) -> dict[str, RouteSpec]:
    """The inverse of :func:`routes_as_json` (entries the supervisor already checked)."""
    from dataclasses import replace

    out = {}
    for name, item in data.items():
        spec = parse_route(name, item["entry"], item["source"])
        out[name] = replace(spec, revision=item["revision"], source=item["source"])
    return out


class WorkerPool:
    """Fans control calls out to every registered worker and merges their answers."""

    def __init__(
        self,
        plugins_dir: Path,
        models_dir: Path,
        change_timeout_s: float = CONTROL_TIMEOUT_S,
        unresponsive: Callable[[Worker], None] | None = None,
    ) -> None:
        self.plugins_dir = plugins_dir
        self.models_dir = models_dir
        self.change_timeout_s = change_timeout_s
        """How long a worker may take to apply a change (load, swap, drain the old)."""
        self.unresponsive = unresponsive
        """Called for a worker that did not apply a change: it is replaced, never left
        serving what the others no longer do."""
        self.changing = asyncio.Lock()
        """One change at a time, and no worker joins during one (it would miss it)."""
        self.last_metrics: dict[int, str] = {}
        """Each worker's last ``/metrics`` text, by pid."""
        self.retired_metrics: list[str] = []
        """The last counts of workers that ended: merged counters never go down."""
        self.lost_roots: dict[Path, float] = _Watched(self._lost_roots_changed)
        """Watched folders gone missing, as the watcher keeps them; every worker is told,
        for its readiness (``/v2/health/ready`` is 503 while one is missing)."""
        self.listeners: list[Callable[[LifecycleEvent], None]] = []
        self.runtime_routes: Mapping[str, RouteSpec] = {}
        self.records: dict[Key, VersionRecord] = {}
        self.workers: dict[int, Worker] = {}
        self.restarts: dict[int, int] = {}
        self._generation = 0
        self._pushing: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    # -- membership --------------------------------------------------------------------

    def add(self, worker: Worker) -> None:
        """A worker joins; then ``records`` (and fleet mode's replica record) are refreshed."""
        self.workers[worker.index] = worker
        task = asyncio.create_task(self._joined())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _joined(self) -> None:
        rows = await self.refresh()
        await self.changed({"loaded": [f"{r['type']}/{r['name']}@{r['version']}" for r in rows]})

    async def remove(self, index: int, pid: int) -> None:
        worker = self.workers.get(index)
        if worker is not None and worker.pid == pid:
            del self.workers[index]
            await worker.client.close()
            with contextlib.suppress(OSError):
                worker.client.path.unlink()
        last = self.last_metrics.pop(pid, None)
        if last is not None:
            self.retired_metrics.append(merge.counts_only(last))

    # -- calls -------------------------------------------------------------------------

    async def call_all(
        self,
        method: str,
        path: str,
        json_body: Any = None,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> list[tuple[Worker, Reply]]:
        """The same call to every registered worker at once; the answers of those that gave one.

        A worker that does not answer is left out. A read (``GET``) waits
        ``READ_TIMEOUT_S``; a change waits ``change_timeout_s``, and a worker that
        did not apply it is handed to ``unresponsive`` (the supervisor replaces it:
        its replacement starts from the current state).
        """
        workers = list(self.workers.values())
        change = method != "GET"
        timeout = self.change_timeout_s if change else READ_TIMEOUT_S

        async def one(worker: Worker) -> tuple[Worker, Reply] | None:
            try:
                reply = await worker.client.call(method, path, body, headers, json_body, timeout)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.warning("worker_call_failed", worker=worker.index, pid=worker.pid,
                            path=path, error=repr(exc))  # fmt: skip
                if change and self.unresponsive is not None and worker.index in self.workers:
                    self.unresponsive(worker)
                return None
            return worker, reply

        answers = await asyncio.gather(*(one(w) for w in workers))
        return [a for a in answers if a is not None]

    async def call_one(self, method: str, path: str, body: bytes | None = None) -> Reply | None:
        """A read that any worker answers alike (the route table): the first that answers."""
        for worker in list(self.workers.values()):
            try:
                return await worker.client.call(method, path, body, timeout_s=READ_TIMEOUT_S)
            except (aiohttp.ClientError, OSError, TimeoutError):
                continue
        return None

    # -- what the watcher and the admin calls do ----------------------------------------

    async def sync(self, force: bool = False) -> MergedReport:
        async with self.changing:
            answers = await self.call_all("POST", f"/admin/reload?force={str(force).lower()}")
            report = merge.sync_reports([r.json() for _, r in answers if r.status == 200])
            await self.changed(report)
        return MergedReport(report)

    async def sync_version(self, key: Key) -> Outcome:
        async with self.changing:
            answers = await self.call_all("POST", "/_control/sync_version", {"key": list(key)})
            outcome = _one_outcome(r.json()["outcome"] for _, r in answers if r.status == 200)
            await self.changed({outcome: [f"{key[0]}/{key[1]}@{key[2]}"]})
        return outcome

    async def sync_model(self, name: str) -> list[tuple[str, Outcome]]:
        async with self.changing:
            return await self._sync_model(name)

    async def _sync_model(self, name: str) -> list[tuple[str, Outcome]]:
        answers = await self.call_all("POST", "/_control/sync_model", {"name": name})
        by_label: dict[str, list[Outcome]] = {}
        for _, reply in answers:
            if reply.status == 200:
                for label, outcome in reply.json()["outcomes"]:
                    by_label.setdefault(label, []).append(outcome)
        outcomes = [(label, _one_outcome(o)) for label, o in sorted(by_label.items())]
        await self.changed({o: [label] for label, o in outcomes})
        return outcomes

    async def sync_routes_file(self) -> str:
        """Every worker re-reads ``routes.toml`` (the watcher saw it change)."""
        self._track(self._routes_file())
        return "scheduled"

    async def _routes_file(self) -> None:
        await self.call_all("POST", "/_control/sync_routes_file")

    def set_runtime_routes(self, routes: Mapping[str, RouteSpec]) -> None:
        """Replace the runtime layer on every worker; :meth:`settled` waits until they have."""
        self.runtime_routes = dict(routes)
        self._generation += 1
        self._track(self._push_routes(self._generation, routes_as_json(self.runtime_routes)))

    async def _push_routes(self, generation: int, routes: dict[str, Any]) -> None:
        body = {"generation": generation, "routes": routes}
        for worker, reply in await self.call_all("PUT", "/_control/runtime_routes", body):
            if reply.status != 200:
                log.error("worker_routes_failed", worker=worker.index, status=reply.status,
                          body=reply.body[:500].decode(errors="replace"))  # fmt: skip

    def _lost_roots_changed(self) -> None:
        self._track(self._push_lost_roots())

    async def _push_lost_roots(self) -> None:
        await self.call_all("PUT", "/_control/lost_roots", self.lost_roots_as_json())

    def lost_roots_as_json(self) -> dict[str, float]:
        return {str(path): since for path, since in self.lost_roots.items()}

    def routes_for_new_worker(self) -> dict[str, Any]:
        return {"generation": self._generation, "routes": routes_as_json(self.runtime_routes)}

    def _track(self, work: Awaitable[None]) -> None:
        previous = self._pushing

        async def in_order() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            await work

        self._pushing = asyncio.ensure_future(in_order())

    async def settled(self) -> None:
        """Wait until every worker has applied the last route change."""
        while self._pushing is not None:
            pushing = self._pushing
            await asyncio.gather(pushing, return_exceptions=True)
            if self._pushing is pushing:
                return

    # -- the merged view ---------------------------------------------------------------

    async def metrics(self) -> list[tuple[str, str]]:
        """Each worker's ``/metrics`` text, by worker index; the last of each is kept."""
        answers = await self.call_all("GET", "/metrics")
        texts = []
        for worker, reply in answers:
            if reply.status == 200:
                text = reply.body.decode()
                self.last_metrics[worker.pid] = text
                texts.append((str(worker.index), text))
        return texts

    async def plugins(self) -> list[dict[str, Any]]:
        answers = await self.call_all("GET", "/admin/plugins")
        return merge.plugins([(w.pid, r.json()["plugins"]) for w, r in answers if r.status == 200])

    async def refresh(self) -> list[dict[str, Any]]:
        """Read the workers' plugins again; ``records`` is what they hold now."""
        rows = await self.plugins()
        records = {}
        for row in rows:
            key = (row["type"], row["name"], row["version"])
            record = self.records.get(key) or VersionRecord(
                row["type"], row["name"], row["version"], Path(row["path"])
            )
            record.state, record.last_error = row["state"], row.get("last_error")
            records[key] = record
        self.records = records
        return rows

    async def changed(self, outcomes: Mapping[str, Any]) -> None:
        """After a change every worker applied: refresh ``records``, tell the listeners."""
        if not any(outcomes.get(o) for o in ("loaded", "reloaded", "unloaded", "failed")):
            return
        await self.refresh()
        for outcome in ("loaded", "reloaded", "unloaded", "failed"):
            for item in outcomes.get(outcome) or []:
                label = item if isinstance(item, str) else item.get("plugin", "")
                record = next((r for r in self.records.values() if r.label == label), None)
                if record is None:
                    continue
                event = LifecycleEvent(record, outcome, 0.0, record.last_error)
                for listener in list(self.listeners):
                    try:
                        listener(event)
                    except Exception:
                        log.exception("listener_failed", plugin=label)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.settled()
        for worker in list(self.workers.values()):
            await worker.client.close()


class _Watched(dict[Path, float]):
    """A dict that calls ``changed`` after each change the watcher makes to it."""

    def __init__(self, changed: Callable[[], None]) -> None:
        super().__init__()
        self._changed = changed

    def __setitem__(self, key: Path, value: float) -> None:
        super().__setitem__(key, value)
        self._changed()

    def pop(self, key: Path, default: Any = None) -> Any:
        had = key in self
        value = super().pop(key, default)
        if had:
            self._changed()
        return value


def _one_outcome(outcomes: Any) -> Outcome:
    seen = set(outcomes)
    return next((o for o in OUTCOME_ORDER if o in seen), "unchanged")
