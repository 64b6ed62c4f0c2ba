"""A memory budget for runner versions that load on demand: what each costs, what the
processes that hold them really use, and which idle ones go first when there is not room.

The budget holds as the process tree measures it. Each version is attributed a cost: for
an isolated runner, the resident memory of its runner processes (read again every
:data:`SAMPLE_S` seconds: all of it comes back when they end); in the worker, its share
of the worker's growth while it loaded (:class:`Growth`: loads side by side split what
grew beside them), never negative and never below its model files' size. What a process
holding versions uses beyond their costs and the loads under way in it (an arena that
grows as a model serves, a plugin that allocates on first use, what the allocator keeps
of an evicted version) is read every :data:`SAMPLE_S` seconds and after each load, and
counted as the process's ``unattributed`` memory. Whenever the count passes the budget,
the least recently used idle versions that load on demand (``load = "on_demand"``, not
``pinned``) are evicted: back to ``available``, loaded again by their next request.
Recency is the time a request last entered each instance (:attr:`LoadedPlugin.last_use`,
``time.monotonic()``: one clock for every process of the machine, so a supervisor can
compare its workers').

Loads run side by side: each is admitted (room made for its estimate, which it holds),
then measured, or cancelled; an estimate not given back within its load's bound plus
:data:`RESERVATION_SLACK_S` lapses. In the worker a version's estimate is what it held
as it last served there (its peak: its cost and its share of the unattributed memory), a
never-seen version's the mean of the others' peaks; once its load is measured, what the
estimate holds beyond the measure stays held for its first use, until a reading after
its first request (or its eviction): the memory it takes serving lands in room already
made. A version whose cost alone is over the budget is refused (:class:`PluginLoadError`
naming ``memory_budget``), before anything is evicted where that is known beforehand
(its last measure, its model files' size).

:class:`Ledger` (``ledger.py``) keeps the accounts; :class:`LocalBudget` is a single
process's budget; a worker among several asks its supervisor's
(``server/processes/tree_budget.py``).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import itertools
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

from plugserve.registry.lifecycle.ledger import ALONE, Cost, Key, Ledger, label

log = structlog.get_logger("plugserve.registry")

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


def _libc(function: str) -> Callable[..., int] | None:
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function, None) if name else None
    except OSError:
        return None


_TRIM = _libc("malloc_trim")
_MALLOPT = _libc("mallopt")
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 20
"""Under a memory budget, allocations of this many bytes or more get mappings of their own."""


def map_large_allocations() -> None:
    """Have glibc give every allocation of :data:`MMAP_THRESHOLD` bytes or more a mapping
    of its own, returned to the system the moment it is freed. Left to itself glibc raises
    that threshold (up to 32 MiB) as large blocks are freed, and a version's weights then
    come from heaps that keep, fragmented, what an evicted version freed: memory the
    budget counts and cannot get back."""
    if _MALLOPT is not None:
        _MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def release_memory() -> None:
    """Give a released version's memory back to the system: collect the reference cycles
    that hold its objects, then ask glibc to return the free pages of its heaps (native
    libraries allocate on many threads' arenas, which keep what they free otherwise)."""
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)


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


SAMPLE_S = 0.25
"""How often a budget reads the resident memory of the processes that hold its versions."""
RESERVATION_SLACK_S = 30.0
"""How long past its load's bound (``load_timeout_s``) a load's estimate is held at most."""


@dataclass
class Admission:
    """A load let in by the budget: room was made for its estimate, held until measured."""

    key: Key
    ticket: int


@dataclass(frozen=True)
class Held:
    """A version loaded on demand, as a budget sees it."""

    key: Key
    last_use: float
    """When a request last entered it (``time.monotonic()``)."""
    busy: bool
    """A request uses, awaits or waits for its load, or a change to it is under way."""
    evictable: bool
    """Not ``pinned``."""
    isolated: bool
    bytes: int | None
    """An isolated runner's processes' resident memory now; ``None`` in the worker."""
    served: bool = True
    """A request has been served by it (the memory its first use takes is resident)."""


class Growth:
    """The growth of this process's resident memory, shared out among the loads under way
    in it: each stretch between two of their starts or ends goes in equal parts to the
    loads open during it, and what the process released meanwhile (an eviction beside
    them) is added back. A load's share is never negative; it is its own measure only if
    no other load was open beside it (else a rough share)."""

    def __init__(self, released: Callable[[], int]) -> None:
        self._released = released
        self._open: dict[int, int] = {}
        self._crowded: set[int] = set()
        self._mark = 0
        self._tokens = itertools.count(1)

    def _settle(self) -> None:
        now = resident() + self._released()
        if self._open:
            share = (now - self._mark) / len(self._open)
            for token in self._open:
                self._open[token] += int(share)
        self._mark = now

    def begin(self) -> int:
        self._settle()
        token = next(self._tokens)
        self._open[token] = 0
        if len(self._open) > 1:
            self._crowded.update(self._open)
        return token

    def end(self, token: int) -> tuple[int, bool]:
        """The load's share of the growth, in bytes (0 at least), and whether it loaded
        alone (the share is then its own measure)."""
        self._settle()
        alone = token not in self._crowded
        self._crowded.discard(token)
        return max(self._open.pop(token, 0), 0), alone


