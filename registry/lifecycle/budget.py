"""A memory budget for runner versions that load on demand: what each costs, measured, and
which idle ones go first when a load needs room.

A version's cost is measured once it has loaded: for an isolated runner, the resident
memory of its runner processes (all of it comes back when they end); in the worker, how
much the worker's resident memory grew during the load. The least recently used idle
versions that load on demand (``load = "on_demand"``, not ``pinned``) are evicted first:
back to ``available``, loaded again by their next request. Recency is the time a request
last entered each instance (:attr:`LoadedPlugin.last_use`, ``time.monotonic()``: one
clock for every process of the machine, so a supervisor can compare its workers').

:class:`Ledger` keeps the accounts; :class:`LocalBudget` is a single process's budget; a
worker among several asks its supervisor's (``server/processes/tree_budget.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import itertools
import os
import re
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

Key = tuple[str, str, str]
E = TypeVar("E", bound=Hashable)

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|[KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def machine_memory() -> int:
    """Bytes this process may use: its cgroup's limit if it has one, else the machine's."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_budget(value: int | str) -> int:
    """``memory_budget`` in bytes: an integer, ``"512MiB"``/``"4GB"``, or a share of the
    machine or cgroup (``"60%"``); 0 turns the budget off. ``ValueError`` otherwise."""
    if isinstance(value, bool):
        raise ValueError("memory_budget is bytes, a size such as 4GiB, or a share such as 60%")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("memory_budget must not be negative")
        return value
    match = _SIZE.match(value)
    if match is None:
        raise ValueError(f"memory_budget {value!r} is not bytes, a size (4GiB) or a share (60%)")
    number, unit = float(match.group(1)), (match.group(2) or "").upper()
    if unit == "%":
        if not 0 < number <= 100:
            raise ValueError("a memory_budget share is above 0 and at most 100%")
        return int(machine_memory() * number / 100)
    return int(number * _UNITS[unit[:1]])


def resident(pid: int | None = None) -> int:
    """The resident memory of a process (this one by default), in bytes; 0 if unknown."""
    try:
        fields = Path(f"/proc/{pid or 'self'}/statm").read_text().split()
    except OSError:
        return 0
    return int(fields[1]) * PAGE


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


_TRIM = _malloc_trim()


def release_memory() -> None:
    """Give a released version's memory back to the system: collect the reference cycles
    that hold its objects, then ask glibc to return the free pages of its heaps (native
    libraries allocate on many threads' arenas, which keep what they free otherwise)."""
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)


HOST = "memory"
Cost = dict[str, int]
"""Bytes by resource: ``"memory"`` (the machine's) and ``"cuda:N"`` (a GPU's)."""


def parse_gpu_budget(value: int | str) -> int | float:
    """``gpu_memory_budget``, for each GPU: bytes (an integer or a size such as ``"20GiB"``),
    or a share of each GPU's memory (``"80%"``, kept as the fraction 0.8); 0: none."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1])
        except ValueError:
            raise ValueError(f"gpu_memory_budget {value!r} is not a share such as 80%") from None
        if not 0 < share <= 100:
            raise ValueError("a gpu_memory_budget share is above 0 and at most 100%")
        return share / 100
    try:
        return parse_budget(value)
    except ValueError as exc:
        raise ValueError(str(exc).replace("memory_budget", "gpu_memory_budget")) from None


@dataclass
class Admission:
    """A load let in by the budget: room was made for its estimate, held until measured."""

    key: Key
    ticket: int


@dataclass
class Ledger(Generic[E]):
    """The budget's accounts: the measured cost of what is resident (by entry: a version,
    or in a tree of workers a version in one worker or in the shared runner processes),
    the estimates held for loads under way, and each version's last measure.

    ``limit`` bounds the machine's memory (0: no bound), ``gpu_limit`` each GPU's: bytes,
    or a share of its total (a float, resolved by ``totals``, the devices' sizes as last
    read); 0: no bound."""

    limit: int
    gpu_limit: int | float = 0
    totals: dict[str, int] = field(default_factory=dict)
    cost: dict[E, Cost] = field(default_factory=dict)
    reserved: dict[int, Cost] = field(default_factory=dict)
    """Loads under way (by ticket): their estimates, counted until measured."""
    known: dict[Key, Cost] = field(default_factory=dict)
    """Every version measured once: its cost (the estimate of its next load)."""
    _tickets: Iterator[int] = field(default_factory=lambda: itertools.count(1), repr=False)

    @property
    def gpus(self) -> bool:
        """Whether loads are measured on the GPUs too."""
        return bool(self.gpu_limit)

    def limit_of(self, resource: str) -> int | None:
        if resource == HOST:
            return self.limit or None
        if not self.gpu_limit:
            return None
        if isinstance(self.gpu_limit, float):
            total = self.totals.get(resource)
            return int(total * self.gpu_limit) if total else None
        return self.gpu_limit

    def resident(self, resource: str = HOST) -> int:
        return sum(c.get(resource, 0) for c in self.cost.values())

    def held(self, resource: str) -> int:
        """Resident and reserved."""
        return self.resident(resource) + sum(c.get(resource, 0) for c in self.reserved.values())

    def over(self, room: Cost) -> dict[str, int]:
        """The bounded resources that ``room`` more would overflow, with the bytes over."""
        resources = {r for c in [room, *self.cost.values(), *self.reserved.values()] for r in c}
        over = {}
        for resource in resources:
            limit = self.limit_of(resource)
            if limit is not None:
                beyond = self.held(resource) + room.get(resource, 0) - limit
                if beyond > 0:
                    over[resource] = beyond
        return over

    def estimate(self, key: Key) -> Cost:
        """What loading ``key`` will cost: its last measure, else the others' mean memory
        (where it will sit on a GPU is not known before its first load)."""
        if key in self.known:
            return dict(self.known[key])
        if not self.known:
            return {}
        return {HOST: sum(c.get(HOST, 0) for c in self.known.values()) // len(self.known)}

    def reserve(self, cost: Cost) -> int:
        ticket = next(self._tickets)
        self.reserved[ticket] = cost
        return ticket

    def measured(self, key: Key, entry: E, cost: Cost, ticket: int | None = None) -> None:
        if ticket is not None:
            self.reserved.pop(ticket, None)
        self.cost[entry] = self.known[key] = {r: max(n, 0) for r, n in cost.items()}

    def victims(self, candidates: Iterable[tuple[float, E]], room: Cost) -> list[E]:
        """Entries to evict, least recently used first, until ``room`` more fits on every
        bounded resource (an entry that frees nothing where room is short stays).
        ``candidates``: (last use, entry) of the idle versions that may go."""
        chosen = []
        over = self.over(room)
        for _, entry in sorted(c for c in candidates if c[1] in self.cost):
            if not over:
                break
            cost = self.cost[entry]
            if not any(cost.get(resource, 0) > 0 for resource in over):
                continue
            chosen.append(entry)
            over = {r: b - cost.get(r, 0) for r, b in over.items() if b - cost.get(r, 0) > 0}
        return chosen

    def describe(self, label: Callable[[E], dict[str, Any]]) -> dict[str, Any]:
        """``/admin/status``'s ``memory``."""
        devices = sorted({r for c in self.cost.values() for r in c if r != HOST} | set(self.totals))
        rows = []
        for entry, cost in sorted(self.cost.items(), key=lambda kv: -kv[1].get(HOST, 0)):
            row = {**label(entry), "bytes": cost.get(HOST, 0)}
            if self.gpus:
                row["gpu_bytes"] = {r: n for r, n in cost.items() if r != HOST}
            rows.append(row)
        state: dict[str, Any] = {
            "budget_bytes": self.limit,
            "resident_bytes": self.resident(),
            "reserved_bytes": self.held(HOST) - self.resident(),
            "resident": rows,
        }
        if self.gpus:
            state["gpus"] = {
                device: {
                    "budget_bytes": self.limit_of(device),
                    "resident_bytes": self.resident(device),
                    "reserved_bytes": self.held(device) - self.resident(device),
                }
                for device in devices
            }
        return state


