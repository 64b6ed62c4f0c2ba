"""Per runner-version statistics in the shape of Triton's statistics extension.

Cumulative counts and nanoseconds per stage: ``queue`` (waiting for a batch),
``compute_input`` (preprocessors), ``compute_infer`` (the runner),
``compute_output`` (postprocessors); ``success``/``fail`` for whole requests;
per-batch-size execution counts. A reloaded version starts from zero, as in Triton.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

STAGES = ("queue", "compute_input", "compute_infer", "compute_output")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_BATCH_SIZES = 1024
"""Distinct batch sizes with stats of their own (the first seen); other sizes count in the
totals only. A request over ``max_batch_size`` runs alone at its own size: clients choose them."""
# Latency histogram bounds in seconds, from tens of microseconds to tens of seconds.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


@dataclass
class Histogram:
    """Fixed buckets (cumulative counts are derived when exported) and a sum."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.total += value
        self.counts[bisect.bisect_left(self.bounds, value)] += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, count in zip(
            [*(str(float(b)) for b in self.bounds), "+Inf"], self.counts, strict=True
        ):
            running += count
            out.append((bound, running))
        return out


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * 1e9)

    def as_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class RunnerStats:
    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    stages: dict[str, _Duration] = field(default_factory=lambda: {s: _Duration() for s in STAGES})
    cache_hit: _Duration = field(default_factory=_Duration)
    """Requests answered from the response cache; ``ns``: the lookups' time."""
    cache_miss: _Duration = field(default_factory=_Duration)
    """Requests the response cache did not hold; ``ns``: their lookups and insertions."""
    inference_count: int = 0
    execution_count: int = 0
    batch_fallbacks: int = 0
    """Batches of several requests that failed and ran again one request at a time."""
    fallback_requests: int = 0
    """The requests those batches ran again, each an execution of its own."""
    last_inference_ms: int = 0
    batches: dict[int, _Duration] = field(default_factory=dict)
    batch_sizes: Histogram = field(default_factory=lambda: Histogram(BATCH_BUCKETS))
    latency: dict[str, Histogram] = field(
        default_factory=lambda: {s: Histogram(LATENCY_BUCKETS) for s in STAGES}
    )

    def record_execution(self, rows: int, seconds: float) -> None:
        """One runner execution of ``rows`` rows (a batch)."""
        self.execution_count += 1
        kept = self.batches.get(rows)
        if kept is None and len(self.batches) < MAX_BATCH_SIZES:
            kept = self.batches[rows] = _Duration()
        if kept is not None:
            kept.add(seconds)
        self.batch_sizes.observe(rows)

    def record_fallback(self, requests: int) -> None:
        """A failed batch of ``requests`` requests runs again one request at a time."""
        self.batch_fallbacks += 1
        self.fallback_requests += requests

    def record_request(
        self, ok: bool, seconds: float, timings: dict[str, float], rows: int
    ) -> None:
        (self.success if ok else self.fail).add(seconds)
        if ok:
            self.inference_count += rows
            stages, latency = self.stages, self.latency
            for stage, took in timings.items():  # once a request: no method call a stage
                kept = stages.get(stage)
                if kept is None:
                    continue
                kept.count += 1
                kept.ns += int(took * 1e9)
                histogram = latency[stage]
                histogram.total += took
                histogram.counts[bisect.bisect_left(histogram.bounds, took)] += 1
        self.last_inference_ms = int(time.time() * 1000)

    def record_cache_hit(self, seconds: float, lookup: float, rows: int) -> None:
        """A request answered from the response cache: a success without an execution."""
        self.cache_hit.add(lookup)
        self.record_request(True, seconds, {}, rows)

    def executions_json(self) -> dict[str, Any]:
        """The execution side (what a runner process counts) as JSON: :meth:`add_executions`."""
        return {
            "execution_count": self.execution_count,
            "batches": {str(size): [d.count, d.ns] for size, d in self.batches.items()},
            "batch_counts": list(self.batch_sizes.counts),
            "batch_total": self.batch_sizes.total,
            "fallbacks": [self.batch_fallbacks, self.fallback_requests],
        }

    def add_executions(self, doc: dict[str, Any]) -> None:
        """Fold in another process's :meth:`executions_json` (an isolated runner's)."""
        self.execution_count += int(doc["execution_count"])
        for size, (count, ns) in doc["batches"].items():
            kept = self.batches.setdefault(int(size), _Duration())
            kept.count += int(count)
            kept.ns += int(ns)
        for index, count in enumerate(doc["batch_counts"][: len(self.batch_sizes.counts)]):
            self.batch_sizes.counts[index] += int(count)
        self.batch_sizes.total += float(doc["batch_total"])
        batches, requests = doc.get("fallbacks", (0, 0))
        self.batch_fallbacks += int(batches)
        self.fallback_requests += int(requests)

    def as_triton(
        self, name: str, version: str, executions: RunnerStats | None = None
    ) -> dict[str, Any]:
        """One entry of Triton's ``model_stats`` list; ``executions``: the execution side
        counted elsewhere (an isolated runner's processes)."""
        ran = executions or self
        inference = {"success": self.success.as_json(), "fail": self.fail.as_json()}
        inference.update({stage: self.stages[stage].as_json() for stage in STAGES})
        inference["cache_hit"] = self.cache_hit.as_json()
        inference["cache_miss"] = self.cache_miss.as_json()
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": ran.execution_count,
            "inference_stats": inference,
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": {"count": d.count, "ns": 0},
                    "compute_infer": d.as_json(),
                    "compute_output": {"count": d.count, "ns": 0},
                }
                for size, d in sorted(ran.batches.items())
            ],
        }
