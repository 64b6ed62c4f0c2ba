"""A rollout window's figures: requests, errors and latency by variant, and the shadow
comparisons; kept by each process, merged across workers and replicas by adding.

What counts is what the version does, never what a client chooses: a request refused
with a 4xx (bad input, a limit, a client that hung up) is the request's fault and is
only tallied as ``refused``; a 5xx or a timeout is the version's failure; the latency
of successful requests is its speed. Each variant's requests are kept in cohorts by
the key that placed them (:func:`cohort_of`), so that the gates can leave out the
cohort one client filled.

Latency goes into a log-scale histogram (buckets 2^(1/8) apart, about 9 % wide, from
10 µs to well past an hour) so that windows merge exactly and a percentile is read
from the merged counts, within one bucket.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from plugserve.registry.routing.variants import key_hash

_BASE_S = 1e-5
_PER_DOUBLING = 8
_BUCKETS = 8 * 29  # 10 µs * 2**29 = 5,368 s
_LOG_STEP = math.log(2) / _PER_DOUBLING
MAX_OUTPUTS = 64
COHORTS = 16
"""A variant's window is counted in this many cohorts, by the request's sticky key (a
sticky header's value or a sequence id, which place the request: the client's choice), at
random without one. All of one key's requests fall in one cohort, which the gates can
leave out (``gates.py``): one client never decides a window."""
"""Outputs whose largest difference is kept (a model with more: the first 64 seen)."""


def bucket_of(seconds: float) -> int:
    if not seconds > _BASE_S:
        return 0
    return min(int(math.log(seconds / _BASE_S) / _LOG_STEP) + 1, _BUCKETS - 1)


def bucket_seconds(index: int) -> float:
    """A bucket's middle (geometric), the value a percentile in it is read as."""
    if index == 0:
        return _BASE_S
    return _BASE_S * math.exp((index - 0.5) * _LOG_STEP)


@dataclass
class Tally:
    """Requests counted in a window: how many, how many failed (5xx: the server's fault),
    and the latency of those that succeeded."""

    requests: int = 0
    errors: int = 0
    latency: dict[int, int] = field(default_factory=dict)
    """Successful requests by latency bucket (:func:`bucket_of`)."""

    def add(self, other: Tally) -> None:
        self.requests += other.requests
        self.errors += other.errors
        for bucket, count in other.latency.items():
            self.latency[bucket] = self.latency.get(bucket, 0) + count

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def samples(self) -> int:
        """Latencies counted (the successful requests)."""
        return sum(self.latency.values())

    def at_rank(self, rank: int) -> float | None:
        """The ``rank``-th smallest latency (from 1; clamped to the samples), ``None``
        without any."""
        if not self.latency:
            return None
        rank = max(1, rank)
        seen = 0
        for bucket in sorted(self.latency):
            seen += self.latency[bucket]
            if seen >= rank:
                return bucket_seconds(bucket)
        return bucket_seconds(max(self.latency))

    def quantile(self, q: float) -> float | None:
        """The latency below which ``q`` of the successful requests fell (seconds)."""
        return self.at_rank(math.ceil(q * self.samples))

    def above(self, seconds: float) -> int:
        """Latencies counted in buckets above the one of ``seconds``."""
        edge = bucket_of(seconds)
        return sum(count for bucket, count in self.latency.items() if bucket > edge)

    def summary(self) -> dict[str, Any]:
        p50, p99 = self.quantile(0.5), self.quantile(0.99)
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": round(self.error_rate, 6),
            "p50_ms": None if p50 is None else round(p50 * 1000, 3),
            "p99_ms": None if p99 is None else round(p99 * 1000, 3),
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "latency": {str(k): v for k, v in self.latency.items()},
        }

    @classmethod
    def from_json(cls, raw: Any) -> Tally:
        """From :meth:`as_json`, as another process sent it; raises ``ValueError``."""
        if not isinstance(raw, dict):
            raise ValueError("a tally must be an object")
        latency = raw.get("latency", {})
        if not isinstance(latency, dict):
            raise ValueError("latency must be an object")
        return cls(
            _count(raw.get("requests")),
            _count(raw.get("errors")),
            {_bucket(k): _count(v) for k, v in latency.items()},
        )


def cohort_of(key: bytes | None) -> int:
    """The cohort of a request placed by ``key`` (its sticky header or sequence: the
    client's choice), or of one placed at random (``None``: a random cohort)."""
    if key is None:
        return random.randrange(COHORTS)
    return key_hash(key) % COHORTS


