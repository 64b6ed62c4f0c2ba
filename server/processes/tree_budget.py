"""One memory budget for a server of several workers, kept by the supervisor.

Each worker's registry asks the supervisor before an on-demand load (``admit``) and tells
it what the load measured (``measured``) or that it failed (``cancel``), and that a version
it held is gone (``gone``): :class:`SupervisedBudget`. The supervisor's
:class:`TreeBudget` keeps the accounts of the whole tree. An entry is a version in one
worker (loaded in the worker: each worker's copy costs its own memory) or in the runner
processes every worker shares (isolated: one cost, held by the workers that loaded it).
When a load needs room, the supervisor asks every worker which of its versions are idle
and when each was last used (``/_control/budget/usage``), and evicts the least recently
used entries idle in every worker that holds them (``/_control/budget/evict``), as it
broadcasts a repository unload. Decisions are one at a time; loads themselves run side
by side, each holding its estimate until measured.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import Metric
from prometheus_client.registry import Collector

from plugserve.registry.errors import InvalidInput, Unavailable
from plugserve.registry.lifecycle.budget import Admission, Key, Ledger, label
from plugserve.registry.lifecycle.registry import Registry
from plugserve.server.processes.pool import WorkerPool
from plugserve.server.processes.unix import READ_TIMEOUT_S, UnixClient
from plugserve.server.runtime.metrics import budget_families

log = structlog.get_logger("plugserve.supervisor")

Entry = tuple[str, str, str, str]
"""A version and where its memory is: ``"runners"`` (the shared runner processes) or
``"worker N"``."""
SHARED = "runners"
PREFIX = "/_supervisor/budget"


def _key(value: Any) -> Key:
    if not (isinstance(value, list) and len(value) == 3 and all(isinstance(v, str) for v in value)):
        raise InvalidInput("key must be [type, name, version]")
    return value[0], value[1], value[2]


class TreeBudget:
    """The supervisor's budget for every worker and the runner processes they share."""

    def __init__(self, limit: int, pool: WorkerPool) -> None:
        self.ledger: Ledger[Entry] = Ledger(limit)
        self.pool = pool
        self.holders: dict[Entry, set[int]] = {}
        """The workers that hold each resident entry (one, for a worker's own copy)."""
        self.tickets: dict[int, tuple[int, Entry]] = {}
        """Loads under way: the worker loading, and the entry."""
        self._deciding = asyncio.Lock()

    @staticmethod
    def entry(key: Key, worker: int, isolated: bool) -> Entry:
        return (*key, SHARED if isolated else f"worker {worker}")

    # -- what workers call --------------------------------------------------------------

    async def admit(self, worker: int, key: Key, isolated: bool) -> tuple[int, int]:
        """Make room for the load of ``key`` by ``worker``: its ticket and estimate."""
        entry = self.entry(key, worker, isolated)
        async with self._deciding:
            room = 0 if entry in self.ledger.cost else self.ledger.estimate(key)
            await self._make_room(room, keep=entry, reason="room")
            ticket = self.ledger.reserve(room)
            self.tickets[ticket] = (worker, entry)
        return ticket, room

    async def measured(self, ticket: int, nbytes: int) -> None:
        held = self.tickets.pop(ticket, None)
        self.ledger.reserved.pop(ticket, None)
        if held is None:  # its worker ended meanwhile
            return
        worker, entry = held
        self.ledger.measured(entry[:3], entry, nbytes)
        self.holders.setdefault(entry, set()).add(worker)
        async with self._deciding:
            await self._make_room(0, keep=entry, reason="overshoot")

    def cancel(self, ticket: int) -> None:
        self.tickets.pop(ticket, None)
        self.ledger.reserved.pop(ticket, None)

    def gone(self, worker: int, key: Key) -> None:
        """``worker`` no longer holds ``key`` (evicted, unloaded)."""
        for entry in (self.entry(key, worker, True), self.entry(key, worker, False)):
            holders = self.holders.get(entry)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    self._drop(entry)

    def worker_gone(self, worker: int) -> None:
        """A worker ended: what it held is released (a shared entry once no one holds it)."""
        for entry, holders in list(self.holders.items()):
            holders.discard(worker)
            if not holders:
                self._drop(entry)
        for ticket, (loading, _) in list(self.tickets.items()):
            if loading == worker:
                self.cancel(ticket)

    def _drop(self, entry: Entry) -> None:
        self.holders.pop(entry, None)
        self.ledger.cost.pop(entry, None)

    # -- eviction -----------------------------------------------------------------------

    async def _make_room(self, room: int, keep: Entry, reason: str) -> None:
        if self.ledger.over(room) <= 0:
            return
        usage: dict[Entry, list[Any]] = {}  # entry: [last use, busy]
        answers = await self.pool.call_all("GET", "/_control/budget/usage")
        for worker, reply in answers:
            if reply.status != 200:
                continue
            for row in reply.json()["versions"]:
                entry = self.entry(_key(row["key"]), worker.index, bool(row["isolated"]))
                seen = usage.setdefault(entry, [0.0, False])
                seen[0] = max(seen[0], float(row["last_use"]))
                seen[1] = seen[1] or bool(row["busy"])
        idle = [(used, entry) for entry, (used, busy) in usage.items() if not busy]
        for entry in self.ledger.victims([c for c in idle if c[1] != keep], room):
            await self._evict(entry, reason)

    async def _evict(self, entry: Entry, reason: str) -> None:
        """Ask every worker holding ``entry`` to evict it; it is gone once none holds it
        (a worker that took a request for it meanwhile keeps it, and it stays counted)."""
        holders = self.holders.get(entry, set())
        workers = [w for w in self.pool.workers.values() if w.index in holders]
        body = {"key": list(entry[:3]), "reason": reason}

        async def one(client: UnixClient) -> bool:
            try:
                reply = await client.call("POST", "/_control/budget/evict", json_body=body)
            except (aiohttp.ClientError, OSError, TimeoutError):
                return False
            return reply.status == 200 and bool(reply.json()["evicted"])

        done = await asyncio.gather(*(one(w.client) for w in workers))
        for worker, evicted in zip(workers, done, strict=True):
            if evicted:
                holders.discard(worker.index)
        holders &= set(self.pool.workers)
        if not holders:
            self._drop(entry)
        log.info("budget_evicted", plugin=label(entry[:3]), where=entry[3],
                 reason=reason, evicted=not holders)  # fmt: skip

    # -- status -------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        def where(entry: Entry) -> dict[str, Any]:
            holders = sorted(self.holders.get(entry, ()))
            return {"plugin": label(entry[:3]), "where": entry[3], "workers": holders}

        return self.ledger.describe(where)

    def add_routes(self, app: web.Application) -> None:
        async def admit(request: web.Request) -> web.Response:
            body = await request.json()
            ticket, reserved = await self.admit(
                int(body["worker"]), _key(body["key"]), bool(body["isolated"])
            )
            return web.json_response({"ticket": ticket, "reserved": reserved})

        async def measured(request: web.Request) -> web.Response:
            body = await request.json()
            await self.measured(int(body["ticket"]), int(body["bytes"]))
            return web.json_response({})

        async def cancel(request: web.Request) -> web.Response:
            self.cancel(int((await request.json())["ticket"]))
            return web.json_response({})

        async def gone(request: web.Request) -> web.Response:
            body = await request.json()
            self.gone(int(body["worker"]), _key(body["key"]))
            return web.json_response({})

        app.router.add_post(f"{PREFIX}/admit", admit)
        app.router.add_post(f"{PREFIX}/measured", measured)
        app.router.add_post(f"{PREFIX}/cancel", cancel)
        app.router.add_post(f"{PREFIX}/gone", gone)


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

    def __init__(self, supervisor: UnixClient, worker: int) -> None:
        self.supervisor = supervisor
        self.worker = worker

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

    async def admit(self, key: Key, isolated: bool) -> Admission:
        body = {"worker": self.worker, "key": list(key), "isolated": isolated}
        answer = await self._call("admit", body)
        return Admission(key, int(answer["ticket"]), int(answer["reserved"]))

    async def measured(self, admission: Admission, nbytes: int) -> None:
        await self._call("measured", {"ticket": admission.ticket, "bytes": nbytes})

    async def cancel(self, admission: Admission) -> None:
        with contextlib.suppress(Unavailable):  # a supervisor gone holds no estimate
            await self._call("cancel", {"ticket": admission.ticket}, READ_TIMEOUT_S)

    async def gone(self, key: Key) -> None:
        with contextlib.suppress(Unavailable):
            await self._call("gone", {"worker": self.worker, "key": list(key)}, READ_TIMEOUT_S)

    def describe(self) -> None:
        return None  # the supervisor answers for the tree


def add_worker_routes(control: web.Application, registry: Registry) -> None:
    """What the supervisor's budget calls on a worker: its versions' use, and evictions."""

    async def usage(request: web.Request) -> web.Response:
        rows = [
            {"key": list(key), "last_use": used, "busy": busy,
             "isolated": registry.records[key].isolated}
            for used, key, busy in registry.evictable()
        ]  # fmt: skip
        return web.json_response({"versions": rows})

    async def evict(request: web.Request) -> web.Response:
        body = await request.json()
        key = _key(body["key"])
        for _used, candidate, busy in registry.evictable():
            if candidate == key and busy:
                return web.json_response({"evicted": False})  # a request came meanwhile
        await registry.evict(key, str(body.get("reason", "room")))
        return web.json_response({"evicted": True})

    control.router.add_get("/_control/budget/usage", usage)
    control.router.add_post("/_control/budget/evict", evict)
