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

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from plugserve.registry.routing.records import VersionRecord

Key = tuple[str, str, str]

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


@dataclass
class MemoryBudget:
    """The budget, the measured cost of each resident version, and their use."""

    limit: int
    cost: dict[Key, int] = field(default_factory=dict)
    """Resident versions: their measured bytes."""
    known: dict[Key, int] = field(default_factory=dict)
    """Every version measured once: its bytes (the estimate of its next load)."""
    evictions: int = 0

    @property
    def resident_bytes(self) -> int:
        return sum(self.cost.values())

    def estimate(self, key: Key) -> int:
        """What loading ``key`` will cost: its last measure, else the mean of the others."""
        if key in self.known:
            return self.known[key]
        return sum(self.known.values()) // len(self.known) if self.known else 0

    def measured(self, key: Key, nbytes: int) -> None:
        self.cost[key] = self.known[key] = max(nbytes, 0)

    def gone(self, key: Key) -> None:
        self.cost.pop(key, None)

    def victims(self, records: Iterable[VersionRecord], room: int, keep: Key | None) -> list[Key]:
        """Versions to evict, least recently used first, until ``room`` more bytes fit:
        loaded on demand, not pinned, idle (nothing in flight or queued), not ``keep``."""
        candidates = []
        for record in records:
            current = record.current
            key = record.key
            if current is None or key not in self.cost or key == keep or not record.on_demand:
                continue
            runner = current.manifest.runner
            if runner is not None and runner.pinned:
                continue
            if current.in_flight or current.queued or record.draining:
                continue
            candidates.append((current.last_use, key))
        candidates.sort()
        chosen, freed = [], 0
        over = self.resident_bytes + room - self.limit
        for _, key in candidates:
            if freed >= over:
                break
            chosen.append(key)
            freed += self.cost[key]
        return chosen