@dataclass
class VariantFigures:
    """One variant's requests in a window, counted by cohort (:data:`COHORTS`), and the
    requests it refused (4xx: the request's fault, never the version's, so never gated)."""

    cohorts: dict[int, Tally] = field(default_factory=dict)
    refused: int = 0

    def record(self, status: int, seconds: float, key: bytes | None = None) -> None:
        """A request answered ``status`` after ``seconds``, placed by ``key``: a 4xx is
        refused, a 5xx an error, a success counts its latency."""
        if 400 <= status < 500:
            self.refused += 1
            return
        cohort = cohort_of(key)
        tally = self.cohorts.get(cohort)
        if tally is None:
            tally = self.cohorts[cohort] = Tally()
        tally.requests += 1
        if status >= 500:
            tally.errors += 1
            return
        bucket = bucket_of(seconds)
        tally.latency[bucket] = tally.latency.get(bucket, 0) + 1

    def add(self, other: VariantFigures) -> None:
        self.refused += other.refused
        for cohort, tally in other.cohorts.items():
            self.cohorts.setdefault(cohort, Tally()).add(tally)

    def total(self) -> Tally:
        """Every cohort's requests together."""
        out = Tally()
        for tally in self.cohorts.values():
            out.add(tally)
        return out

    @property
    def requests(self) -> int:
        return sum(t.requests for t in self.cohorts.values())

    @property
    def errors(self) -> int:
        return sum(t.errors for t in self.cohorts.values())

    def quantile(self, q: float) -> float | None:
        """The latency below which ``q`` of the successful requests fell (seconds),
        ``None`` without any."""
        return self.total().quantile(q)

    def summary(self) -> dict[str, Any]:
        return {**self.total().summary(), "refused": self.refused}

    def as_json(self) -> dict[str, Any]:
        return {
            "refused": self.refused,
            "cohorts": {str(k): t.as_json() for k, t in self.cohorts.items()},
        }

    @classmethod
    def from_json(cls, raw: Any) -> VariantFigures:
        """From :meth:`as_json`, as another process sent it; raises ``ValueError``."""
        if not isinstance(raw, dict) or not isinstance(raw.get("cohorts", {}), dict):
            raise ValueError("variant figures must be an object of cohorts")
        cohorts = {}
        for key, tally in raw.get("cohorts", {}).items():
            index = int(key)
            if not 0 <= index < COHORTS:
                raise ValueError(f"cohort {key!r} out of range")
            cohorts[index] = Tally.from_json(tally)
        return cls(cohorts, _count(raw.get("refused")))


@dataclass
class ShadowFigures:
    """The canary's answers to copies of the stable version's requests, compared."""

    compared: int = 0
    agreed: int = 0
    failed: int = 0
    """Copies the canary failed (counted in ``compared``, never agreeing)."""
    skipped: int = 0
    """Copies not run: the canary was not ready here, or the shadow queue was full."""
    largest: dict[str, float] = field(default_factory=dict)
    """The largest difference seen per output (``inf``: shapes or types differ)."""

    def record(self, agreed: bool, differences: dict[str, float], failed: bool = False) -> None:
        self.compared += 1
        if agreed:
            self.agreed += 1
        if failed:
            self.failed += 1
        for name, diff in differences.items():
            if name in self.largest:
                self.largest[name] = max(diff, self.largest[name])
            elif len(self.largest) < MAX_OUTPUTS:
                self.largest[name] = diff

    def add(self, other: ShadowFigures) -> None:
        self.compared += other.compared
        self.agreed += other.agreed
        self.failed += other.failed
        self.skipped += other.skipped
        for name, diff in other.largest.items():
            if name in self.largest or len(self.largest) < MAX_OUTPUTS:
                self.largest[name] = max(diff, self.largest.get(name, diff))

    @property
    def agreement(self) -> float | None:
        return self.agreed / self.compared if self.compared else None

    def summary(self) -> dict[str, Any]:
        agreement = self.agreement
        return {
            "compared": self.compared,
            "agreed": self.agreed,
            "failed": self.failed,
            "skipped": self.skipped,
            "agreement": None if agreement is None else round(agreement, 6),
            "largest_difference": {k: _finite(v) for k, v in sorted(self.largest.items())},
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "compared": self.compared,
            "agreed": self.agreed,
            "failed": self.failed,
            "skipped": self.skipped,
            "largest": {k: _finite(v) for k, v in self.largest.items()},
        }

    @classmethod
    def from_json(cls, raw: Any) -> ShadowFigures:
        if not isinstance(raw, dict) or not isinstance(raw.get("largest", {}), dict):
            raise ValueError("shadow figures must be an object")
        if len(raw.get("largest", {})) > MAX_OUTPUTS:
            raise ValueError(f"shadow figures name at most {MAX_OUTPUTS} outputs")
        largest = {}
        for name, value in raw.get("largest", {}).items():
            if value is None:
                largest[str(name)] = math.inf
            elif isinstance(value, int | float) and not isinstance(value, bool):
                largest[str(name)] = float(value)
            else:
                raise ValueError("a largest difference must be a number or null")
        return cls(
            _count(raw.get("compared")),
            _count(raw.get("agreed")),
            _count(raw.get("failed")),
            _count(raw.get("skipped")),
            largest,
        )