class Budget(Protocol):
    """What a registry asks of its memory budget: its own (:class:`LocalBudget`), or the
    supervisor's, one for every worker (``server/processes/tree_budget.py``)."""

    gpus: bool
    """Whether a load's GPU memory is measured (a GPU budget is set)."""

    async def admit(self, key: Key, isolated: bool, least: int = 0) -> Admission:
        """Make room for ``key``'s load (evicting the least recently used idle versions
        first), and hold its estimate (``least`` bytes at least: its model files) until
        :meth:`measured` or :meth:`cancel`. :class:`PluginLoadError` if it cannot fit
        even alone: nothing evicted, nothing held."""
        ...

    async def measured(
        self, admission: Admission, cost: Cost, totals: dict[str, int], sure: bool = True
    ) -> None:
        """The load is done and costs ``cost`` (``totals``: each GPU's size, as read;
        ``sure``: measured by itself, not a share of what grew beside other loads):
        account it, and evict what it overshot. :class:`PluginLoadError` if a sure measure
        is over the whole budget alone: not counted, its estimate given back, nothing
        evicted."""
        ...

    async def cancel(self, admission: Admission) -> None:
        """The load failed: its estimate is given back."""
        ...

    async def gone(self, key: Key) -> None:
        """``key`` is no longer loaded here (evicted, unloaded)."""
        ...

    async def watch(self) -> None:
        """Read the memory of what the budget counts, and evict what is over, until
        cancelled; returns at once where the supervisor keeps the budget."""
        ...

    def describe(self) -> dict[str, Any] | None:
        """``/admin/status``'s ``memory``; ``None`` where the supervisor keeps the budget."""
        ...


class Holder(Protocol):
    """The registry, as a :class:`LocalBudget` sees it."""

    def budgeted(self) -> list[Held]: ...

    async def evict(self, key: Key, reason: str, only_idle: bool = False) -> Any: ...


IN_PROCESS = "process"
"""The group of the versions loaded in this process."""


class LocalBudget:
    """The budget of a server in one process: its registry's versions, and this process."""

    def __init__(
        self, limit: int, gpu_limit: int | float, registry: Holder, load_timeout_s: float = 120.0
    ) -> None:
        self.ledger: Ledger[Key] = Ledger(limit, gpu_limit)
        self.gpus = self.ledger.gpus
        self.registry = registry
        if limit:
            map_large_allocations()
        self.hold_s = load_timeout_s + RESERVATION_SLACK_S
        self.base: int | None = None
        """This process's resident memory before its first load under the budget."""
        self._deciding = asyncio.Lock()

    async def admit(self, key: Key, isolated: bool, least: int = 0) -> Admission:
        async with self._deciding:
            self._sample()
            if refusal := self.ledger.refusal(key, least):
                raise refusal
            group = ALONE if isolated else IN_PROCESS
            room = {} if key in self.ledger.cost else self.ledger.estimate(key, least, group)
            await self._make_room(room, keep=key, reason="room")
            lapses = time.monotonic() + self.hold_s
            return Admission(key, self.ledger.reserve(room, group, lapses))

    async def measured(
        self, admission: Admission, cost: Cost, totals: dict[str, int], sure: bool = True
    ) -> None:
        self.ledger.totals.update(totals)
        if sure and (refusal := self.ledger.refused(admission.key, cost, admission.ticket)):
            raise refusal
        group = self.ledger.holds.get(admission.ticket, (ALONE, 0.0))[0]
        self.ledger.measured(admission.key, admission.key, cost, admission.ticket, group, sure)
        async with self._deciding:  # what it overshot goes before it serves
            self._sample()
            await self._make_room({}, keep=admission.key, reason="overshoot")

    async def cancel(self, admission: Admission) -> None:
        self.ledger.release(admission.ticket)

    async def gone(self, key: Key) -> None:
        self.ledger.forget(key)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_S)
            try:
                async with self._deciding:
                    self._sample()
                    # A load under way is judged by its measure (what it grew past its
                    # estimate may be a version refused as larger than the whole budget,
                    # which evicts nothing); the measure evicts what is over then.
                    if not self.ledger.loading():
                        await self._make_room({}, keep=None, reason="overshoot")
            except Exception:  # a sample must never end the watch
                log.exception("budget_sample_failed")

    def describe(self) -> dict[str, Any]:
        return self.ledger.describe(lambda key: {"plugin": label(key)})

    def _sample(self) -> None:
        """Read this process's memory and the isolated versions' processes'; give back what
        was held for the first use of versions that have served (read before this
        process's memory, which then holds what they took); let go of the estimates of
        loads past their bound."""
        rows = self.registry.budgeted()
        self.ledger.served(held.key for held in rows if held.served)
        now = resident()
        if self.base is None:
            self.base = now
        for held in rows:
            if held.bytes is not None:
                self.ledger.remeasured(held.key, held.key, held.bytes)
        for ticket in self.ledger.lapsed(time.monotonic()):
            log.warning("budget_reservation_lapsed", ticket=ticket)
            self.ledger.release(ticket)
        self.ledger.sampled(IN_PROCESS, now - self.base)

    async def _make_room(self, room: Cost, keep: Key | None, reason: str) -> None:
        if not self.ledger.over(room):
            return
        idle = [(h.last_use, h.key) for h in self.registry.budgeted()
                if h.evictable and not h.busy and h.key != keep]  # fmt: skip
        for key in self.ledger.victims(idle, room):
            await self.registry.evict(key, reason, only_idle=True)
