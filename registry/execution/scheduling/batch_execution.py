"""One batch's execution for a runner instance, and what follows a failed one.

A batch's requests are merged into one execution; each request gets its own slice of the
outputs. A batch of several that fails (the runner refuses it with
:class:`~plugserve.registry.errors.InvalidInput`, or raises anything else but its own 503 or
504, which say "not now" about no request) is run again one request at a time
(:func:`runs_again`), so only the requests at fault fail and their batch-mates get their
answers; a request whose deadline passed meanwhile gets 504 without running again, and once
the runner's circuit opens (``stop``) the rest get its 503. Only an execution of one request
says whose fault a failure is: ``on_failure`` hears each such failure. Every batch run
again one request at a time is counted (``on_fallback``), and the first one is logged.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
import structlog

from plugserve.registry.errors import DeadlineExceeded, PluginError, PlugserveError
from plugserve.registry.execution import tracing
from plugserve.registry.execution.layout import BatchLayout
from plugserve.registry.execution.scheduling.batch_cutting import merge, split
from plugserve.registry.execution.scheduling.request_queue import Pending

log = structlog.get_logger("plugserve.batching")

Arrays = Mapping[str, np.ndarray]
Execute = Callable[[Arrays], Awaitable[Arrays]]


class BatchExecution:
    """Executes the batches of one runner instance: merges a batch's inputs, runs them,
    answers each request with its slice, and runs a failed batch again one request at a
    time; counts the executions and their rows, and reports failures and fallbacks."""

    def __init__(
        self,
        execute: Execute,
        label: str,
        clock: Callable[[], float] = time.monotonic,
        on_execution: Callable[[int, float], None] | None = None,
        on_failure: Callable[[Exception], None] | None = None,
        stop: Callable[[], Exception | None] = lambda: None,
        on_fallback: Callable[[int], None] | None = None,
    ) -> None:
        self.execute = execute
        self.label = label
        self.clock = clock
        self.on_execution = on_execution
        self.on_failure = on_failure
        """Hears every failed execution of one request (alone, or retried alone)."""
        self.on_fallback = on_fallback
        """Hears every failed batch that runs again one request at a time (its requests)."""
        self.fallback_why: str | None = None
        """Why the latest such batch failed."""
        self._fallback_said = False
        self.stop = stop
        """Why the rest of a failed batch must not run again (the runner's circuit opened
        during its retries), or ``None``."""
        self.executions = 0
        self.rows = 0
        self.layout: BatchLayout | None = None
        """The runner's declared batching (``[runner.batching]``); ``None``: every row on
        axis 0 (:func:`~plugserve.registry.execution.scheduling.batch_cutting.signature`)."""

    def _fed(self, inputs: Arrays) -> Arrays:
        """What the runner gets for one request alone."""
        layout = self.layout
        return inputs if layout is None or not layout.reshapes else layout.merge([inputs])

    def _merge(self, batch: list[Pending]) -> tuple[Arrays, int]:
        """The batch's inputs as one (rows concatenated), counted as an execution."""
        rows = sum(r.rows for r in batch)
        merged = merge(self.layout, batch)
        self.executions += 1
        self.rows += rows
        return merged, rows

    def _span(self, batch: list[Pending], rows: int) -> Any:
        """The "batch" span, linked to its requests' queue spans, while tracing."""
        if tracing.TRACER is None:
            return contextlib.nullcontext()
        links = [tracing.link(r.span.get_span_context()) for r in batch if r.span is not None]
        return tracing.TRACER.start_as_current_span(
            "batch",
            context=tracing.ROOT,
            links=links,
            attributes={"plugserve.rows": rows, "plugserve.requests": len(batch)},
        )

    def _executed(self, batch: list[Pending], rows: int, started: float, outputs: Arrays) -> None:
        """A batch ran: each request gets its slice. Outputs that cannot be split (not a
        row per input row) fail every request of the batch: the runner's answer is wrong,
        whoever's rows it had."""
        if self.on_execution is not None:
            self.on_execution(rows, self.clock() - started)
        try:
            split(self.layout, self.label, batch, rows, outputs)
        except PluginError as exc:
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(_fresh(exc))

    def _report(self, exc: Exception) -> None:
        if self.on_failure is not None:
            self.on_failure(exc)

    def _fail_all(self, batch: list[Pending], exc: Exception) -> None:
        """A batch that is not run again failed: each request gets ``exc``; one request
        alone is reported (:attr:`on_failure`), a batch of several is not."""
        if len(batch) == 1:
            self._fail(batch[0], exc)
            return
        for request in batch:
            if not request.future.done():
                request.future.set_exception(_fresh(exc))

    def _fail(self, request: Pending, exc: Exception) -> None:
        """An execution of ``request`` alone failed: reported, and its answer."""
        self._report(exc)
        if not request.future.done():
            request.future.set_exception(_fresh(exc))  # a runner may raise one object again

    def _fell_back(self, batch: list[Pending], exc: Exception) -> None:
        """``batch`` failed and runs again one request at a time: counted (:attr:`on_fallback`),
        its reason kept (:attr:`fallback_why`), and the first such batch logged."""
        why = exc.message if isinstance(exc, PlugserveError) else f"{type(exc).__name__}: {exc}"
        self.fallback_why = why
        if self.on_fallback is not None:
            self.on_fallback(len(batch))
        if not self._fallback_said:
            self._fallback_said = True
            log.warning(
                "batch_fallback",
                runner=self.label,
                requests=len(batch),
                rows=sum(r.rows for r in batch),
                why=why,
                counted="/admin/plugins batch_fallbacks",
                check="plugserve validate --batching",
            )

    async def _one_by_one(self, batch: list[Pending]) -> None:
        """Run each request of a failed batch alone: only the ones at fault fail."""
        for request in batch:
            if request.future.done():
                continue
            refusal = self._not_again(request)
            if refusal is not None:
                request.future.set_exception(refusal)
                continue
            self.executions += 1
            self.rows += request.rows
            started = self.clock()
            try:
                outputs = await self.execute(self._fed(request.inputs))
            except Exception as exc:
                self._fail(request, exc)
                continue
            if self.on_execution is not None:
                self.on_execution(request.rows, self.clock() - started)
            if not request.future.done():
                request.future.set_result(outputs)

    def _not_again(self, request: Pending) -> Exception | None:
        """Why a request of a failed batch does not run again: its deadline passed, or the
        runner's circuit opened; ``None``: it runs."""
        if request.deadline is not None and self.clock() >= request.deadline:
            return DeadlineExceeded(
                f"the request's deadline passed while {self.label} retried its batch"
            )
        return self.stop()


def _fresh(exc: Exception) -> Exception:
    """A separate exception per request, so tracebacks do not pile onto one object."""
    clone = exc.__class__.__new__(exc.__class__)
    clone.args = exc.args
    clone.__dict__.update(getattr(exc, "__dict__", {}))
    clone.__cause__ = exc.__cause__
    return clone


def runs_again(batch: list[Pending], exc: Exception) -> bool:
    """Whether a failed batch runs again one request at a time: one of several requests,
    failing otherwise than with the runner's own 503 or 504."""
    return len(batch) > 1 and getattr(exc, "status", 500) not in (503, 504)
