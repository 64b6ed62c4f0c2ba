"""Token buckets: per-route request rate limits (``rate_limit = { rps = 50, burst = 100 }``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from registry import validation

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
        :class:`~registry.validation.ValueProblem` (a ``ValueError``) naming the field.
        """
        if not isinstance(raw, Mapping) or set(raw) - {"rps", "burst"}:
            raise validation.ValueProblem(
                "", "must be a table { rps = <per second>, burst = <requests> }"
            )
        rps = validation.number(raw.get("rps"), "rps", low=MIN_RPS, high=MAX_RPS)
        burst = raw.get("burst", max(1, int(rps)))
        return cls(rps, validation.integer(burst, "burst", low=1, high=MAX_BURST))


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
