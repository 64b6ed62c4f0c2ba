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

:class:`Ledger` keeps the accounts; :class:`LocalBudget` is a single process's budget; a
worker among several asks its supervisor's (``server/processes/tree_budget.py``).
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
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import structlog

from plugserve.registry.errors import PluginLoadError

log = structlog.get_logger("plugserve.registry")

Key = tuple[str, str, str]
E = TypeVar("E", bound=Hashable)

MIB = 1 << 20
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


SAMPLE_S = 0.25
"""How often a budget reads the resident memory of the processes that hold its versions."""
RESERVATION_SLACK_S = 30.0
"""How long past its load's bound (``load_timeout_s``) a load's estimate is held at most."""
ALONE = ""
"""The group of an entry measured by itself (an isolated runner's processes)."""


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


@dataclass
class Ledger(Generic[E]):
    """The budget's accounts: the cost of what is resident (by entry: a version, or in a
    tree of workers a version in one worker or in the shared runner processes), the
    estimates held for loads under way, what each process holding versions uses beyond
    them, and each version's last measure.

    An entry and a reservation belong to a group, the process their memory is in (a
    worker), or to :data:`ALONE` (measured by itself). ``limit`` bounds the machine's
    memory (0: no bound), ``gpu_limit`` each GPU's: bytes, or a share of its total (a
    float, resolved by ``totals``, the devices' sizes as last read); 0: no bound."""

    limit: int
    gpu_limit: int | float = 0
    totals: dict[str, int] = field(default_factory=dict)
    cost: dict[E, Cost] = field(default_factory=dict)
    group: dict[E, str] = field(default_factory=dict)
    reserved: dict[int, Cost] = field(default_factory=dict)
    """Loads under way (by ticket): their estimates, counted until measured."""
    refusing: set[int] = field(default_factory=set)
    """Loads refused as larger than the whole budget, their instances being let go (by
    ticket): their reservations hold their measures, so that a reading attributes that
    memory to them, and count toward no eviction (it goes back on its own)."""
    holds: dict[int, tuple[str, float]] = field(default_factory=dict)
    """Each reservation's group, and when it lapses (``time.monotonic()``)."""
    unattributed: dict[str, int] = field(default_factory=dict)
    """By group: resident memory beyond its entries' costs and its loads' estimates."""
    known: dict[Key, Cost] = field(default_factory=dict)
    """Every version measured once: its cost."""
    peak: dict[Key, Cost] = field(default_factory=dict)
    """Versions in a process with others (a group): what each held as it last served, its
    cost and its share of the process's unattributed memory (:meth:`frees`), read at each
    reading once it has served; its next load's estimate."""
    first_use: dict[int, E] = field(default_factory=dict)
    """Reservations kept past a load's measure (by ticket): what its estimate holds beyond
    the measure, for the memory the version takes as it serves its first requests, held
    until a reading after its first request (:meth:`served`) or its eviction."""
    keys: dict[E, Key] = field(default_factory=dict)
    sure: dict[Key, Cost] = field(default_factory=dict)
    """Versions measured by themselves (alone in their process, or in processes of their
    own): the least each costs, which may refuse it."""
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

    def attributed(self, resource: str = HOST) -> int:
        return sum(c.get(resource, 0) for c in self.cost.values())

    def resident(self, resource: str = HOST) -> int:
        """What the resident versions use: their costs, and on the machine's memory what
        their processes hold beyond them."""
        extra = sum(self.unattributed.values()) if resource == HOST else 0
        return self.attributed(resource) + extra

    def held(self, resource: str) -> int:
        """Resident and reserved (but for refused loads being let go)."""
        return self.resident(resource) + sum(
            c.get(resource, 0) for t, c in self.reserved.items() if t not in self.refusing
        )

    def over(self, room: Cost) -> dict[str, int]:
        """The bounded resources that ``room`` more would overflow, with the bytes over."""
        resources = {r for c in [room, *self.cost.values(), *self.reserved.values()] for r in c}
        if self.unattributed:
            resources.add(HOST)
        over = {}
        for resource in resources:
            limit = self.limit_of(resource)
            if limit is not None:
                beyond = self.held(resource) + room.get(resource, 0) - limit
                if beyond > 0:
                    over[resource] = beyond
        return over

    def refusal(self, key: Key, least: int = 0) -> PluginLoadError | None:
        """Why ``key`` cannot be loaded under the budget, known before its load: its own
        measure, or its model files' size (``least``), alone over the whole budget."""
        cost = dict(self.sure.get(key, {}))
        if least > cost.get(HOST, 0):
            cost[HOST] = least
        over = self.alone_over(cost)
        return too_large(key, over, measured=key in self.sure) if over else None

    def alone_over(self, cost: Cost) -> dict[str, tuple[int, int]]:
        """The bounded resources on which ``cost`` alone is over the whole budget: the
        bytes, and the budget."""
        found = {}
        for resource, n in cost.items():
            limit = self.limit_of(resource)
            if limit is not None and n > limit:
                found[resource] = (n, limit)
        return found

    def estimate(self, key: Key, least: int = 0, group: str = ALONE) -> Cost:
        """What loading ``key`` into ``group`` will cost, ``least`` bytes at least (its
        model files). Into a process with others: what it held as it last served there
        (:attr:`peak`: its load and what it took serving), else the mean of the versions'
        peaks. Otherwise (and before any version has served there): its last measure, else
        the others' mean memory (where it will sit on a GPU is not known before its first
        load), and the share of each version there in what the process uses beyond their
        costs (as :meth:`frees` counts it: what versions take as they serve)."""
        if group != ALONE and self.peak:
            if key in self.peak:
                cost = dict(self.peak[key])
            else:
                cost = {HOST: sum(c.get(HOST, 0) for c in self.peak.values()) // len(self.peak)}
            if least > cost.get(HOST, 0):
                cost[HOST] = least
            return cost
        if key in self.known:
            cost = dict(self.known[key])
        elif self.known:
            cost = {HOST: sum(c.get(HOST, 0) for c in self.known.values()) // len(self.known)}
        else:
            cost = {}
        share = self._share(group)
        if share:
            cost[HOST] = cost.get(HOST, 0) + share
        if least > cost.get(HOST, 0):
            cost[HOST] = least
        return cost

    def _share(self, group: str) -> int:
        """Each of ``group``'s entries' equal share of its unattributed memory (those whose
        first use is still held for take none: their reservations explain theirs)."""
        if group == ALONE or not self.unattributed.get(group):
            return 0
        waiting = set(self.first_use.values())
        members = sum(
            1 for e in self.cost if self.group.get(e, ALONE) == group and e not in waiting
        )
        return self.unattributed[group] // max(members, 1)

    def reserve(self, cost: Cost, group: str = ALONE, lapses: float = float("inf")) -> int:
        ticket = next(self._tickets)
        self.reserved[ticket] = cost
        self.holds[ticket] = (group, lapses)
        return ticket

    def release(self, ticket: int) -> None:
        """A load's estimate given back (measured, cancelled, lapsed, served)."""
        self.reserved.pop(ticket, None)
        self.holds.pop(ticket, None)
        self.first_use.pop(ticket, None)
        self.refusing.discard(ticket)

    def lapsed(self, now: float) -> list[int]:
        """The reservations held past their bound: their loads' owners never answered."""
        return [ticket for ticket, (_, lapses) in self.holds.items() if lapses <= now]

    def measured(
        self,
        key: Key,
        entry: E,
        cost: Cost,
        ticket: int | None = None,
        group: str = ALONE,
        sure: bool = True,
    ) -> None:
        """Count ``entry`` at ``cost``; ``sure``: measured by itself (:attr:`sure`). In a
        process with others, what ``ticket``'s estimate holds beyond the measure stays
        reserved for the version's first use (:attr:`first_use`)."""
        self.cost[entry] = self.known[key] = {r: max(n, 0) for r, n in cost.items()}
        self.group[entry] = group
        self.keys[entry] = key
        if sure:
            self.sure[key] = dict(self.cost[entry])
        if ticket is None:
            return
        estimate = self.reserved.get(ticket, {})
        rest = {r: n - self.cost[entry].get(r, 0) for r, n in estimate.items()}
        rest = {r: n for r, n in rest.items() if n > 0}
        if group == ALONE or not rest:
            self.release(ticket)
            return
        self.reserved[ticket] = rest
        self.first_use[ticket] = entry

    def loading(self) -> bool:
        """Whether a load is under way (admitted, not yet measured or refused)."""
        return any(t not in self.first_use and t not in self.refusing for t in self.holds)

    def served(self, entries: Iterable[E]) -> None:
        """``entries`` have served a request: what was held for their first use is given
        back (a reading that follows counts what they took)."""
        done = set(entries)
        for ticket, entry in list(self.first_use.items()):
            if entry in done:
                self.release(ticket)

    def refused(self, key: Key, cost: Cost, ticket: int) -> PluginLoadError | None:
        """If ``cost``, measured by itself, is over the whole budget alone: the error,
        nothing counted (its next load is refused before it begins). ``ticket``'s reservation
        holds the measure until the load's owner has let the instance go (:meth:`release`):
        a reading meanwhile attributes that memory to the load, and evicts nothing for it
        (:attr:`refusing`)."""
        over = self.alone_over(cost)
        if not over:
            return None
        self.reserved[ticket] = dict(cost)
        self.refusing.add(ticket)
        self.known[key] = self.sure[key] = dict(cost)
        return too_large(key, over, measured=True)

    def remeasured(self, key: Key, entry: E, cost: int) -> None:
        """An entry measured by itself, read again as it serves (its next load's estimate
        too)."""
        if entry in self.cost and self.group.get(entry, ALONE) == ALONE:
            self.cost[entry][HOST] = max(cost, 0)
            self.known[key] = dict(self.cost[entry])
            self.sure[key] = dict(self.cost[entry])

    def forget(self, entry: E) -> None:
        self.cost.pop(entry, None)
        self.group.pop(entry, None)
        self.keys.pop(entry, None)
        for ticket, waiting in list(self.first_use.items()):
            if waiting == entry:
                self.release(ticket)

    def sampled(self, group: str, used: int) -> None:
        """``group``'s processes use ``used`` bytes above what they used holding none of
        the budget's versions: what its entries and its loads under way do not explain
        is counted as its own."""
        explained = sum(
            c.get(HOST, 0) for e, c in self.cost.items() if self.group.get(e, ALONE) == group
        )
        explained += sum(
            self.reserved[t].get(HOST, 0) for t, (g, _) in self.holds.items() if g == group
        )
        beyond = used - explained
        if beyond > 0:
            self.unattributed[group] = beyond
        else:
            self.unattributed.pop(group, None)
        if group == ALONE:
            return
        waiting = set(self.first_use.values())
        for entry in self.cost:
            if self.group.get(entry) == group and entry not in waiting and entry in self.keys:
                self.peak[self.keys[entry]] = self.frees(entry)

    def frees(self, entry: E) -> Cost:
        """What evicting ``entry`` is expected to free: its cost, and an equal share of
        what its process uses beyond its entries' costs, or what is held for its first
        use (given back with it)."""
        cost = dict(self.cost[entry])
        held = [self.reserved[t] for t, e in self.first_use.items() if e == entry]
        if held:
            for rest in held:
                for resource, n in rest.items():
                    cost[resource] = cost.get(resource, 0) + n
            return cost
        share = self._share(self.group.get(entry, ALONE))
        if share:
            cost[HOST] = cost.get(HOST, 0) + share
        return cost

    def victims(self, candidates: Iterable[tuple[float, E]], room: Cost) -> list[E]:
        """Entries to evict, least recently used first, until ``room`` more fits on every
        bounded resource (:meth:`frees`; an entry that frees nothing where room is short
        stays). ``candidates``: (last use, entry) of the idle versions that may go."""
        chosen = []
        over = self.over(room)
        for _, entry in sorted(c for c in candidates if c[1] in self.cost):
            if not over:
                break
            cost = self.frees(entry)
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
            "unattributed_bytes": sum(self.unattributed.values()),
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


def too_large(key: Key, over: dict[str, tuple[int, int]], measured: bool) -> PluginLoadError:
    """The error of a version whose cost alone is over the whole budget."""
    what = "measured at" if measured else "its model files take"
    parts = [
        f"{n / MIB:.0f} MiB of {'memory' if r == HOST else r}, more than the whole "
        f"{'memory_budget' if r == HOST else 'gpu_memory_budget'} ({limit / MIB:.0f} MiB)"
        for r, (n, limit) in sorted(over.items())
    ]
    return PluginLoadError(
        f"{label(key)} is not served under this budget: {what} {'; '.join(parts)}: raise "
        'the budget, or load it eagerly (load = "eager": counted by no budget)'
    )


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


def label(key: Key) -> str:
    return f"{key[0]}/{key[1]}@{key[2]}"
