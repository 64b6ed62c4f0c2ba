"""Dynamic batching and request scheduling for one runner instance.

Requests queue per runner instance and leave it in batches:

- A batch is sent to a free execution slot (``instances`` of them) when it is
  full (``max_batch_size`` rows), when the oldest queued request has waited
  ``max_queue_delay`` since its arrival, or at once when the runner is idle (no
  execution in flight): a lone request never waits for company. So with one
  instance batches form while the runner is busy, and the delay only matters
  when spare instances could start a small batch early. A ``gather``-ing
  scheduler (a worker whose runner runs on its loop, where no batch forms while
  the runner is busy) cuts an idle runner's batch at the end of the event loop's
  turn instead, once two requests came in one turn: the rest of that turn's
  requests join it. A request alone still runs at once.
- Requests join a batch only when their inputs agree on names, dtypes and
  every dimension after the first; a request larger than ``max_batch_size``
  runs alone. Each response is exactly its own slice of the batch's outputs.
- Each tensor a batch merges its requests into keeps the bounds of one request's
  tensor (:attr:`Scheduler.bounds`: ``max_tensor_elements``, ``max_bytes_elements``),
  counted from shapes as the batch forms: a request that would take one past them
  closes the batch and opens the next, which it fits alone.
- With ``preferred_batch_sizes``, a batch is cut to the largest preferred size
  it can fill.
- Order: priority level first (v2 ``priority``, 1 highest), then start-time
  fair queueing between tenants (weighted by ``tenant_weights``), so one
  tenant's burst cannot starve another; arrival breaks ties.
- The queue is bounded (``max_queue_size``: 429 when full), and a request whose
  deadline passed before it reached execution gets 504 without running. A
  request cancelled while queued (its client hung up) leaves the queue at once.
- A batch of several requests that fails (the runner refuses it with
  :class:`InvalidInput`, or raises anything else but its own 503 or 504, which
  say "not now" about no request) is run again one request at a
  time, so only the requests at fault fail (400 for a refusal) and their
  batch-mates get their answers. (Runners check what they can per request before
  batching, through their ``validate()``, so this is the exception, and its cost
  is paid only on failure.) A request whose deadline passed meanwhile gets 504
  without running again; once the runner's circuit opens (``stop``), the rest get
  its 503 without running.
- Only an execution of one request says whose fault a failure is: ``on_failure``
  hears each such failure (and decides whether the runner's circuit breaker counts
  it); a failed batch of several is not reported, its retries are.
- Every batch run again one request at a time is counted (``on_fallback``: the runner's
  statistics, ``/admin/plugins``), and the first one is logged with its reason: a runner
  that refuses every batch costs an execution more per batch, which must show.

The queue and its order are :mod:`~plugserve.registry.execution.scheduling.request_queue`'s,
cutting a batch :mod:`~plugserve.registry.execution.scheduling.batch_cutting`'s, and running
one (its fallback one request at a time included)
:mod:`~plugserve.registry.execution.scheduling.batch_execution`'s; the :class:`Scheduler` here
admits requests, dispatches the batches due to free execution slots, and closes.

The clock and the timer are injectable, so the policy is tested with a fake clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from plugserve.registry.errors import DeadlineExceeded, TooManyRequests, Unavailable
from plugserve.registry.execution.layout import BatchLayout, TensorBounds, why_apart
from plugserve.registry.execution.scheduling.batch_cutting import cut, signature
from plugserve.registry.execution.scheduling.batch_execution import (
    Arrays,
    BatchExecution,
    Execute,
    runs_again,
)
from plugserve.registry.execution.scheduling.policy import BatchPolicy, priority_level
from plugserve.registry.execution.scheduling.request_queue import Pending, RequestQueue

log = structlog.get_logger("plugserve.batching")

Timer = Callable[[float, Callable[[], None]], Any]
RETRY_AFTER_S = 1
MAX_REASONS_SAID = 16
"""Distinct reasons a runner's requests could not batch, each logged once, at most."""
INLINE_HOLD_S = 0.05
"""How long :meth:`Scheduler.pump` runs :attr:`Scheduler.inline` batches back to back
before it lets the event loop turn, and goes on in a later step: a backlog of slow
batches must not hold the loop for all of them (answers unsent, cancellations and
deadlines unseen, a stall check unanswered)."""

