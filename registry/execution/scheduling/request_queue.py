"""The requests queued for one runner instance, and the order they leave in.

Order: priority level first (1 highest), then start-time fair queueing between tenants,
each request tagged with its tenant's virtual start time (weighted by the policy's
``tenant_weights``), so one tenant's burst cannot starve another; arrival breaks ties.
A request whose deadline passed while queued gets its 504 here, and one whose caller gave
up leaves at once.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from plugserve.registry.errors import DeadlineExceeded, Unavailable
from plugserve.registry.execution import tracing

Arrays = Mapping[str, np.ndarray]
MAX_TENANTS_KEPT = 1024
"""Past this many tenants' finish tags, only those of tenants still queued are kept."""


@dataclass(eq=False, slots=True)
class Pending:
    """One queued request."""

    inputs: Arrays
    rows: int
    signature: tuple[Any, ...] | None
    arrival: float
    deadline: float | None
    level: int
    tag: float
    seq: int
    future: asyncio.Future[Arrays]
    timings: dict[str, float] | None = None
    span: Any = None  # the "queue" span, while tracing
    tenant: str = ""

    def key(self) -> tuple[int, float, int]:
        return (self.level, self.tag, self.seq)


class RequestQueue:
    """The queued requests of one runner instance, with the virtual time and the tenants'
    finish tags that order them: requests join (:meth:`add`), leave in batches
    (:meth:`take`), on their deadline or their caller's hang-up, or all at once when the
    runner goes (:meth:`close`)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._requests: list[Pending] = []
        self._seq = itertools.count()
        self._vtime = 0.0
        self._tenant_finish: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(
        self,
        inputs: Arrays,
        rows: int,
        signature: tuple[Any, ...] | None,
        arrival: float,
        deadline: float | None,
        level: int,
        tenant: str | None,
        weights: Mapping[str, float],
        future: asyncio.Future[Arrays],
        timings: dict[str, float] | None,
    ) -> Pending:
        """Queue a request, tagged with its tenant's virtual start time; the tenant's next
        request starts after this one's rows, divided by the tenant's weight."""
        name = tenant or ""
        start = max(self._vtime, self._tenant_finish.get(name, 0.0))
        self._tenant_finish[name] = start + max(rows, 1) / weights.get(name, 1.0)
        seq = next(self._seq)
        request = Pending(
            inputs, rows, signature, arrival, deadline, level, start, seq, future, timings
        )
        request.tenant = name
        if tracing.TRACER is not None:
            request.span = tracing.TRACER.start_span("queue", attributes={"plugserve.rows": rows})
        self._requests.append(request)
        return request

    def remove(self, future: asyncio.Future[Arrays]) -> None:
        """A queued request's caller gave up (its client hung up): it leaves the queue now,
        freeing its place, and never runs. One already in a batch runs with the batch."""
        for index, request in enumerate(self._requests):
            if request.future is future:
                del self._requests[index]
                if request.span is not None:
                    request.span.end()
                return

    def drop_finished(self, now: float) -> None:
        """Drop the requests cancelled by their clients, and answer those whose deadline
        passed with a 504."""
        keep = []
        for request in self._requests:
            if request.future.done():  # cancelled by its client (disconnect, deadline)
                continue
            if request.deadline is not None and now >= request.deadline:
                request.future.set_exception(
                    DeadlineExceeded(f"the request's deadline passed while queued for {self.label}")
                )
                continue
            keep.append(request)
        self._requests = keep

    def ordered(self) -> list[Pending]:
        """The queued requests in the order they leave."""
        return sorted(self._requests, key=Pending.key)

    def take(self, batch: list[Pending], now: float) -> None:
        """``batch`` leaves the queue at ``now`` (its requests' ``queue`` wait is timed):
        the virtual time moves to its latest tag."""
        taken = set(map(id, batch))
        self._requests = [r for r in self._requests if id(r) not in taken]
        for request in batch:
            if request.timings is not None:
                request.timings["queue"] = now - request.arrival
            if request.span is not None:
                request.span.end()
        self._vtime = max(self._vtime, max(r.tag for r in batch))
        if len(self._tenant_finish) > MAX_TENANTS_KEPT:
            # Keep the tags that still order something: those of tenants with requests queued.
            # (Every request naming a new tenant starts at the virtual time, which then never
            # moves past their finish tags: without this the table grows with each name.)
            queued = {r.tenant for r in self._requests}
            self._tenant_finish = {
                t: f for t, f in self._tenant_finish.items() if f > self._vtime and t in queued
            }

    def close(self) -> None:
        """Fail every queued request with a 503: the runner was unloaded."""
        for request in self._requests:
            if not request.future.done():
                request.future.set_exception(Unavailable(f"runner {self.label} was unloaded"))
        self._requests = []
