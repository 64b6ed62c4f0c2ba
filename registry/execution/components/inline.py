"""Whether a synchronous call runs on the event loop: its last costs predict the next one.

A thread hop costs more than a cheap call (waking a worker and then the loop,
100 us or more on a busy 2-core machine). A batched runner's executions
(:class:`ExecutionCosts`) and a processor's calls (:class:`CallCosts`) that
their last costs show cheap for their size run inline; any other goes to a
thread. Past costs speak for the next call only where its cost follows its size: a
processor says so in its manifest (``[processor] cost = "size"``); one that does not
(compressed input: a few bytes can decode to megapixels) always runs on its thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import numpy as np

INLINE_MAX_ROWS = 4
INLINE_MAX_BYTES = 64 * 1024
"""A batch larger than this never runs inline, whatever its rows: its cost is not measured."""
SMALL_COSTS_KEPT = 8
LOOP_BUDGET_S = 0.01
"""In a worker whose runners run on its event loop (:attr:`ExecutionCosts.loop_budget`): the
longest a batch should hold the loop. A batch runs there when none of the runner's last
``LOOP_COSTS_KEPT`` executions took longer, all but ``LOOP_SPIKES_ALLOWED`` of them took at
most a quarter of it, and the batch is at most twice the largest of those: a cost growing
even with the square of the data stays within it."""
LOOP_COSTS_KEPT = 8
LOOP_SPIKES_ALLOWED = 2
"""Executions between a quarter of the budget and all of it that do not send the next
batches to the thread: a busy machine deschedules a thread now and then, mid-batch."""
PROCESS_BUDGET_S = 0.002
"""The longest a synchronous processor call (``process``, ``format``) should hold the event
loop. A call runs there when none of the processor's last ``LOOP_COSTS_KEPT`` calls took
longer, all but ``LOOP_SPIKES_ALLOWED`` of them took at most a quarter of it, no call of it
is running on its thread, and the call's size (:func:`call_bytes`) is at most twice the
largest one among those quick calls that succeeded; any other call runs on the processor's
own thread. Only a processor that declares its cost bounded by its size
(``[processor] cost = "size"``) is so predicted."""
CALL_MAX_ELEMENTS = 1024
"""A call handed an array of more texts or objects than this has no measured size: their
lengths are not summed on the event loop."""


class ExecutionCosts:
    """A batched runner's last executions, and whether its next batch runs inline."""

    __slots__ = ("inline_budget", "loop", "loop_budget", "small")

    def __init__(self, inline_budget: float) -> None:
        self.inline_budget = inline_budget
        """Seconds (``inline_budget_us``): a small batch runs inline once the fastest of the
        last ``SMALL_COSTS_KEPT`` small ones took less."""
        self.loop_budget = 0.0
        """Seconds: where a worker has a core of its own (``inline_runners``), batches that
        the last executions say will take at most this long run on its event loop (see
        ``LOOP_BUDGET_S``): no thread hop, and the requests that arrive meanwhile form the
        next batch. 0: off."""
        self.small: deque[float] = deque(maxlen=SMALL_COSTS_KEPT)
        """Seconds of the last small executions (:func:`small`)."""
        self.loop: deque[tuple[int, float]] = deque(maxlen=LOOP_COSTS_KEPT)
        """(bytes, seconds) of the last executions, while :attr:`loop_budget` is set."""

    def runs_inline(self, inputs: Mapping[str, np.ndarray]) -> bool:
        """Run a batch on the event loop when it has proven cheap.

        Batches of at most ``INLINE_MAX_ROWS`` rows and ``INLINE_MAX_BYTES`` run inline
        once the fastest of the last eight such batches took less than the runner's
        ``inline_budget_us``; anything larger or slower stays off the loop. With a
        :attr:`loop_budget`, a batch of numbers also runs inline as ``LOOP_BUDGET_S`` says:
        a fixed cost, or one growing with the square of the data, stays within the budget;
        one execution over it sends the next eight to the thread; a batch of strings is
        never predicted.
        """
        known = self.loop
        if self.loop_budget and len(known) == LOOP_COSTS_KEPT:
            quarter = self.loop_budget / 4
            fast = [seen for seen, took in known if took <= quarter]
            size = numeric_bytes(inputs)
            if (
                len(fast) >= LOOP_COSTS_KEPT - LOOP_SPIKES_ALLOWED
                and all(took <= self.loop_budget for _, took in known)
                and 0 < size <= 2 * max(fast)
            ):
                return True
        costs = self.small
        if len(costs) < SMALL_COSTS_KEPT or min(costs) > self.inline_budget:
            return False
        return small(inputs)

    def record(self, inputs: Mapping[str, np.ndarray], took: float) -> None:
        """An execution of ``inputs`` took ``took`` seconds (inline or on a thread)."""
        if self.loop_budget:
            self.loop.append((numeric_bytes(inputs), took))
        if small(inputs):
            # The least of the last few: a run on a worker thread also counts
            # its wait for the GIL, which says nothing about the work itself.
            self.small.append(took)


