"""One memory budget for a server of several workers, kept by the supervisor.

Each worker's registry asks the supervisor before an on-demand load (``admit``) and tells
it what the load measured (``measured``) or that it failed (``cancel``), and that a version
it held is gone (``gone``): :class:`SupervisedBudget`. The supervisor's
:class:`TreeBudget` keeps the accounts of the whole tree. An entry is a version in one
worker (loaded in the worker: each worker's copy costs its own memory) or in the runner
processes every worker shares (isolated: one cost, held by the workers that loaded it).

Every :data:`SAMPLE_S` seconds, and after each load, the supervisor reads each worker's
resident memory (what it holds beyond its entries and its loads under way is that
worker's ``unattributed`` memory); every :data:`REPORT_S` seconds, and whenever the tree
is over the budget, it asks every worker which versions it holds, which are idle and
when each was last used (``/_control/budget/usage``, with an isolated runner's
processes' memory, read again, and whether each has served a request: what was held for
a version's first use is given back at the first report after it has). It counts a
version a worker holds that the accounts miss, and lets go of one no worker holds any
longer, each once two readings agree; an estimate whose load outlived its bound lapses.
When the count is over the budget, or a load needs room, it evicts the least recently
used entries idle in every worker that holds them (``/_control/budget/evict``), as it
broadcasts a repository unload. Decisions are one at a time and never wait for a load:
loads run side by side, each holding its estimate until measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, NamedTuple

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import Metric
from prometheus_client.registry import Collector

from plugserve.registry.errors import Conflict, InvalidInput, PluginLoadError, Unavailable
from plugserve.registry.lifecycle.budget import (
    RESERVATION_SLACK_S,
    SAMPLE_S,
    Admission,
    resident,
)
from plugserve.registry.lifecycle.ledger import ALONE, HOST, Cost, Key, Ledger, label
from plugserve.registry.lifecycle.registry import Registry
from plugserve.server.processes.pool import Worker, WorkerPool
from plugserve.server.processes.unix import READ_TIMEOUT_S, Reply, UnixClient
from plugserve.server.runtime.metrics import budget_families

log = structlog.get_logger("plugserve.supervisor")

SHARED = "runners"
PREFIX = "/_supervisor/budget"
REASONS = ("room", "overshoot")
"""Why the budget evicts: to make room for a load, or because a reading (after a load,
or every :data:`SAMPLE_S` seconds) found the tree over the budget."""
MAX_BYTES = 1 << 62
REPORT_S = 1.0
"""How often the supervisor asks every worker what it holds, when nothing is over."""


class Entry(NamedTuple):
    """A version and where its memory is: ``"runners"`` (the runner processes every worker
    shares) or ``"worker N"`` (that worker's own copy)."""

    key: Key
    where: str

    @classmethod
    def of(cls, key: Key, worker: int, isolated: bool) -> Entry:
        return cls(key, SHARED if isolated else f"worker {worker}")


class TreeBudget:
    """The supervisor's budget for every worker and the runner processes they share.

    A worker is known by its index and pid (a replacement has the same index, another
    pid): what a worker holds and the loads it has under way go with it when it ends.
    """

    def __init__(
        self,
        limit: int,
        gpu_limit: int | float,
        pool: WorkerPool,
        evict_timeout_s: float,
        load_timeout_s: float = 120.0,
    ) -> None:
        self.ledger: Ledger[Entry] = Ledger(limit, gpu_limit)
        self.pool = pool
        self.evict_timeout_s = evict_timeout_s
        """The longest a worker may take to evict (drain and close): past it, not evicted."""
        self.hold_s = load_timeout_s + RESERVATION_SLACK_S
        """The longest a load's estimate is held without its measure or cancel."""
        self.holders: dict[Entry, set[int]] = {}
        """The workers (pids) that hold each resident entry."""
        self.tickets: dict[int, tuple[int, Entry]] = {}
        """Loads under way: the loading worker's pid, and the entry."""
        self.base: dict[int, tuple[int, int]] = {}
        """By worker pid: its index, and its resident memory before its first load."""
        self.counted_at: dict[Entry, float] = {}
        """When each entry was last measured or taken on (``time.monotonic()``)."""
        self.strays: dict[tuple[Entry, int], int] = {}
        """(entry, worker pid) pairs on which the accounts and the worker disagree: for
        how many readings in a row."""
        self._deciding = asyncio.Lock()

    def _check(self, worker: int, pid: int) -> None:
        known = self.pool.workers.get(worker)
        if known is None or known.pid != pid:
            raise Conflict(f"no worker {worker} with pid {pid}")

    def _loading(self) -> set[Entry]:
        return {entry for _, entry in self.tickets.values()}

    # -- what workers call --------------------------------------------------------------

    async def admit(self, worker: int, pid: int, key: Key, isolated: bool, least: int = 0) -> int:
        """Make room for the load of ``key`` by a worker: its ticket. A version already
        counted, or already loading into the shared processes, needs no more room; one
        over the whole budget alone is refused (:class:`PluginLoadError`)."""
        entry = Entry.of(key, worker, isolated)
        self._check(worker, pid)
        async with self._deciding:
            self._read_workers()
            counted = entry in self.ledger.cost or (isolated and entry in self._loading())
            if refusal := self.ledger.refusal(key, least):
                raise refusal
            group = ALONE if isolated else entry.where
            room = {} if counted else self.ledger.estimate(key, least, group)
            await self._make_room(room, keep=entry, reason="room")
            self._check(worker, pid)  # it may have ended meanwhile: nothing held for it
            ticket = self.ledger.reserve(room, group, time.monotonic() + self.hold_s)
            self.tickets[ticket] = (pid, entry)
        return ticket

    async def measured(
        self, ticket: int, cost: Cost, totals: dict[str, int], sure: bool = True
    ) -> None:
        """Count a load's measure (``sure``: measured by itself); :class:`PluginLoadError`
        if a sure measure is over the whole budget alone (not counted; the worker lets it
        go)."""
        held = self.tickets.pop(ticket, None)
        group = self.ledger.holds.get(ticket, (ALONE, 0.0))[0]
        if held is None:  # its worker ended, or its estimate lapsed: the next reading counts it
            self.ledger.release(ticket)
            return
        pid, entry = held
        self.ledger.totals.update(totals)
        if sure and (refusal := self.ledger.refused(entry.key, cost, ticket)):
            self.tickets[ticket] = held  # held until the worker lets it go (cancel)
            raise refusal
        self.ledger.measured(entry.key, entry, cost, ticket, group, sure)
        self.holders.setdefault(entry, set()).add(pid)
        self.counted_at[entry] = time.monotonic()
        async with self._deciding:  # what it overshot goes before it serves
            self._read_workers()
            await self._make_room({}, keep=entry, reason="overshoot")

    def cancel(self, ticket: int) -> None:
        held = self.tickets.pop(ticket, None)
        self.ledger.release(ticket)
        if held is not None:
            self._release(held[1])

    def gone(self, worker: int, pid: int, key: Key) -> None:
        """A worker no longer holds ``key`` (evicted, unloaded)."""
        for entry in (Entry.of(key, worker, True), Entry.of(key, worker, False)):
            holders = self.holders.get(entry)
            if holders is not None:
                holders.discard(pid)
                self._release(entry)

    def worker_gone(self, pid: int) -> None:
        """A worker ended: its loads under way are cancelled, what it held released (a
        shared entry once no worker holds it), and its own memory no longer read."""
        for ticket, (loading, _) in list(self.tickets.items()):
            if loading == pid:
                self.cancel(ticket)
        for entry, holders in list(self.holders.items()):
            holders.discard(pid)
            self._release(entry)
        index, _ = self.base.pop(pid, (None, 0))
        if index is not None:
            self.ledger.unattributed.pop(f"worker {index}", None)
        self.strays = {pair: n for pair, n in self.strays.items() if pair[1] != pid}

    def _release(self, entry: Entry) -> None:
        """Stop counting ``entry`` once no worker holds it and none is loading it."""
        if not self.holders.get(entry) and entry not in self._loading():
            self.holders.pop(entry, None)
            self.ledger.forget(entry)
            self.counted_at.pop(entry, None)

    # -- reading the tree ---------------------------------------------------------------

    async def watch(self) -> None:
        """Read the workers' memory every :data:`SAMPLE_S` seconds (and after each load), and
        their reports every :data:`REPORT_S` seconds or when over; evict what is over the
        budget, until cancelled."""
        reported = 0.0
        while True:
            await asyncio.sleep(SAMPLE_S)
            try:
                async with self._deciding:
                    self._read_workers()
                    if self.ledger.over({}) or time.monotonic() - reported >= REPORT_S:
                        reported = time.monotonic()
                        await self.sample()
            except Exception:  # a reading must never end the watch
                log.exception("budget_sample_failed")

    async def sample(self) -> None:
        """One full reading: estimates past their bound lapse, the workers' reports are
        reconciled with the accounts, their memory is read, and what is over is evicted."""
        for ticket in self.ledger.lapsed(time.monotonic()):
            log.warning("budget_reservation_lapsed", ticket=ticket,
                        plugin=label(self.tickets[ticket][1].key) if ticket in self.tickets
                        else None)  # fmt: skip
            self.cancel(ticket)
        began = time.monotonic()
        replies = await self.pool.call_all("GET", "/_control/budget/usage")
        self._reconcile(replies, began)
        self._read_workers()
        if not self.ledger.loading():  # a load under way is judged by its measure
            await self._make_room({}, keep=None, reason="overshoot", replies=replies)

    def _read_workers(self) -> None:
        """Each worker's resident memory beyond what it used before its first load."""
        for worker in list(self.pool.workers.values()):
            now = resident(worker.pid)
            if not now:  # gone: its keeper tells the budget
                continue
            _, base = self.base.setdefault(worker.pid, (worker.index, now))
            self.ledger.sampled(f"worker {worker.index}", now - base)

    def _reconcile(self, replies: list[tuple[Worker, Reply]], began: float) -> None:
        """Count what a worker reports holding that the accounts miss (a measure lost on
        the way), and let go of what no worker reports any longer (a ``gone`` lost), once
        two readings in a row agree; read the shared processes' memory again."""
        reported: set[tuple[Entry, int]] = set()
        answered: set[int] = set()
        served: set[Entry] = set()
        for worker, reply in replies:
            if reply.status != 200:
                continue
            answered.add(worker.pid)
            for row in reply.json()["versions"]:
                entry = Entry.of(_key(row["key"]), worker.index, bool(row["isolated"]))
                reported.add((entry, worker.pid))
                if row.get("served", True):
                    served.add(entry)
                if isinstance(row.get("bytes"), int):
                    self.ledger.remeasured(entry.key, entry, row["bytes"])
        self.ledger.served(served)  # the workers' memory is read after: it holds what they took
        loading = {(entry, pid) for pid, entry in self.tickets.values()}
        held = {(entry, pid) for entry, pids in self.holders.items() for pid in pids}
        missed = reported - held - loading
        lost = {
            (entry, pid)
            for entry, pid in held - reported - loading
            if pid in answered and self.counted_at.get(entry, 0.0) < began
        }
        strays = {pair: self.strays.get(pair, 0) + 1 for pair in missed | lost}
        for (entry, pid), seen in list(strays.items()):
            if seen < 2:
                continue
            del strays[(entry, pid)]
            if (entry, pid) in missed:
                if entry not in self.ledger.cost:
                    group = ALONE if entry.where == SHARED else entry.where
                    self.ledger.measured(entry.key, entry, self.ledger.estimate(entry.key),
                                         group=group)  # fmt: skip
                self.holders.setdefault(entry, set()).add(pid)
                self.counted_at[entry] = time.monotonic()
                log.warning("budget_took_on", plugin=label(entry.key), where=entry.where)
            else:
                self.holders[entry].discard(pid)
                self._release(entry)
                log.warning("budget_let_go", plugin=label(entry.key), where=entry.where)
        self.strays = strays

    # -- eviction -----------------------------------------------------------------------

    async def _make_room(
        self,
        room: Cost,
        keep: Entry | None,
        reason: str,
        replies: list[tuple[Worker, Reply]] | None = None,
    ) -> None:
        if not self.ledger.over(room):
            return
        if replies is None:
            replies = await self.pool.call_all("GET", "/_control/budget/usage")
        seen: dict[Entry, tuple[float, bool, set[int]]] = {}  # last use, busy, reported by
        silent: set[int] = set()  # workers that did not say what they use
        for worker, reply in replies:
            if reply.status != 200:
                silent.add(worker.pid)
                continue
            for row in reply.json()["versions"]:
                entry = Entry.of(_key(row["key"]), worker.index, bool(row["isolated"]))
                stays = bool(row["busy"]) or not row.get("evictable", True)
                used, busy, by = seen.get(entry, (0.0, False, set()))
                seen[entry] = (max(used, float(row["last_use"])), busy or stays,
                               by | {worker.pid})  # fmt: skip
        loading = self._loading()
        idle = [
            (used, entry)
            for entry, (used, busy, _) in seen.items()
            if not busy
            and entry != keep
            and entry not in loading
            # held by a worker that did not answer: it may be in use there
            and not self.holders.get(entry, set()) & silent
        ]
        for entry in self.ledger.victims(idle, room):
            await self._evict(entry, seen[entry][2], reason)

    async def _evict(self, entry: Entry, reported_by: set[int], reason: str) -> None:
        """Ask every worker that holds ``entry`` (or reported it loaded: an explicit load
        holds shared processes too) to evict it. It is released once none holds it; a
        worker that took a request for it meanwhile keeps it, and it stays counted."""
        targets = self.holders.get(entry, set()) | reported_by
        workers = [w for w in self.pool.workers.values() if w.pid in targets]
        body = {"key": list(entry.key), "reason": reason}

        async def one(client: UnixClient) -> bool:
            try:
                reply = await client.call(
                    "POST", "/_control/budget/evict", json_body=body,
                    timeout_s=self.evict_timeout_s,
                )  # fmt: skip
            except (aiohttp.ClientError, OSError, TimeoutError):
                return False
            return reply.status == 200 and bool(reply.json()["evicted"])

        done = await asyncio.gather(*(one(w.client) for w in workers))
        holders = self.holders.get(entry)  # read again: a load may have joined meanwhile
        if holders is not None:
            holders.difference_update(w.pid for w, ok in zip(workers, done, strict=True) if ok)
            holders.intersection_update(w.pid for w in self.pool.workers.values())
            self._release(entry)
        log.info("budget_evicted", plugin=label(entry.key), where=entry.where, reason=reason,
                 released=entry not in self.ledger.cost)  # fmt: skip

    # -- status -------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        def where(entry: Entry) -> dict[str, Any]:
            pids = self.holders.get(entry, set())
            workers = sorted(w.index for w in self.pool.workers.values() if w.pid in pids)
            return {"plugin": label(entry.key), "where": entry.where, "workers": workers}

        return self.ledger.describe(where)

    def add_routes(self, app: web.Application) -> None:
        async def admit(request: web.Request) -> web.Response:
            body = await _body(request)
            try:
                ticket = await self.admit(
                    _int(body, "worker"), _int(body, "pid"), _key(body.get("key")),
                    _bool(body, "isolated"), _int({"least": 0, **body}, "least"),
                )  # fmt: skip
            except PluginLoadError as exc:  # the worker's load fails with it
                return web.json_response({"refused": exc.message})
            return web.json_response({"ticket": ticket})

        async def measured(request: web.Request) -> web.Response:
            body = await _body(request)
            try:
                await self.measured(
                    _int(body, "ticket"), _cost(body.get("cost")), _cost(body.get("totals")),
                    _bool({"sure": True, **body}, "sure"),
                )  # fmt: skip
            except PluginLoadError as exc:
                return web.json_response({"refused": exc.message})
            return web.json_response({})

        async def watching(app: web.Application) -> AsyncIterator[None]:
            task = asyncio.create_task(self.watch())
            yield
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        async def cancel(request: web.Request) -> web.Response:
            self.cancel(_int(await _body(request), "ticket"))
            return web.json_response({})

        async def gone(request: web.Request) -> web.Response:
            body = await _body(request)
            self.gone(_int(body, "worker"), _int(body, "pid"), _key(body.get("key")))
            return web.json_response({})

        app.router.add_post(f"{PREFIX}/admit", admit)
        app.router.add_post(f"{PREFIX}/measured", measured)
        app.router.add_post(f"{PREFIX}/cancel", cancel)
        app.router.add_post(f"{PREFIX}/gone", gone)
        app.cleanup_ctx.append(watching)


# -- reading the calls' bodies: a 400 naming the field, never a 500 ---------------------


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        raise InvalidInput("the body is not JSON") from None
    if not isinstance(body, dict):
        raise InvalidInput("the body must be a JSON object")
    return body


def _int(body: dict[str, Any], name: str) -> int:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_BYTES:
        raise InvalidInput(f"{name} must be a non-negative integer")
    return value


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if not isinstance(value, bool):
        raise InvalidInput(f"{name} must be true or false")
    return value


def _key(value: Any) -> Key:
    if not (isinstance(value, list) and len(value) == 3 and all(isinstance(v, str) for v in value)):
        raise InvalidInput("key must be [type, name, version]")
    return value[0], value[1], value[2]


def _cost(value: Any) -> Cost:
    """Bytes by resource: ``memory``, or a GPU (``cuda:N``)."""
    if not isinstance(value, dict):
        raise InvalidInput("a cost is an object of bytes by resource")
    for resource in value:
        if resource != HOST and not (resource.startswith("cuda:") and resource[5:].isdigit()):
            raise InvalidInput(f"no resource {resource!r}: memory or cuda:N")
        _int(value, resource)
    return dict(value)


class BudgetCollector(Collector):
    """The tree's budget gauges, on the supervisor's ``/metrics``."""

    def __init__(self, budget: TreeBudget) -> None:
        self._budget = budget

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from budget_families(self._budget.describe())


class SupervisedBudget:
    """A worker's view of its supervisor's :class:`TreeBudget`."""

    def __init__(self, supervisor: UnixClient, worker: int, pid: int, gpus: bool) -> None:
        self.supervisor = supervisor
        self.worker = worker
        self.pid = pid
        self.gpus = gpus

    async def _call(self, call: str, body: dict[str, Any], timeout_s: float | None = None) -> Any:
        try:
            reply = await self.supervisor.call(
                "POST", f"{PREFIX}/{call}", json_body=body, timeout_s=timeout_s
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise Unavailable(
                f"the memory budget is not answering: {type(exc).__name__}", retry_after_s=1
            ) from None
        if reply.status != 200:
            raise Unavailable(f"the memory budget refused: {reply.body[:200]!r}", retry_after_s=1)
        return reply.json()

    # admit and measured may wait for evictions (drains) elsewhere in the tree: the
    # client's bound, a change's; cancel and gone only change the accounts: a read's.

    async def admit(self, key: Key, isolated: bool, least: int = 0) -> Admission:
        body = {"worker": self.worker, "pid": self.pid, "key": list(key), "isolated": isolated,
                "least": least}  # fmt: skip
        reply = await self._call("admit", body)
        if "refused" in reply:
            raise PluginLoadError(str(reply["refused"]))
        return Admission(key, int(reply["ticket"]))

    async def measured(
        self, admission: Admission, cost: Cost, totals: dict[str, int], sure: bool = True
    ) -> None:
        body = {"ticket": admission.ticket, "cost": cost, "totals": totals, "sure": sure}
        reply = await self._call("measured", body)
        if "refused" in reply:
            raise PluginLoadError(str(reply["refused"]))

    async def cancel(self, admission: Admission) -> None:
        with contextlib.suppress(Unavailable):  # a supervisor gone holds no estimate
            await self._call("cancel", {"ticket": admission.ticket}, READ_TIMEOUT_S)

    async def gone(self, key: Key) -> None:
        body = {"worker": self.worker, "pid": self.pid, "key": list(key)}
        with contextlib.suppress(Unavailable):
            await self._call("gone", body, READ_TIMEOUT_S)

    async def watch(self) -> None:
        return None  # the supervisor reads the tree

    def describe(self) -> None:
        return None  # the supervisor answers for the tree


def add_worker_routes(control: web.Application, registry: Registry) -> None:
    """What the supervisor's budget calls on a worker: the versions it holds under the
    budget (their use, and an isolated runner's processes' memory), and evictions."""

    async def usage(request: web.Request) -> web.Response:
        rows = [
            {"key": list(held.key), "last_use": held.last_use, "busy": held.busy,
             "evictable": held.evictable, "isolated": held.isolated, "bytes": held.bytes,
             "served": held.served}
            for held in registry.budgeted()
        ]  # fmt: skip
        return web.json_response({"versions": rows})

    async def evict(request: web.Request) -> web.Response:
        body = await _body(request)
        key = _key(body.get("key"))
        reason = body.get("reason")
        if reason not in REASONS:
            raise InvalidInput(f"reason must be one of {', '.join(REASONS)}")
        if all(candidate != key for _, candidate, _ in registry.evictable()):
            # not loaded here (nothing to evict), or not the budget's to evict
            return web.json_response({"evicted": registry.records.get(key) is None
                                      or registry.records[key].current is None})  # fmt: skip
        outcome = await registry.evict(key, reason, only_idle=True)
        return web.json_response({"evicted": outcome == "evicted"})

    control.router.add_get("/_control/budget/usage", usage)
    control.router.add_post("/_control/budget/evict", evict)
