"""The memory budget's accounts: what each resident version costs, the estimates held
for loads under way, what each process holding versions uses beyond them, and which idle
versions to evict when there is not room (:class:`Ledger`). A single process's budget
(``budget.py``) and the supervisor's, for a tree of workers
(``server/processes/tree_budget.py``), both keep one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from plugserve.registry.errors import PluginLoadError

Key = tuple[str, str, str]
E = TypeVar("E", bound=Hashable)

MIB = 1 << 20
HOST = "memory"
Cost = dict[str, int]
"""Bytes by resource: ``"memory"`` (the machine's) and ``"cuda:N"`` (a GPU's)."""
ALONE = ""
"""The group of an entry measured by itself (an isolated runner's processes)."""


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


def label(key: Key) -> str:
    return f"{key[0]}/{key[1]}@{key[2]}"
