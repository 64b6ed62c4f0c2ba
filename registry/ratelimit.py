"""Token buckets: per-route request rate limits (``rate_limit = { rps = 50, burst = 100 }``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RateLimit:
    rps: float
    burst: int

    @classmethod
    def parse(cls, raw: Any) -> RateLimit:
        """``{ rps = <requests per second>, burst = <bucket size> }``; raises ``ValueError``."""
        if not isinstance(raw, Mapping) or set(raw) - {"rps", "burst"}:
            raise ValueError("must be a table { rps = <per second>, burst = <requests> }")
        rps = raw.get("rps")
        if isinstance(rps, bool) or not isinstance(rps, int | float) or rps <= 0:
            raise ValueError("rps must be a number > 0")
        burst = raw.get("burst", max(1, int(rps)))
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise ValueError("burst must be an integer >= 1")
        return cls(float(rps), burst)


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