class CallCosts:
    """A synchronous processor's last calls, and whether its next call runs inline."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: deque[tuple[int, float]] = deque(maxlen=LOOP_COSTS_KEPT)
        """(call bytes, seconds) of the last calls; 0 bytes for a call that failed."""

    def runs_inline(self, size: int | None, busy: bool) -> bool:
        """Whether a call of ``size`` bytes (:func:`call_bytes`) runs on the event loop
        (``PROCESS_BUDGET_S``): never while a call runs on the processor's thread (``busy``),
        nor for a call of unknown size."""
        known = self.calls
        if busy or size is None or len(known) < LOOP_COSTS_KEPT:
            return False
        quarter = PROCESS_BUDGET_S / 4
        fast = 0
        largest = -1
        for seen, took in known:
            if took > PROCESS_BUDGET_S:
                return False
            if took <= quarter:
                fast += 1
                largest = max(largest, seen)
        return fast >= LOOP_COSTS_KEPT - LOOP_SPIKES_ALLOWED and size <= 2 * largest

    def record(self, size: int, took: float) -> None:
        """A call of ``size`` bytes took ``took`` seconds (0: it raised; a
        quick refusal says nothing of what a request that size costs when processed)."""
        self.calls.append((size, took))


def call_bytes(data: object, body_bytes: int | None) -> int | None:
    """A processor call's size: its request's bytes (``ctx.body_bytes``) plus those of the
    arrays, bytes and texts it is handed (``data``, or the values of a mapping), which an
    earlier stage may have made far larger than the request (an image decoded from a few
    bytes). ``None`` where unknown: the request's size, or an array of more than
    ``CALL_MAX_ELEMENTS`` objects."""
    if body_bytes is None:
        return None
    values = data.values() if isinstance(data, Mapping) else (data,)
    total = body_bytes
    for value in values:
        if isinstance(value, np.ndarray):
            if value.dtype.kind == "O":
                if value.size > CALL_MAX_ELEMENTS:
                    return None
                total += sum(len(v) for v in value.flat if isinstance(v, bytes | str))
            total += value.nbytes
        elif isinstance(value, bytes | bytearray | memoryview | str):
            total += len(value)
    return total


def numeric_bytes(inputs: Mapping[str, np.ndarray]) -> int:
    """The bytes of a batch's tensors; 0 where one holds text or objects (BYTES, numpy
    strings): their size does not say their cost."""
    total = 0
    for array in inputs.values():
        if array.dtype.kind not in "biufc":
            return 0
        total += array.nbytes
    return total


def small(inputs: Mapping[str, np.ndarray]) -> bool:
    """Whether a batch is small enough for a measured cost to speak for it: at most
    ``INLINE_MAX_ROWS`` rows and ``INLINE_MAX_BYTES`` of data, BYTES elements counted."""
    if rows(inputs) > INLINE_MAX_ROWS:
        return False
    total = 0
    for array in inputs.values():
        total += array.nbytes
        if array.dtype.kind == "O":
            if array.size > INLINE_MAX_BYTES // 8:
                return False
            total += sum(len(v) for v in array.flat if isinstance(v, bytes | str))
        if total > INLINE_MAX_BYTES:
            return False
    return True


def rows(inputs: Mapping[str, np.ndarray]) -> int:
    """The rows of a request or batch: its first tensor's first dimension (1 for a scalar)."""
    for value in inputs.values():
        return int(value.shape[0]) if value.ndim else 1
    return 0
