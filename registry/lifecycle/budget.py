"""A memory budget for runner versions that load on demand: what each costs, measured, and
which idle ones go first when a load needs room.

A version's cost is measured once it has loaded: for an isolated runner, the resident
memory of its runner processes (all of it comes back when they end); in the worker, how
much the worker's resident memory grew during the load. The least recently used idle
versions that load on demand (``load = "on_demand"``, not ``pinned``) are evicted first:
back to ``available``, loaded again by their next request. Recency is the stamp each
instance takes when a request enters it (:attr:`LoadedPlugin.last_use`, a counter, no
clock on the request path).
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


@dataclass
class Admission:
    """A load let in by the budget: room was made for its estimate, held until measured."""

    key: Key
    ticket: int
    reserved: int


@dataclass
class Ledger(Generic[E]):
    """The budget's accounts: the measured bytes of what is resident (by entry: a version,
    or in a tree of workers a version in one worker or in the shared runner processes),
    the estimates held for loads under way, and each version's last measure."""

    limit: int
    cost: dict[E, int] = field(default_factory=dict)
    reserved: dict[int, int] = field(default_factory=dict)
    """Loads under way (by ticket): their estimates, counted until measured."""
    known: dict[Key, int] = field(default_factory=dict)
    """Every version measured once: its bytes (the estimate of its next load)."""
    _tickets: Iterator[int] = field(default_factory=lambda: itertools.count(1), repr=False)

    @property
    def resident_bytes(self) -> int:
        return sum(self.cost.values())

    def over(self, room: int) -> int:
        """Bytes beyond the limit once ``room`` more is taken (0 or less: it fits)."""
        return self.resident_bytes + sum(self.reserved.values()) + room - self.limit

    def estimate(self, key: Key) -> int:
        """What loading ``key`` will cost: its last measure, else the mean of the others."""
        if key in self.known:
            return self.known[key]
        return sum(self.known.values()) // len(self.known) if self.known else 0

    def reserve(self, nbytes: int) -> int:
        ticket = next(self._tickets)
        self.reserved[ticket] = nbytes
        return ticket

    def measured(self, key: Key, entry: E, nbytes: int, ticket: int | None = None) -> None:
        if ticket is not None:
            self.reserved.pop(ticket, None)
        self.cost[entry] = self.known[key] = max(nbytes, 0)

    def victims(self, candidates: Iterable[tuple[float, E]], room: int) -> list[E]:
        """Entries to evict, least recently used first, until ``room`` more bytes fit.
        ``candidates``: (last use, entry) of the idle versions that may go."""
        chosen, freed = [], 0
        over = self.over(room)
        for _, entry in sorted(c for c in candidates if c[1] in self.cost):
            if freed >= over:
                break
            chosen.append(entry)
            freed += self.cost[entry]
        return chosen

    def describe(self, label: Callable[[E], dict[str, Any]]) -> dict[str, Any]:
        """``/admin/status``'s ``memory``."""
        return {
            "budget_bytes": self.limit,
            "resident_bytes": self.resident_bytes,
            "reserved_bytes": sum(self.reserved.values()),
            "resident": [
                {**label(entry), "bytes": nbytes}
                for entry, nbytes in sorted(self.cost.items(), key=lambda kv: -kv[1])
            ],
        }


class Budget(Protocol):
    """What a registry asks of its memory budget: its own (:class:`LocalBudget`), or the
    supervisor's, one for every worker (``server/processes/tree_budget.py``)."""

    async def admit(self, key: Key, isolated: bool) -> Admission:
        """Make room for ``key``'s load (evicting the least recently used idle versions
        first), and hold its estimate until :meth:`measured` or :meth:`cancel`."""
        ...

    async def measured(self, admission: Admission, nbytes: int) -> None:
        """The load is done and costs ``nbytes``: account it, evict again if it overshot."""
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

    async def evict(self, key: Key, reason: str) -> Any: ...


class LocalBudget:
    """The budget of a server in one process: its registry's versions."""

    def __init__(self, limit: int, registry: Evictable) -> None:
        self.ledger: Ledger[Key] = Ledger(limit)
        self.registry = registry

    async def admit(self, key: Key, isolated: bool) -> Admission:
        room = 0 if key in self.ledger.cost else self.ledger.estimate(key)
        await self._make_room(room, keep=key, reason="room")
        return Admission(key, self.ledger.reserve(room), room)

    async def measured(self, admission: Admission, nbytes: int) -> None:
        self.ledger.measured(admission.key, admission.key, nbytes, admission.ticket)
        await self._make_room(0, keep=admission.key, reason="overshoot")

    async def cancel(self, admission: Admission) -> None:
        self.ledger.reserved.pop(admission.ticket, None)

    async def gone(self, key: Key) -> None:
        self.ledger.cost.pop(key, None)

    def describe(self) -> dict[str, Any]:
        return self.ledger.describe(lambda key: {"plugin": label(key)})

    async def _make_room(self, room: int, keep: Key, reason: str) -> None:
        if self.ledger.over(room) <= 0:
            return
        idle = [(used, key) for used, key, busy in self.registry.evictable() if not busy]
        for key in self.ledger.victims([c for c in idle if c[1] != keep], room):
            await self.registry.evict(key, reason)


def label(key: Key) -> str:
    return f"{key[0]}/{key[1]}@{key[2]}"