@dataclass
class WindowFigures:
    """Everything one rollout window counted, in one process or merged."""

    variants: dict[str, VariantFigures] = field(default_factory=dict)
    shadow: ShadowFigures = field(default_factory=ShadowFigures)

    def variant(self, label: str) -> VariantFigures:
        figures = self.variants.get(label)
        if figures is None:
            figures = self.variants[label] = VariantFigures()
        return figures

    def add(self, other: WindowFigures) -> None:
        for label, figures in other.variants.items():
            self.variant(label).add(figures)
        self.shadow.add(other.shadow)

    def summary(self) -> dict[str, Any]:
        return {
            "variants": {k: v.summary() for k, v in sorted(self.variants.items())},
            "shadow": self.shadow.summary(),
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "variants": {k: v.as_json() for k, v in self.variants.items()},
            "shadow": self.shadow.as_json(),
        }

    @classmethod
    def from_json(cls, raw: Any) -> WindowFigures:
        if not isinstance(raw, dict) or not isinstance(raw.get("variants", {}), dict):
            raise ValueError("window figures must be an object")
        if len(raw.get("variants", {})) > MAX_OUTPUTS:
            raise ValueError(f"window figures name at most {MAX_OUTPUTS} variants")
        return cls(
            {str(k): VariantFigures.from_json(v) for k, v in raw.get("variants", {}).items()},
            ShadowFigures.from_json(raw.get("shadow", {})),
        )


class Windows:
    """This process's figures: the current window of each route with a rollout."""

    def __init__(self) -> None:
        self._by_route: dict[str, tuple[str, WindowFigures]] = {}

    def window(self, route: str, key: str) -> WindowFigures:
        """``route``'s figures for window ``key``; a new key starts the route's figures again."""
        held = self._by_route.get(route)
        if held is None or held[0] != key:
            held = self._by_route[route] = (key, WindowFigures())
        return held[1]

    def get(self, route: str, key: str) -> WindowFigures | None:
        held = self._by_route.get(route)
        return held[1] if held is not None and held[0] == key else None

    def keep(self, routes: dict[str, str]) -> None:
        """Forget every window but ``routes``' (route -> current key)."""
        for route in [r for r, (key, _) in self._by_route.items() if routes.get(r) != key]:
            del self._by_route[route]

    def held(self) -> dict[str, tuple[str, WindowFigures]]:
        """Every window held: route -> (key, figures)."""
        return dict(self._by_route)

    def as_json(self) -> dict[str, Any]:
        """Every window held: ``{route: {"key": ..., "figures": ...}}``."""
        return {
            route: {"key": key, "figures": figures.as_json()}
            for route, (key, figures) in self._by_route.items()
        }


def parse_windows(raw: Any) -> dict[str, tuple[str, WindowFigures]]:
    """:meth:`Windows.as_json` as another process sent it; raises ``ValueError``."""
    if not isinstance(raw, dict):
        raise ValueError("windows must be an object")
    out = {}
    for route, item in raw.items():
        if not isinstance(item, dict) or not isinstance(item.get("key"), str):
            raise ValueError(f"{route}: expected key and figures")
        out[str(route)] = (item["key"], WindowFigures.from_json(item.get("figures")))
    return out


def _count(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError("a count must be a non-negative integer")
    return value


def _bucket(key: Any) -> int:
    index = int(key)
    if not 0 <= index < _BUCKETS:
        raise ValueError(f"latency bucket {key!r} out of range")
    return index


def _finite(value: float) -> float | None:
    """JSON has no infinity: ``None`` stands for it (shapes or types differ)."""
    return None if math.isinf(value) or math.isnan(value) else value
