"""Token buckets: per-route request rate limits (``rate_limit = { rps = 50, burst = 100 }``)."""

from __future__ import annotations

import mmap
import os
import struct
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plugserve.registry import checks
from plugserve.registry.shared_files import locked, release

MIN_RPS = 0.001
"""The smallest rate accepted: one request in 1000 s (smaller ones mean "closed")."""
MAX_RPS = 1_000_000.0
MAX_BURST = 1_000_000


@dataclass(frozen=True)
class RateLimit:
    rps: float
    burst: int

    @classmethod
    def parse(cls, raw: Any) -> RateLimit:
        """``{ rps = <requests per second>, burst = <bucket size> }``.

        ``rps`` from :data:`MIN_RPS` to :data:`MAX_RPS`, ``burst`` from 1 to
        :data:`MAX_BURST` (default: ``rps`` rounded down, at least 1). Raises
        :class:`plugserve.registry.checks.ValueProblem` (a ``ValueError``) naming the field.
        """
        if not isinstance(raw, Mapping) or set(raw) - {"rps", "burst"}:
            raise checks.ValueProblem(
                "", "must be a table { rps = <per second>, burst = <requests> }"
            )
        rps = checks.number(raw.get("rps"), "rps", low=MIN_RPS, high=MAX_RPS)
        burst = raw.get("burst", max(1, int(rps)))
        return cls(rps, checks.integer(burst, "burst", low=1, high=MAX_BURST))


class TokenBucket:
    """``burst`` tokens, refilled at ``rps`` a second; each request takes one."""

    def __init__(self, limit: RateLimit, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.clock = clock
        self.tokens = float(limit.burst)
        self.stamp = clock()

    def take(self) -> float:
        """Take a token: 0.0 when granted, else the seconds until one is available."""
        now = self.clock()
        self.tokens = min(self.limit.burst, self.tokens + (now - self.stamp) * self.limit.rps)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.limit.rps


class SharedTokenBucket:
    """A :class:`TokenBucket` whose state the workers of one server share.

    The state (tokens, time of the last refill) lives in a small file that each
    worker maps into memory; a take holds the file's lock (``flock``) for a few
    arithmetic steps. ``time.monotonic`` is the same clock in every process.
    """

    _FORMAT = "ddd"  # tokens, stamp, initialised (1.0)
    _SIZE = struct.calcsize(_FORMAT)

    def __init__(self, limit: RateLimit, path: Path, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.clock = clock
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with locked(fd):
                if os.fstat(fd).st_size < self._SIZE:
                    os.ftruncate(fd, self._SIZE)
                memory = mmap.mmap(fd, self._SIZE)
                if struct.unpack_from(self._FORMAT, memory)[2] != 1.0:
                    struct.pack_into(self._FORMAT, memory, 0, float(limit.burst), clock(), 1.0)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._memory = fd, memory
        weakref.finalize(self, release, fd, memory)

    def take(self) -> float:
        """Take a token: 0.0 when granted, else the seconds until one is available."""
        limit, memory = self.limit, self._memory
        with locked(self._fd):
            tokens, stamp, _ = struct.unpack_from(self._FORMAT, memory)
            now = self.clock()
            tokens = min(limit.burst, tokens + max(0.0, now - stamp) * limit.rps)
            granted = tokens >= 1
            if granted:
                tokens -= 1
            struct.pack_into(self._FORMAT, memory, 0, tokens, now, 1.0)
        return 0.0 if granted else (1 - tokens) / limit.rps


def shared_bucket_path(folder: Path, route: str, limit: RateLimit) -> Path:
    """One file per route and limit: a changed limit starts a full bucket, as in one process."""
    return folder / f"rate-{route}-{limit.rps!r}-{limit.burst}.bucket"
