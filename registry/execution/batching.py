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

The clock and the timer are injectable, so the policy is tested with a fake clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from plugserve.registry.errors import (
    DeadlineExceeded,
    InvalidInput,
    PluginError,
    PlugserveError,
    TooManyRequests,
    Unavailable,
)
from plugserve.registry.execution import tracing
from plugserve.registry.execution.layout import (
    BatchLayout,
    Footprint,
    TensorBounds,
    footprint,
    why_apart,
)

log = structlog.get_logger("plugserve.batching")

Arrays = Mapping[str, np.ndarray]
Execute = Callable[[Arrays], Awaitable[Arrays]]
Timer = Callable[[float, Callable[[], None]], Any]
RETRY_AFTER_S = 1
MAX_TENANTS_KEPT = 1024
"""Past this many tenants' finish tags, only those of tenants still queued are kept."""
MAX_REASONS_SAID = 16
"""Distinct reasons a runner's requests could not batch, each logged once, at most."""
INLINE_HOLD_S = 0.05
"""How long :meth:`Scheduler.pump` runs :attr:`Scheduler.inline` batches back to back
before it lets the event loop turn, and goes on in a later step: a backlog of slow
batches must not hold the loop for all of them (answers unsent, cancellations and
deadlines unseen, a stall check unanswered)."""


@dataclass(frozen=True)
class BatchPolicy:
    """A runner's scheduling settings, from its manifest's ``[runner]`` table."""

    max_batch_size: int = 0
    max_queue_delay_s: float = 0.0
    preferred_batch_sizes: tuple[int, ...] = ()
    instances: int = 1
    max_queue_size: int = 0
    priority_levels: int = 1
    default_priority: int | None = None
    tenant_weights: Mapping[str, float] = field(default_factory=dict)

    @property
    def default_level(self) -> int:
        return self.default_priority or self.priority_levels


def priority_level(priority: int | None, policy: BatchPolicy, label: str) -> int:
    """The queue level of a v2 ``priority`` (0 or none: the runner's default); a 400 for
    one outside the runner's levels."""
    level = priority or policy.default_level
    if not 1 <= level <= policy.priority_levels:
        levels = policy.priority_levels
        raise InvalidInput(f"priority {priority} is outside 1..{levels} for {label}")
    return level


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


def signature(inputs: Arrays) -> tuple[int, tuple[Any, ...] | None]:
    """Rows and batching signature of ``inputs``; ``None``: it cannot join a batch."""
    if len(inputs) == 1:  # the usual request: no sort, no generator
        for name, array in inputs.items():
            shape = array.shape
            if not shape:
                return 1, None
            return shape[0], ((name, array.dtype.str, shape[1:]),)
    arrays = list(inputs.values())
    if not arrays or any(a.ndim == 0 for a in arrays):
        return 1, None
    rows = arrays[0].shape[0]
    if any(a.shape[0] != rows for a in arrays):
        return rows, None
    return rows, tuple(sorted((n, a.dtype.str, a.shape[1:]) for n, a in inputs.items()))