__all__ = ["BatchPolicy", "Pending", "Scheduler", "priority_level", "signature"]


class Scheduler(BatchExecution):
    """Queues the requests of one runner instance, cuts them into batches and dispatches
    each batch that is due to a free execution slot (running it is
    :class:`~plugserve.registry.execution.scheduling.batch_execution.BatchExecution`'s)."""

    def __init__(
        self,
        execute: Execute,
        policy: BatchPolicy,
        label: str,
        clock: Callable[[], float] = time.monotonic,
        timer: Timer | None = None,
        on_execution: Callable[[int, float], None] | None = None,
        busy: Callable[[], int] = lambda: 0,
        on_failure: Callable[[Exception], None] | None = None,
        stop: Callable[[], Exception | None] = lambda: None,
        on_fallback: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(execute, label, clock, on_execution, on_failure, stop, on_fallback)
        self.inline: Callable[[Arrays], Arrays] | None = None
        """A sync twin of ``execute`` that never leaves the caller's thread (a runner
        process's runner): a batch then runs in the step of the loop that cut it, with
        no task of its own, and :meth:`pump` returns with its requests answered (those
        of :data:`INLINE_HOLD_S` of batches; the rest in later steps)."""
        self._resume_at: asyncio.Handle | None = None
        self.busy = busy
        """Executions still running on a thread after their request was cancelled."""
        self.policy = policy
        self._timer = timer
        self._bound: asyncio.AbstractEventLoop | None = None
        self._queue = RequestQueue(label)
        self._running = 0
        self._armed: Any = None
        self._armed_at: float | None = None
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.gather = False
        """Cut an idle runner's batch at the end of the loop's turn rather than at once, so
        that the requests decoded in the turn join it, while requests come in company: set
        for synchronous runners (``BatchedRunner``), whose batches may run on the event loop,
        where no batch can form while one runs. Company is two requests in one turn; it
        ends at a cut that gathered one request, and a lone request then runs at once again."""
        self._signature = signature
        self.bounds = TensorBounds()
        """What each tensor a batch merges into may hold: those of one request's tensor."""
        self.apart = 0
        """Batches cut while queued requests could not join them (``why_apart``)."""
        self.apart_why: str | None = None
        self._reasons: set[str] = set()
        self.held: Callable[[], int] = lambda: 0
        """Requests of this runner held before its queue (waiting for their sequence's
        turn): they count against ``max_queue_size`` too (:meth:`check_room`)."""
        self._gathering = False
        self._company = False
        self._this_turn = False  # a request ran at once in this turn of the loop

    @property
    def queued(self) -> int:
        return len(self._queue)

    def check_room(self) -> None:
        """429 when ``max_queue_size`` requests wait: queued here, or held before the queue
        (:attr:`held`)."""
        bound = self.policy.max_queue_size
        if bound and len(self._queue) + self.held() >= bound:
            raise TooManyRequests(
                f"runner {self.label} has {len(self._queue) + self.held()} requests queued, "
                "its max_queue_size",
                retry_after_s=RETRY_AFTER_S,
            )

    def declare(self, layout: BatchLayout) -> None:
        """Batch by ``layout`` (the runner's ``[runner.batching]``)."""
        self.layout = layout
        self._signature = layout.signature

    # -- submitting ------------------------------------------------------------------

    def _loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, asked of asyncio once per loop it runs on (on Python 3.11 each
        ``asyncio.get_running_loop`` is a ``getpid`` system call, a request's worth)."""
        loop = self._bound
        if loop is None or not loop.is_running():
            loop = self._bound = asyncio.get_running_loop()
        return loop

    async def submit(
        self,
        inputs: Arrays,
        deadline: float | None = None,
        priority: int | None = None,
        tenant: str | None = None,
        timings: dict[str, float] | None = None,
    ) -> Arrays:
        """Queue ``inputs`` and return this request's slice of its batch's outputs.

        ``timings`` (a request's ``ctx.timings``) receives its ``queue`` wait.

        Fast path: a request that finds the runner idle and nothing queued runs
        at once in the caller's own task, with no queue entry, future or task
        of its own; requests arriving meanwhile queue and batch as usual. Not
        taken by a :attr:`gather`-ing scheduler while requests come in company.
        """
        # A bad priority: 400 before anything else.
        level = priority_level(priority, self.policy, self.label)
        if (
            not self._queue
            and self._running == 0
            and not self._closed
            and not self.busy()
            and not (self.gather and (self._company or self._this_turn))
        ):
            if deadline is not None and self.clock() >= deadline:
                raise DeadlineExceeded(f"the request's deadline passed before {self.label} ran it")
            self._running += 1
            rows = self._signature(inputs)[0]
            self.executions += 1
            self.rows += rows
            if timings is not None:
                timings["queue"] = 0.0
            started = self.clock()
            try:
                outputs = await self.execute(self._fed(inputs))
                if self.on_execution is not None:
                    self.on_execution(rows, self.clock() - started)
                return outputs
            except Exception as exc:
                self._report(exc)
                raise
            finally:
                self._running -= 1
                if self._queue:
                    self.pump()
                if self.gather and not self._this_turn:
                    self._this_turn = True  # a second request in this turn is company
                    self._loop().call_soon(self._turn_over)
        if self.gather and self._this_turn and not self._queue:
            self._company = True
        future = self.enqueue(inputs, deadline, level, tenant, timings)
        try:
            return await future
        except asyncio.CancelledError:
            self._queue.remove(future)
            raise

    def enqueue(
        self,
        inputs: Arrays,
        deadline: float | None = None,
        priority: int | None = None,
        tenant: str | None = None,
        timings: dict[str, float] | None = None,
        pump: bool = True,
    ) -> asyncio.Future[Arrays]:
        """Queue a request; the future resolves to its outputs (what ``submit`` awaits).

        ``pump=False`` leaves dispatching to the caller's next :meth:`pump`: requests
        that arrived together are then queued together before any batch is cut.
        """
        if self._closed:
            raise Unavailable(f"runner {self.label} is shutting down")
        self.check_room()
        level = priority_level(priority, self.policy, self.label)
        rows, sig = self._signature(inputs)
        now = self.clock()
        future: asyncio.Future[Arrays] = self._loop().create_future()
        weights = self.policy.tenant_weights
        self._queue.add(inputs, rows, sig, now, deadline, level, tenant, weights, future, timings)
        if pump and not self._gathering:  # gathering: cut with the rest of this turn
            if self.gather and self._company and self._running == 0:
                self._gathering = True
                self._loop().call_soon(self._gathered)
            else:
                self.pump()
        return future

    def _gathered(self) -> None:
        self._gathering = False
        if len(self._queue) <= 1:
            self._company = False  # alone: the next lone request runs at once
        if not self._closed:
            self.pump()

    def _turn_over(self) -> None:
        self._this_turn = False

    # -- forming and dispatching batches ---------------------------------------------

    def pump(self) -> None:
        """Dispatch every batch that is due; otherwise arm a timer for the next one."""
        held_since = None
        while self._running < self.policy.instances:
            now = self.clock()
            batch, wake_at = self.next_batch(now)
            if batch is None:
                if wake_at is not None:
                    self._arm(wake_at)
                return
            if self.inline is not None:  # batches run here, in this step of the loop
                if held_since is None:
                    held_since = now
                elif now - held_since >= INLINE_HOLD_S:
                    self._resume_soon()
                    return
            try:
                self._dispatch(batch)
            except BaseException:  # a plugin's own CancelledError, out of an inline batch
                if self.inline is not None:
                    self._resume_soon()  # the rest of the queue still runs
                raise

    def _resume_soon(self) -> None:
        if self._resume_at is None:
            self._resume_at = self._loop().call_soon(self._resume)

    def _resume(self) -> None:
        self._resume_at = None
        if not self._closed:
            self.pump()

    def next_batch(self, now: float) -> tuple[list[Pending] | None, float | None]:
        """The batch to send now, or ``(None, when to look again)``."""
        self._queue.drop_finished(now)
        if not self._queue:
            return None, None
        ordered = self._queue.ordered()
        batch, due, apart = cut(
            ordered, self.policy, self.layout, self.bounds, self._running == 0, now
        )
        if batch is not None and apart is not None:
            self._ran_apart(ordered[0], apart)
        return batch, due

    def _ran_apart(self, head: Pending, other: Pending) -> None:
        """A batch is cut without a queued request that could not join it: counted, and
        each reason said once (a log warning; :attr:`apart_why` for ``/admin/plugins``)."""
        self.apart += 1
        why = why_apart(self.layout, head.inputs, None if head.signature is None else other.inputs)
        self.apart_why = why
        if why not in self._reasons and len(self._reasons) < MAX_REASONS_SAID:
            self._reasons.add(why)
            log.warning("cannot_batch", runner=self.label, why=why)

    def _arm(self, wake_at: float) -> None:
        if self._armed is not None and self._armed_at is not None and self._armed_at <= wake_at:
            return
        if self._armed is not None:
            self._armed.cancel()
        delay = max(0.0, wake_at - self.clock())
        timer = self._timer or self._loop().call_later
        self._armed_at = wake_at
        self._armed = timer(delay, self._wake)

    def _wake(self) -> None:
        self._armed = self._armed_at = None
        self.pump()

    def _dispatch(self, batch: list[Pending]) -> None:
        self._queue.take(batch, self.clock())
        self._running += 1
        if self.inline is not None:
            self._run_inline(batch)
            return
        self._spawn(self._run(batch))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = self._loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[Pending]) -> None:
        try:
            merged, rows = self._merge(batch)
            started = self.clock()
            with self._span(batch, rows):
                outputs = await self.execute(merged)
        except Exception as exc:
            if runs_again(batch, exc):
                self._fell_back(batch, exc)
                await self._one_by_one(batch)
            else:
                self._fail_all(batch, exc)
        else:
            self._executed(batch, rows, started, outputs)
        finally:
            self._end(batch)
            self.pump()

    def _run_inline(self, batch: list[Pending]) -> None:
        """:meth:`_run` through :attr:`inline`, in the caller's step; :meth:`pump`'s loop
        goes on with the next batch. A failed batch is retried one by one in a task."""
        assert self.inline is not None
        handed_off = False
        try:
            merged, rows = self._merge(batch)
            started = self.clock()
            with self._span(batch, rows):
                outputs = self.inline(merged)
        except Exception as exc:
            if runs_again(batch, exc):
                self._fell_back(batch, exc)
                self._spawn(self._alone(batch))
                handed_off = True  # still running: the task ends it
            else:
                self._fail_all(batch, exc)
        else:
            self._executed(batch, rows, started, outputs)
        finally:
            if not handed_off:
                self._end(batch)

    async def _alone(self, batch: list[Pending]) -> None:
        try:
            await self._one_by_one(batch)
        finally:
            self._end(batch)
            self.pump()

    def _end(self, batch: list[Pending]) -> None:
        for request in batch:  # cancelled mid-execution (shutdown): nobody may hang
            if not request.future.done():
                request.future.cancel()
        self._running -= 1

    # -- closing -----------------------------------------------------------------------

    def close(self) -> None:
        """Refuse new requests and fail the queued ones (after a drain timeout)."""
        self._closed = True
        if self._armed is not None:
            self._armed.cancel()
        if self._resume_at is not None:
            self._resume_at.cancel()
        self._queue.close()
