"""Streaming runners: several responses to one request, and continuous batching of steps.

A streaming runner (``registry/hookspecs.py``, "Streaming runners") is a generator
(``infer`` yields its responses) or a step runner (``start`` and ``step``). One
:class:`StreamScheduler` per loaded runner serves its streams:

- At most ``max_streams`` streams are in progress at once; more wait, by priority
  level and then arrival, up to ``max_queue_size`` of them (429 beyond).
- A step runner's streams advance together: each ``step`` call takes up to
  ``max_batch_size`` of the streams in progress, round robin, so a stream that
  arrives joins at the next step rather than after the others finish
  (continuous batching). Steps run one at a time, on the runner's thread.
- A generator's steps (each ``next()``) run on the runner's threads, or on the
  event loop for an async generator; each stream is its own.
- A stream closed by its consumer (the client hung up, the deadline passed)
  leaves before its next step: no more steps run for it, and a step runner's
  ``stop(state)`` is called between steps, where ``start`` and ``step`` are called:
  never while a step runs.
- A stream holds at most ``READ_AHEAD`` responses its consumer has not taken:
  a slow client's stream takes no step until it reads (the others step on).
- A stream whose consumer has taken nothing of its ``READ_AHEAD`` responses for
  ``UNREAD_LIMIT_S`` gives its place up when another stream of its priority or a
  higher one waits for a place: it ends with a 503 after the responses it holds. A
  client that does not read holds a place only while no one else needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import inspect
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Executor
from typing import Any, Literal

import numpy as np
import structlog

from plugserve.registry.errors import PlugserveError, TooManyRequests, Unavailable
from plugserve.registry.execution.batching import BatchPolicy, priority_level
from plugserve.registry.execution.breaker import CircuitBreaker

StreamKind = Literal["generator", "steps"]
Arrays = Mapping[str, np.ndarray]
_END = object()
RETRY_AFTER_S = 1
READ_AHEAD = 8
"""Responses a stream may hold that its consumer has not taken: past it, no step runs for
it (a step runner's stream waits out of the batch; a generator's next step waits), so a
client that reads slowly, or not at all, holds its runner back rather than filling memory."""

UNREAD_LIMIT_S = 2.0
"""How long a stream may hold :data:`READ_AHEAD` responses its consumer has not taken
before it gives its place to a stream that waits for one."""

log = structlog.get_logger("plugserve.streaming")


def stream_kind(component: Any) -> StreamKind | None:
    """How ``component`` streams: ``steps`` (``start`` and ``step``), ``generator`` (``infer``
    yields), or ``None`` for a runner that answers once."""
    if callable(getattr(component, "start", None)) and callable(getattr(component, "step", None)):
        return "steps"
    infer = getattr(component, "infer", None)
    if inspect.isgeneratorfunction(infer) or inspect.isasyncgenfunction(infer):
        return "generator"
    return None


class Stream:
    """One request's responses, in order: ``async for`` them, and ``close()`` when done."""

    def __init__(self, scheduler: StreamScheduler, inputs: Arrays, level: int, seq: int) -> None:
        self._scheduler = scheduler
        self.inputs = inputs
        self.level = level
        self.seq = seq
        self.state: Any = None
        """A step runner's state for this stream (what ``start`` returned)."""
        self.place: Literal["waiting", "running", "left"] = "waiting"
        self.closed = False
        """Its consumer left: no more steps run for it."""
        self.task: asyncio.Task[None] | None = None
        """A generator's stream: the task running it."""
        self.parked = False
        """A step runner's stream left out of the batches until its consumer takes a response."""
        self.evicted: PlugserveError | None = None
        """Why it lost its place to a waiting stream (its consumer did not read)."""
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._room = asyncio.Event()
        self._room.set()

    def __aiter__(self) -> AsyncIterator[Arrays]:
        return self

    async def __anext__(self) -> Arrays:
        item = await self._items.get()
        if not self.full and not self._room.is_set():
            self._room.set()
            self._scheduler.read(self)
        if item is _END:
            self._items.put_nowait(_END)  # iterating again ends again
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._items.put_nowait(_END)
            raise item
        return item  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stop the stream: it leaves the queue, or its runner, before its next step."""
        if not self.closed:
            self.closed = True
            self._scheduler.closed(self)

    @property
    def full(self) -> bool:
        """Whether it holds :data:`READ_AHEAD` responses its consumer has not taken."""
        return self._items.qsize() >= READ_AHEAD

    async def room(self) -> None:
        """Wait until its consumer has taken enough responses for one more."""
        await self._room.wait()

    def put(self, response: Arrays) -> None:
        if not self.closed:
            self._items.put_nowait(response)
            if self.full and self._room.is_set():
                self._room.clear()
                self._scheduler.unread(self)

    def end(self, error: BaseException | None = None) -> None:
        self._items.put_nowait(_END if error is None else error)


class StepBatches:
    """A step runner's streams in progress, and its step loop (continuous batching): between
    steps the states of streams that left are stopped (``stop``) and new streams start
    (``start``); each ``step`` then advances up to ``batch_size`` of those in progress,
    round robin. A stream whose consumer is behind is parked out of the batches until it
    reads. Steps run one at a time; the loop runs while a stream is left to step.

    ``left(stream, error)`` is told of each stream that is over (ended, failed or closed),
    and ``failed(exc)`` turns a runner's exception into its answer."""

    def __init__(
        self,
        component: Any,
        label: str,
        batch_size: int,
        executor: Executor | None,
        breaker: CircuitBreaker,
        left: Callable[[Stream, BaseException | None], None],
        failed: Callable[[BaseException], PlugserveError],
        on_execution: Callable[[int, float], None] | None = None,
    ) -> None:
        self.label = label
        self.batch_size = batch_size
        self.executor = executor
        self.breaker = breaker
        self._left = left
        self._failed = failed
        self.on_execution = on_execution
        self._start = getattr(component, "start", None)
        self._step = getattr(component, "step", None)
        stop = getattr(component, "stop", None)
        self._stop = stop if callable(stop) else None
        self._starting: deque[Stream] = deque()
        self._active: deque[Stream] = deque()
        self._stepping: list[Stream] = []
        self._parked: set[Stream] = set()
        self._stops: list[Any] = []
        """States of streams that left, for ``stop``: called by the step loop between steps."""
        self._task: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Future[Any]] = set()
        self._closing = False
        self.steps = 0
        """Step calls made, each advancing one or more streams."""

    def start(self, stream: Stream) -> None:
        """``stream`` took a place: it starts before the next step."""
        self._starting.append(stream)
        self._wake()

    def resume(self, stream: Stream) -> None:
        """``stream``'s consumer took a response: it joins the batches again."""
        self.unpark(stream)
        if self._closing or stream.place != "running":
            return
        self._active.append(stream)
        self._wake()

    def unpark(self, stream: Stream) -> None:
        """``stream`` is no longer parked out of the batches."""
        self._parked.discard(stream)
        stream.parked = False

    def stop_later(self, state: Any) -> None:
        """The state of a stream that left, stopped (``stop``) before the next step."""
        if self._stop is not None:
            self._stops.append(state)
            if not self._closing:
                self._wake()

    def _wake(self) -> None:
        """Start the step loop unless it runs (it ends when no stream is left to step)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"steps {self.label}")

    async def _run(self) -> None:
        """Stop the streams that left, start new ones, then step up to ``batch_size`` of
        those in progress; repeat."""
        while self._stops or self._starting or self._active:
            while self._stops:
                await self._stop_state(self._stops.pop(0))
            while self._starting:
                stream = self._starting.popleft()
                if stream.closed:
                    self._left(stream, None)
                    continue
                try:
                    stream.state = await self._call(self._start, stream.inputs)
                except Exception as exc:
                    self._left(stream, self._failed(exc))
                    continue
                self._active.append(stream)
            batch: list[Stream] = []
            while self._active and len(batch) < self.batch_size:
                stream = self._active.popleft()
                if stream.closed:
                    self._left(stream, None)
                elif stream.full:  # its consumer is behind: no step for it until it reads
                    stream.parked = True
                    self._parked.add(stream)
                else:
                    batch.append(stream)
            if batch:
                self._stepping = batch
                await self._advance(batch)
                self._stepping = []

    async def _advance(self, batch: list[Stream]) -> None:
        started = time.perf_counter()
        try:
            results = await self._call(self._step, [s.state for s in batch])
            if not isinstance(results, list | tuple) or len(results) != len(batch):
                got = len(results) if isinstance(results, list | tuple) else type(results).__name__
                raise TypeError(f"step() of {len(batch)} states returned {got}, not one per state")
        except Exception as exc:
            error = self._failed(exc)
            for stream in batch:
                self._left(stream, error)
            return
        self.steps += 1
        if self.on_execution is not None:
            self.on_execution(len(batch), time.perf_counter() - started)
        self.breaker.success()
        for stream, result in zip(batch, results, strict=True):
            if result is None or stream.closed:
                self._left(stream, None)
            elif isinstance(result, Exception):  # the step refused this stream alone
                self._left(stream, self._failed(result))
            elif not isinstance(result, Mapping):
                problem = TypeError(f"step() gave {type(result).__name__}, not a dict of arrays")
                self._left(stream, self._failed(problem))
            else:
                stream.put(result)
                self._active.append(stream)

    async def _stop_state(self, state: Any) -> None:
        try:
            if self.executor is None and not inspect.iscoroutinefunction(self._stop):
                self._stop(state)  # type: ignore[misc]  # async start and step: no thread
            else:
                await self._call(self._stop, state)
        except Exception as exc:  # its state is gone either way
            log.warning("stream_stop_failed", plugin=self.label, error=repr(exc))

    async def _call(self, method: Any, argument: Any) -> Any:
        if inspect.iscoroutinefunction(method):
            return await method(argument)
        assert self.executor is not None
        return await asyncio.get_running_loop().run_in_executor(self.executor, method, argument)

    def close(self, gone: BaseException) -> None:
        """The runner is going: every stream here ends with ``gone``, the loop stops, and
        the states left are stopped now (the runner's close() follows at once, as these
        may while a last step finishes on its thread)."""
        self._closing = True
        for stream in [*self._starting, *self._active, *self._stepping, *self._parked]:
            stream.parked = False
            self._left(stream, gone)
        self._starting.clear()
        self._active.clear()
        self._parked.clear()
        if self._task is not None:
            self._task.cancel()
        stops, self._stops = self._stops, []
        for state in stops:
            try:
                stopping = self._stop(state)  # type: ignore[misc]
                if inspect.isawaitable(stopping):
                    task = asyncio.ensure_future(stopping)
                    self._stopping.add(task)
                    task.add_done_callback(self._stopping.discard)
            except Exception as exc:
                log.warning("stream_stop_failed", plugin=self.label, error=repr(exc))


class StreamScheduler:
    """Admits, orders and runs the streams of one streaming runner."""

    def __init__(
        self,
        component: Any,
        kind: StreamKind,
        policy: BatchPolicy,
        max_streams: int,
        label: str,
        executor: Executor | None,
        breaker: CircuitBreaker,
        fault: Callable[[BaseException], PlugserveError],
        on_execution: Callable[[int, float], None] | None = None,
    ) -> None:
        self.kind = kind
        self.policy = policy
        self.max_streams = max_streams
        self.label = label
        self.executor = executor
        self.breaker = breaker
        self.fault = fault
        self.on_execution = on_execution
        self._generate = getattr(component, "infer", None)
        self._steps = StepBatches(
            component,
            label,
            max(policy.max_batch_size, 1),
            executor,
            breaker,
            self._left,
            self._failed,
            on_execution,
        )
        self._waiting: list[tuple[int, int, Stream]] = []
        self.waiting = 0
        self.running = 0
        self._unread: dict[Stream, float] = {}
        """Streams in progress holding READ_AHEAD untaken responses, since when (oldest first)."""
        self._evictions: asyncio.TimerHandle | None = None
        self._evicted: set[Stream] = set()
        """Streams that gave their place up and have not left yet (a step runs for them)."""
        self._seq = itertools.count()
        self._pumps: set[asyncio.Task[None]] = set()
        self._closing = False

    @property
    def steps(self) -> int:
        """Step calls made (a step runner), each advancing one or more streams."""
        return self._steps.steps

    # -- admission -------------------------------------------------------------------

    def open(self, inputs: Arrays, priority: int | None) -> Stream:
        """A new stream for ``inputs``: it starts now if a place is free, else waits its turn.

        Raises :class:`TooManyRequests` when ``max_queue_size`` streams already wait,
        :class:`Unavailable` while the circuit is open or the runner is closing.
        """
        if self._closing:
            raise Unavailable(f"runner {self.label} is closing")
        level = priority_level(priority, self.policy, self.label)
        limit = self.policy.max_queue_size
        if limit and self.running >= self.max_streams and self.waiting >= limit:
            raise TooManyRequests(
                f"runner {self.label} has {self.waiting} streams waiting (max_queue_size {limit})",
                retry_after_s=RETRY_AFTER_S,
            )
        self.breaker.allow()
        stream = Stream(self, inputs, level, next(self._seq))
        heapq.heappush(self._waiting, (level, stream.seq, stream))
        self.waiting += 1
        self._admit()
        if self.waiting:
            self._make_room()
        return stream

    def closed(self, stream: Stream) -> None:
        """``stream``'s consumer left (called by :meth:`Stream.close`)."""
        if stream.place == "waiting":
            stream.place = "left"
            self.waiting -= 1
            self.breaker.release()
        elif stream.parked:  # a step runner's stream out of the batches: it leaves now
            self._steps.unpark(stream)
            self._left(stream)
        elif stream.task is not None:  # a generator: stopped now (a sync one: after its step)
            stream.task.cancel()

    def unread(self, stream: Stream) -> None:
        """``stream`` holds :data:`READ_AHEAD` responses its consumer has not taken."""
        if stream.place != "running":
            return
        self._unread[stream] = time.monotonic()
        if self.waiting and self._evictions is None:
            self._evictions = asyncio.get_running_loop().call_later(UNREAD_LIMIT_S, self._make_room)

    def read(self, stream: Stream) -> None:
        """``stream``'s consumer took a response after holding :data:`READ_AHEAD`."""
        self._unread.pop(stream, None)
        if stream.parked:
            self._steps.resume(stream)

    def _make_room(self) -> None:
        """Streams wait for a place: those whose consumers have read nothing of their
        responses for :data:`UNREAD_LIMIT_S` give theirs up, the longest unread first, one
        for each stream waiting and not yet owed a place, and only to a stream of their
        priority level or a higher one. Called again when the next could be due."""
        if self._evictions is not None:
            self._evictions.cancel()
            self._evictions = None
        if self._closing:
            return
        now = time.monotonic()
        owed = self.waiting - len(self._evicted)
        first = self._first_waiting()
        for stream, since in list(self._unread.items()):
            if owed <= 0 or first is None:
                return
            if now - since < UNREAD_LIMIT_S:
                delay = since + UNREAD_LIMIT_S - now
                self._evictions = asyncio.get_running_loop().call_later(delay, self._make_room)
                return
            if stream.level >= first.level:  # a lower priority waits for a higher one
                self._evict(stream, now - since)
                owed -= 1

    def _first_waiting(self) -> Stream | None:
        """The stream that takes the next free place, if any waits."""
        while self._waiting and self._waiting[0][2].place != "waiting":
            heapq.heappop(self._waiting)  # closed while it waited
        return self._waiting[0][2] if self._waiting else None

    def _evict(self, stream: Stream, unread_s: float) -> None:
        """End ``stream`` with a 503 after the responses it holds: its place goes to a
        waiting stream."""
        del self._unread[stream]
        stream.evicted = Unavailable(
            f"the stream's client took none of its last {READ_AHEAD} responses for "
            f"{unread_s:.1f} s while other streams waited for a place on runner {self.label} "
            f"(max_streams {self.max_streams}); the stream ended there"
        )
        log.info("stream_evicted", plugin=self.label, unread_s=round(unread_s, 2))
        stream.closed = True
        self._evicted.add(stream)
        self.closed(stream)

    def _admit(self) -> None:
        while self._waiting and self.running < self.max_streams:
            _, _, stream = heapq.heappop(self._waiting)
            if stream.place != "waiting":
                continue  # closed while it waited
            self.waiting -= 1
            self.running += 1
            stream.place = "running"
            if self.kind == "generator":
                stream.task = asyncio.create_task(self._pump(stream))
                self._pumps.add(stream.task)
                stream.task.add_done_callback(self._pumps.discard)
            else:
                self._steps.start(stream)

    def _left(self, stream: Stream, error: BaseException | None = None) -> None:
        """``stream`` is over (ended, failed or closed): free its place and its state."""
        if stream.place != "running":
            return
        stream.place = "left"
        self.running -= 1
        self._unread.pop(stream, None)
        self._evicted.discard(stream)
        error = error or stream.evicted
        stream.end(error)
        if error is None or not isinstance(error, PlugserveError) or error.status != 500:
            self.breaker.release()
        if stream.state is not None:
            self._steps.stop_later(stream.state)
        stream.state = None
        if not self._closing:
            self._admit()

    def _failed(self, exc: BaseException) -> PlugserveError:
        error = self.fault(exc)
        if error.status == 500:
            self.breaker.failure()
        return error

    # -- generator runners -----------------------------------------------------------------

    async def _pump(self, stream: Stream) -> None:
        """Run one stream's generator, a response at a time, until it ends or is closed."""
        error: BaseException | None = None
        try:
            produced = self._generate(stream.inputs)  # type: ignore[misc]
            if inspect.isasyncgen(produced):
                async with contextlib.aclosing(produced):
                    async for response in produced:
                        self._put(stream, response)
                        await stream.room()
            else:
                await self._pump_sync(stream, produced)
        except asyncio.CancelledError:
            if not stream.closed:  # the runner is closing, not the consumer leaving
                error = Unavailable(f"runner {self.label} closed during the stream")
        except Exception as exc:
            error = self._failed(exc)
        else:
            self.breaker.success()
        finally:
            self._left(stream, error)

    async def _pump_sync(self, stream: Stream, produced: Any) -> None:
        assert self.executor is not None
        executor = self.executor
        step = None
        try:
            while not stream.closed:
                await stream.room()
                step = executor.submit(next, produced, _END)
                response = await asyncio.wrap_future(step)
                if response is _END:
                    return
                self._put(stream, response)
        finally:
            # Closed on the runner's thread, once its last step returned (none can be stopped).
            if step is None or step.done():
                with contextlib.suppress(RuntimeError):  # the pool is shut down: nothing runs
                    executor.submit(_close_quietly, produced)
            else:
                step.add_done_callback(lambda _: _close_quietly(produced))

    def _put(self, stream: Stream, response: Any) -> None:
        if not isinstance(response, Mapping):
            raise TypeError(f"infer() yielded {type(response).__name__}, not a dict of arrays")
        if self.on_execution is not None:
            self.on_execution(1, 0.0)
        stream.put(response)

    # -- lifecycle -----------------------------------------------------------------------

    def close(self, reason: str | None = None) -> None:
        """The runner is unloading (or the server stopping, ``reason``): every stream still
        here ends with a 503, which its consumer can still send to its client."""
        self._closing = True
        if self._evictions is not None:
            self._evictions.cancel()
            self._evictions = None
        gone = Unavailable(reason or f"runner {self.label} closed during the stream")
        for _, _, stream in self._waiting:
            if stream.place == "waiting":
                stream.place = "left"
                stream.end(gone)
        self._waiting.clear()
        self.waiting = 0
        self._steps.close(gone)
        self._unread.clear()
        for task in list(self._pumps):
            task.cancel()


def _close_quietly(generator: Any) -> None:
    with contextlib.suppress(Exception):
        generator.close()