class Scheduler:
    """Queues, batches and executes the requests of one runner instance."""

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
        self.execute = execute
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
        self.inline: Callable[[Arrays], Arrays] | None = None
        """A sync twin of ``execute`` that never leaves the caller's thread (a runner
        process's runner): a batch then runs in the step of the loop that cut it, with
        no task of its own, and :meth:`pump` returns with its requests answered (those
        of :data:`INLINE_HOLD_S` of batches; the rest in later steps)."""
        self._resume_at: asyncio.Handle | None = None
        self.busy = busy
        """Executions still running on a thread after their request was cancelled."""
        self.on_execution = on_execution
        self.policy = policy
        self.label = label
        self.clock = clock
        self._timer = timer
        self._bound: asyncio.AbstractEventLoop | None = None
        self._queue: list[Pending] = []
        self._running = 0
        self._armed: Any = None
        self._armed_at: float | None = None
        self._seq = itertools.count()
        self._vtime = 0.0
        self._tenant_finish: dict[str, float] = {}
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.executions = 0
        self.rows = 0
        self.gather = False
        """Cut an idle runner's batch at the end of the loop's turn rather than at once, so
        that the requests decoded in the turn join it, while requests come in company: set
        for synchronous runners (``BatchedRunner``), whose batches may run on the event loop,
        where no batch can form while one runs. Company is two requests in one turn; it
        ends at a cut that gathered one request, and a lone request then runs at once again."""
        self.layout: BatchLayout | None = None
        """The runner's declared batching (``[runner.batching]``); ``None``: every row on
        axis 0 (:func:`signature`)."""
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

    def _fed(self, inputs: Arrays) -> Arrays:
        """What the runner gets for one request alone."""
        layout = self.layout
        return inputs if layout is None or not layout.reshapes else layout.merge([inputs])

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
        level = self._level(priority)  # a bad priority: 400 before anything else
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
            self._abandon(future)
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
        policy = self.policy
        if self._closed:
            raise Unavailable(f"runner {self.label} is shutting down")
        self.check_room()
        level = self._level(priority)
        rows, sig = self._signature(inputs)
        now = self.clock()
        name = tenant or ""
        start = max(self._vtime, self._tenant_finish.get(name, 0.0))
        self._tenant_finish[name] = start + max(rows, 1) / policy.tenant_weights.get(name, 1.0)
        future: asyncio.Future[Arrays] = self._loop().create_future()
        request = Pending(
            inputs, rows, sig, now, deadline, level, start, next(self._seq), future, timings
        )
        request.tenant = name
        if tracing.TRACER is not None:
            request.span = tracing.TRACER.start_span("queue", attributes={"plugserve.rows": rows})
        self._queue.append(request)
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

    def _abandon(self, future: asyncio.Future[Arrays]) -> None:
        """A queued request's caller gave up (its client hung up): it leaves the queue now,
        freeing its place, and never runs. One already in a batch runs with the batch."""
        for index, request in enumerate(self._queue):
            if request.future is future:
                del self._queue[index]
                if request.span is not None:
                    request.span.end()
                return

    def _level(self, priority: int | None) -> int:
        return priority_level(priority, self.policy, self.label)

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
        self._drop_finished(now)
        if not self._queue:
            return None, None
        policy = self.policy
        ordered = sorted(self._queue, key=Pending.key)
        head = ordered[0]
        batch, rows = [head], head.rows
        limit = policy.max_batch_size
        apart = None
        closed = False  # the next request would take a merged tensor past self.bounds
        if limit and head.signature is not None and head.rows < limit:
            kept: Footprint | None = None
            for request in ordered[1:]:
                if request.signature == head.signature:
                    if rows + request.rows <= limit:
                        kept = kept or footprint(self.layout, head.inputs, self.bounds)
                        if not kept.admits(request.inputs):
                            closed = True
                            break
                        batch.append(request)
                        rows += request.rows
                        if rows == limit:
                            break
                elif apart is None:
                    apart = request
        elif limit > 1 and head.signature is None and len(ordered) > 1:
            apart = ordered[1]
        oldest = min(r.arrival for r in self._queue)
        due = oldest + policy.max_queue_delay_s
        ready = not limit or rows >= limit or closed or self._running == 0 or now >= due
        if not ready:
            return None, due
        if apart is not None and rows < limit:
            self._ran_apart(head, apart)
        return self._preferred(batch, rows), None

    def _ran_apart(self, head: Pending, other: Pending) -> None:
        """A batch is cut without a queued request that could not join it: counted, and
        each reason said once (a log warning; :attr:`apart_why` for ``/admin/plugins``)."""
        self.apart += 1
        why = why_apart(self.layout, head.inputs, None if head.signature is None else other.inputs)
        self.apart_why = why
        if why not in self._reasons and len(self._reasons) < MAX_REASONS_SAID:
            self._reasons.add(why)
            log.warning("cannot_batch", runner=self.label, why=why)

    def _preferred(self, batch: list[Pending], rows: int) -> list[Pending]:
        fitting = [p for p in self.policy.preferred_batch_sizes if p <= rows]
        if not fitting or len(batch) == 1:
            return batch
        cut, total = max(fitting), 0
        kept = []
        for request in batch:
            if total + request.rows > cut:
                break
            kept.append(request)
            total += request.rows
        return kept or batch[:1]

    def _drop_finished(self, now: float) -> None:
        keep = []
        for request in self._queue:
            if request.future.done():  # cancelled by its client (disconnect, deadline)
                continue
            if request.deadline is not None and now >= request.deadline:
                request.future.set_exception(
                    DeadlineExceeded(f"the request's deadline passed while queued for {self.label}")
                )
                continue
            keep.append(request)
        self._queue = keep

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
        taken = set(map(id, batch))
        self._queue = [r for r in self._queue if id(r) not in taken]
        now = self.clock()
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
            queued = {r.tenant for r in self._queue}
            self._tenant_finish = {
                t: f for t, f in self._tenant_finish.items() if f > self._vtime and t in queued
            }
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
            if _retried(batch, exc):
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
            if _retried(batch, exc):
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

    def _merge(self, batch: list[Pending]) -> tuple[Arrays, int]:
        """The batch's inputs as one (rows concatenated), counted as an execution."""
        rows = sum(r.rows for r in batch)
        merged: Arrays
        if self.layout is not None:
            merged = self.layout.merge([r.inputs for r in batch])
        elif len(batch) == 1:
            merged = batch[0].inputs
        else:
            merged = {
                name: np.concatenate([r.inputs[name] for r in batch], axis=0)
                for name in batch[0].inputs
            }
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
            self._split(batch, rows, outputs)
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

    def _end(self, batch: list[Pending]) -> None:
        for request in batch:  # cancelled mid-execution (shutdown): nobody may hang
            if not request.future.done():
                request.future.cancel()
        self._running -= 1

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

    def _split(self, batch: list[Pending], rows: int, outputs: Arrays) -> None:
        if len(batch) == 1:
            if not batch[0].future.done():
                batch[0].future.set_result(outputs)
            return
        if self.layout is not None:
            try:
                answers = self.layout.split(outputs, [r.rows for r in batch])
            except ValueError as exc:
                raise PluginError(self.label, exc) from None
            for request, answer in zip(batch, answers, strict=True):
                if not request.future.done():
                    request.future.set_result(answer)
            return
        for name, value in outputs.items():
            if not isinstance(value, np.ndarray) or value.ndim == 0 or value.shape[0] != rows:
                shape = getattr(value, "shape", type(value).__name__)
                problem = (
                    f"output {name!r} has shape {shape}; a batch of {rows} rows needs {rows} first"
                )
                raise PluginError(self.label, ValueError(problem))
        offset = 0
        for request in batch:
            end = offset + request.rows
            if not request.future.done():
                request.future.set_result({n: v[offset:end] for n, v in outputs.items()})
            offset = end

    # -- closing -----------------------------------------------------------------------

    def close(self) -> None:
        """Refuse new requests and fail the queued ones (after a drain timeout)."""
        self._closed = True
        if self._armed is not None:
            self._armed.cancel()
        if self._resume_at is not None:
            self._resume_at.cancel()
        for request in self._queue:
            if not request.future.done():
                request.future.set_exception(Unavailable(f"runner {self.label} was unloaded"))
        self._queue = []


def _fresh(exc: Exception) -> Exception:
    """A separate exception per request, so tracebacks do not pile onto one object."""
    clone = exc.__class__.__new__(exc.__class__)
    clone.args = exc.args
    clone.__dict__.update(getattr(exc, "__dict__", {}))
    clone.__cause__ = exc.__cause__
    return clone


def _retried(batch: list[Pending], exc: Exception) -> bool:
    """Whether a failed batch runs again one request at a time: one of several requests,
    failing otherwise than with the runner's own 503 or 504."""
    return len(batch) > 1 and getattr(exc, "status", 500) not in (503, 504)