class Budget(Protocol):
    """What a registry asks of its memory budget: its own (:class:`LocalBudget`), or the
    supervisor's, one for every worker (``server/processes/tree_budget.py``)."""

    gpus: bool
    """Whether a load's GPU memory is measured (a GPU budget is set)."""

    async def admit(self, key: Key, isolated: bool) -> Admission:
        """Make room for ``key``'s load (evicting the least recently used idle versions
        first), and hold its estimate until :meth:`measured` or :meth:`cancel`."""
        ...

    async def measured(self, admission: Admission, cost: Cost, totals: dict[str, int]) -> None:
        """The load is done and costs ``cost`` (``totals``: each GPU's size, as read):
        account it, evict again if it overshot."""
        ...

    async def cancel(self, admission: Admission) -> None:
        """The load failed: its estimate is given back."""
        ...

    async def gone(self, key: Key) -> None:
        """``key`` is no longer loaded here (evicted, unloaded)."""
        ...

    def describe(self) -> dict[str, Any] | None:
        """``/admin/status``'s ``memory``; ``None`` where the supervisor keeps the budget."""
        ...


class Evictable(Protocol):
    """The registry, as a :class:`LocalBudget` sees it."""

    def evictable(self) -> list[tuple[float, Key, bool]]: ...

    async def evict(self, key: Key, reason: str, only_idle: bool = False) -> Any: ...


class LocalBudget:
    """The budget of a server in one process: its registry's versions."""

    def __init__(self, limit: int, gpu_limit: int | float, registry: Evictable) -> None:
        self.ledger: Ledger[Key] = Ledger(limit, gpu_limit)
        self.gpus = self.ledger.gpus
        self.registry = registry

    async def admit(self, key: Key, isolated: bool) -> Admission:
        room = {} if key in self.ledger.cost else self.ledger.estimate(key)
        await self._make_room(room, keep=key, reason="room")
        return Admission(key, self.ledger.reserve(room))

    async def measured(self, admission: Admission, cost: Cost, totals: dict[str, int]) -> None:
        self.ledger.totals.update(totals)
        self.ledger.measured(admission.key, admission.key, cost, admission.ticket)
        await self._make_room({}, keep=admission.key, reason="overshoot")

    async def cancel(self, admission: Admission) -> None:
        self.ledger.reserved.pop(admission.ticket, None)

    async def gone(self, key: Key) -> None:
        self.ledger.cost.pop(key, None)

    def describe(self) -> dict[str, Any]:
        return self.ledger.describe(lambda key: {"plugin": label(key)})

    async def _make_room(self, room: Cost, keep: Key, reason: str) -> None:
        if not self.ledger.over(room):
            return
        idle = [(used, key) for used, key, busy in self.registry.evictable() if not busy]
        for key in self.ledger.victims([c for c in idle if c[1] != keep], room):
            await self.registry.evict(key, reason, only_idle=True)


def label(key: Key) -> str:
    return f"{key[0]}/{key[1]}@{key[2]}"
