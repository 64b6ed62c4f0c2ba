"""A loaded plugin instance: its component, how to call it, and who is using it."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from plugserve.registry.backends.refusals import ort_refusal
from plugserve.registry.batching import BatchPolicy, Scheduler
from plugserve.registry.breaker import CircuitBreaker
from plugserve.registry.calls import call_plugin
from plugserve.registry.errors import (
    InvalidInput,
    PluginError,
    PluginLoadError,
    PlugserveError,
    StreamingOnly,
)
from plugserve.registry.inputs import InputSpec, conform, input_specs
from plugserve.registry.isolation.remote import RemoteRunner
from plugserve.registry.manifest import Manifest, RunnerSection
from plugserve.registry.stats import RunnerStats
from plugserve.registry.streaming import Stream, StreamScheduler, stream_kind
from plugserve.registry.tensors import from_json
from plugserve.registry.types import PluginInfo, RequestContext

STAGE_METHOD = {"preprocessor": "process", "runner": "infer", "postprocessor": "format"}
INLINE_MAX_ROWS = 4
INLINE_MAX_BYTES = 64 * 1024
"""A batch larger than this never runs inline, whatever its rows: its cost is not measured."""
SMALL_COSTS_KEPT = 8
LOOP_BUDGET_S = 0.01
"""In a worker whose runners run on its event loop (``LoadedPlugin.loop_budget``): the
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
is running on its thread, and the request (:attr:`RequestContext.body_bytes`) is at most
twice the largest one among those quick calls that succeeded; any other call runs on the
processor's own thread."""
_LOADS = itertools.count(1)


async def await_maybe(value: Any) -> Any:
    """Await ``value`` if it is awaitable, else return it: hooks and components may be either."""
    if inspect.isawaitable(value):
        return await value
    return value


class Checked(dict[str, np.ndarray]):
    """A request's tensors already checked against ``by``'s declared inputs
    (:meth:`LoadedPlugin.check_request`), so that runner does not check them twice."""

    __slots__ = ("by",)

    def __init__(self, inputs: Mapping[str, np.ndarray], by: LoadedPlugin) -> None:
        super().__init__(inputs)
        self.by = by


@dataclass(eq=False)
class LoadedPlugin:
    """One load (generation) of one plugin version, ready or about to be.

    Sync runner ``infer`` calls run on the instance's own thread pool (ONNX
    Runtime releases the GIL), small batches proven cheap on the event loop. Sync
    processor calls run on the processor's own thread, one call at a time (as on
    the loop: a processor is never called concurrently with itself), except calls
    proven cheap for requests of their size (``PROCESS_BUDGET_S``), which run inline:
    a cheap stage is slower behind a thread hop.
    """

    manifest: Manifest
    info: PluginInfo
    component: Any
    package: str | None = None
    hook_name: str | None = None
    model_path: Path | None = None
    loaded_at: float = field(default_factory=time.time)
    load_id: int = field(init=False, default_factory=lambda: next(_LOADS))
    """Unique to this load in this process: a reload of the same version gets a new one."""
    in_flight: int = 0
    executing: int = 0
    """Runner calls still on a worker thread; one whose request was cancelled (its client
    hung up, its deadline passed) keeps the instance busy until the thread returns; the
    same for a synchronous processor's calls on its thread."""
    _method: Callable[..., Any] = field(init=False, repr=False)
    _is_async: bool = field(init=False, repr=False)
    _executor: ThreadPoolExecutor | None = field(init=False, default=None, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(init=False, default=None, repr=False)
    _idle: asyncio.Event | None = field(init=False, default=None, repr=False)
    scheduler: Scheduler | None = field(init=False, default=None, repr=False)
    breaker: CircuitBreaker | None = field(init=False, default=None, repr=False)
    stats: RunnerStats | None = field(init=False, default=None, repr=False)
    inline_executions: int = field(init=False, default=0)
    _small_costs: deque[float] = field(
        init=False, default_factory=lambda: deque(maxlen=8), repr=False
    )
    _inline_budget: float = field(init=False, default=0.0, repr=False)
    loop_budget: float = field(init=False, default=0.0, repr=False)
    """Seconds: where a worker has a core of its own (``inline_runners``), batches that its
    runner's last executions say will take at most this long run on its event loop (see
    ``LOOP_BUDGET_S``): no thread hop, and the requests that arrive meanwhile form the
    next batch. 0: off."""
    _loop_costs: deque[tuple[int, float]] = field(
        init=False, default_factory=lambda: deque(maxlen=LOOP_COSTS_KEPT), repr=False
    )
    """(bytes, seconds) of the last executions, while :attr:`loop_budget` is set; of a
    synchronous processor, its last calls (request bytes, 0 for a call that failed)."""
    _metadata: dict[str, Any] | None = field(init=False, default=None, repr=False)
    _inputs: tuple[InputSpec, ...] = field(init=False, default=(), repr=False)
    _input_dtypes: dict[str, np.dtype[Any] | None] = field(
        init=False, default_factory=dict, repr=False
    )
    _validate: Callable[[Mapping[str, np.ndarray]], Any] | None = field(
        init=False, default=None, repr=False
    )
    streams: StreamScheduler | None = field(init=False, default=None, repr=False)
    """A streaming runner's streams (``registry/streaming.py``); ``None`` for the others."""
    remote: RemoteRunner | None = field(init=False, default=None, repr=False)
    """An isolated runner's processes (``isolation = "process"``): they batch and run it."""
    always_inline: bool = field(init=False, default=False, repr=False)
    """Run every execution on the event loop (in a runner process, whose loop has nothing
    else to do: requests that arrive meanwhile wait in the socket and form the next batch)."""

    def __post_init__(self) -> None:
        runner = self.manifest.runner
        kind = None if runner is None else stream_kind(self.component)
        name = "step" if kind == "steps" else STAGE_METHOD[self.manifest.type]
        method = getattr(self.component, name, None)
        if not callable(method):
            raise PluginLoadError(f"{self.label}: its component has no {name}() method")
        self._method = method
        self._is_async = inspect.iscoroutinefunction(method)
        if isinstance(self.component, RemoteRunner):
            self.remote = self.component
            self.stats = RunnerStats()  # the requests this process sent; executions are theirs
        elif runner is not None and kind is not None:
            validate = getattr(self.component, "validate", None)
            self._validate = validate if callable(validate) else None
            self.breaker = CircuitBreaker(
                self.label, runner.breaker_failures, runner.breaker_reset_s
            )
            self.stats = RunnerStats()
            if _needs_threads(self.component, kind):
                self._executor = ThreadPoolExecutor(runner.instances, thread_name_prefix=self.label)
            self.streams = StreamScheduler(
                self.component,
                kind,
                batch_policy(runner),
                runner.max_streams,
                self.label,
                self._executor,
                self.breaker,
                self._fault,
                on_execution=self.stats.record_execution,
            )
        elif runner is None:
            if not self._is_async:  # one thread: calls in order, never two at once
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=self.label)
        else:
            validate = getattr(self.component, "validate", None)
            self._validate = validate if callable(validate) else None
            if not self._is_async:
                self._executor = ThreadPoolExecutor(runner.instances, thread_name_prefix=self.label)
            self._inline_budget = runner.inline_budget_us / 1e6
            self.stats = RunnerStats()
            self.breaker = CircuitBreaker(
                self.label, runner.breaker_failures, runner.breaker_reset_s
            )
            self.scheduler = Scheduler(
                self._execute,
                batch_policy(runner),
                self.label,
                on_execution=self.stats.record_execution,
                busy=lambda: self.executing,
                on_failure=self._counted,
                stop=self.breaker.open_error,
            )

    @property
    def label(self) -> str:
        return self.manifest.label

    @property
    def rejecting(self) -> bool:
        """Whether this runner's circuit breaker refuses requests now."""
        return self.breaker is not None and self.breaker.rejecting

    @property
    def version(self) -> str:
        return str(self.manifest.version)

    # -- lifecycle -----------------------------------------------------------------

    async def warmup(self, within: float) -> None:
        """Run the component's ``warmup()``, then read its ``metadata()``, within ``within`` s.

        Raises :class:`PluginCallTimeout` past the bound (``load_timeout_s``).
        """
        deadline = time.monotonic() + within
        await self._call_optional("warmup", within, "load_timeout_s")
        left = deadline - time.monotonic()
        self._metadata = await self._call_optional("metadata", left, "load_timeout_s")
        self._inputs = input_specs(self._metadata)
        self._input_dtypes = {spec.name: spec.dtype for spec in self._inputs}

    async def close(self, within: float) -> None:
        """Run the component's ``close()`` within ``within`` s; then its thread pool is shut down.

        Raises :class:`PluginCallTimeout` past the bound (``close_timeout_s``).
        """
        if self.remote is not None:
            await self.remote.close()
            return
        if self.scheduler is not None:
            self.scheduler.close()
        if self.streams is not None:
            self.streams.close()
        try:
            await self._call_optional("close", within, "close_timeout_s")
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None

    async def _call_optional(self, name: str, within: float, setting: str) -> Any:
        method = getattr(self.component, name, None)
        if not callable(method):
            return None
        return await call_plugin(method, within, self.label, name, setting)

    def metadata(self) -> dict[str, Any] | None:
        """The component's ``metadata()`` as read at warmup: tensor specs, or ``None``."""
        return self._metadata

    def check_request(
        self, inputs: Mapping[str, np.ndarray], route: str
    ) -> Mapping[str, np.ndarray]:
        """A request's tensors checked against this first stage's declared inputs (if any).

        Names, ranks, fixed dimensions and datatypes must match (400 otherwise);
        a runner with ``[runner] cast_inputs = true`` takes other datatypes when
        the cast changes no value.
        """
        if not self._inputs:
            return inputs
        cast = self.manifest.runner is not None and self.manifest.runner.cast_inputs
        checked = conform(self._inputs, inputs, f"route {route!r}", cast)
        if self.manifest.runner is None:
            return checked
        return Checked(checked, self)  # a runner first in its chain (isolated or not): once

    # -- in-flight accounting (no await between resolving a chain and entering it) ----

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        self._check_idle()

    def _check_idle(self) -> None:
        if self.in_flight == 0 and self.executing == 0 and self._idle is not None:
            self._idle.set()

    def _executed(self, _: object) -> None:
        """A worker thread returned (from the thread: handed to the loop)."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self._thread_returned)

    def _thread_returned(self) -> None:
        self.executing -= 1
        self._check_idle()

    async def wait_idle(self, within: float) -> bool:
        """Wait until no request uses this instance and no call of it is still running on a
        thread; ``False`` if ``within`` seconds pass first."""
        if self.in_flight == 0 and self.executing == 0:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), within)
        except TimeoutError:
            return False
        return True

    # -- the request path --------------------------------------------------------------

    async def call(self, data: Any, ctx: RequestContext) -> Any:
        """Run this stage on ``data``; a plugin's exception becomes :class:`PluginError`.

        A runner's call goes through its scheduler (batching, queue, priorities),
        an isolated runner's to its processes, where a scheduler batches it.
        """
        if self.streams is not None:
            raise StreamingOnly(ctx.route)
        remote = self.remote
        if remote is not None:
            inputs = self.runner_inputs(data)
            ctx.rows = _rows(inputs)
            return await remote.infer(inputs, ctx)
        if self.scheduler is not None and self.breaker is not None:
            inputs = self.runner_inputs(data)
            self.validate_request(inputs)
            ctx.rows = _rows(inputs)
            self.breaker.allow()
            started = time.perf_counter()
            try:
                scheduler = self.scheduler
                return await scheduler.submit(
                    inputs, ctx.deadline, ctx.priority, ctx.tenant, ctx.timings
                )
            finally:
                self.breaker.release()
                ctx.timings["compute_infer"] = (
                    time.perf_counter() - started - ctx.timings.get("queue", 0.0)
                )
        try:
            if self._is_async:
                return await self._method(data, ctx)
            size = ctx.body_bytes
            if self._processes_inline(size):
                self.inline_executions += 1
                return self._timed_process(data, ctx, size)
            return await self._on_thread(contextvars.copy_context().run, self._timed_process,
                                         data, ctx, size)  # fmt: skip
        except InvalidInput as exc:
            raise self._refused(exc) from None
        except PlugserveError:
            raise
        except Exception as exc:
            self._raise_fault(exc)

    def open_stream(self, data: Any, ctx: RequestContext) -> Stream:
        """A streaming runner's responses to ``data``: started now, or queued for a place."""
        assert self.streams is not None
        inputs = self.runner_inputs(data)
        self.validate_request(inputs)
        ctx.rows = _rows(inputs)
        return self.streams.open(inputs, ctx.priority)

    def _fault(self, exc: BaseException) -> PlugserveError:
        """What the client gets for ``exc`` raised in this plugin: its own error, a backend's
        refusal of the inputs (ONNX Runtime's, called by the plugin itself) as a 400, or a
        500 naming the plugin."""
        if isinstance(exc, InvalidInput):
            return self._refused(exc)
        if isinstance(exc, PlugserveError):
            return exc
        refusal = ort_refusal(exc)
        if refusal is not None:
            return self._refused(InvalidInput(f"ONNX Runtime refused the inputs: {refusal}"))
        return PluginError(self.label, exc)

    def validate_request(self, inputs: Mapping[str, np.ndarray]) -> None:
        """The runner's own per-request check (``validate``), before it can join a batch."""
        if self._validate is None:
            return
        try:
            self._validate(inputs)
        except InvalidInput as exc:
            raise self._refused(exc) from None
        except PlugserveError:
            raise
        except Exception as exc:
            raise PluginError(self.label, exc) from exc

    def _refused(self, exc: InvalidInput) -> InvalidInput:
        """A plugin's :class:`InvalidInput`: its message names the plugin (once)."""
        if exc.message.startswith(self.label):
            return exc
        fields = {**exc.fields, "plugin": self.label}
        return InvalidInput(f"{self.label}: {exc.message}", **fields)

    async def _execute(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """One runner execution on a (batched) input; what the scheduler calls."""
        try:
            if self._is_async:
                result = await self._method(inputs)
            elif self.always_inline or self._runs_inline(inputs):
                self.inline_executions += 1
                result = self._timed(inputs)
            else:
                result = await self._on_thread(self._timed, inputs)
        except Exception as exc:
            self._raise_fault(exc)
        return self._result(result)

    def execute_inline(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """:meth:`_execute` on the caller's thread, for a sync runner that always runs
        inline (in a runner process): a batch then runs in the loop step that cut it."""
        self.inline_executions += 1
        try:
            result = self._timed(inputs)
        except Exception as exc:
            self._raise_fault(exc)
        return self._result(result)

    def run_on_loop(self, budget: float) -> None:
        """Let a batched sync runner's batches run on the event loop within ``budget``
        seconds each (:attr:`loop_budget`), its scheduler gathering each loop turn's requests.
        A runner with several instances, or with ``inline_budget_us = 0``, keeps its threads."""
        runner = self.manifest.runner
        if (
            self.scheduler is None
            or self._is_async
            or self.remote is not None
            or runner is None
            or runner.instances > 1  # executions side by side: they need threads
            or runner.inline_budget_us == 0  # the runner's own "never on the loop"
        ):
            return
        self.loop_budget = budget
        self.scheduler.gather = True

    @property
    def runs_on_thread(self) -> bool:
        """Whether this instance has a thread pool for its synchronous calls."""
        return self._executor is not None

    @property
    def runs_inline_sync(self) -> bool:
        """Whether :meth:`execute_inline` may replace :meth:`_execute` (a sync ``infer``
        that always runs inline)."""
        return self.always_inline and not self._is_async

    def _raise_fault(self, exc: Exception) -> NoReturn:
        """Raise what an execution's exception becomes (:meth:`_fault`). The scheduler
        reports it (:meth:`_counted`) once it knows whose fault it is."""
        fault = self._fault(exc)
        if fault is exc:
            raise exc
        raise fault from (exc if fault.status == 500 else None)

    def _counted(self, exc: Exception) -> None:
        """An execution of one request failed with ``exc``: counted against the runner
        unless it is the request's own mistake (400) or the runner's own 503 or 504."""
        if getattr(exc, "status", 500) == 500:
            self._failed()

    def _result(self, result: Any) -> Mapping[str, np.ndarray]:
        if not isinstance(result, Mapping):
            problem = TypeError(f"infer() returned {type(result).__name__}, not a dict of arrays")
            raise PluginError(self.label, problem)
        if self.breaker is not None:
            self.breaker.success()
        return result

    async def _on_thread(self, work: Callable[..., Any], *args: Any) -> Any:
        """Run ``work(*args)`` (``infer``, a processor's call) on a worker thread, counted in
        :attr:`executing` until it returns.

        A request cancelled meanwhile (deadline, hang-up) stops waiting, but the
        thread cannot be stopped: it stays counted until it returns, so no unload
        closes the instance under it.
        """
        assert self._executor is not None
        future = self._executor.submit(work, *args)
        self.executing += 1
        try:
            result = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._loop = asyncio.get_running_loop()
            future.add_done_callback(self._executed)  # still running: counted until it returns
            raise
        except BaseException:
            self._thread_returned()
            raise
        self._thread_returned()
        return result

    def _failed(self) -> None:
        if self.breaker is not None:
            self.breaker.failure()

    def _runs_inline(self, inputs: Mapping[str, np.ndarray]) -> bool:
        """Run a small batch on the event loop when it has proven cheap.

        A thread hop costs more than a cheap execution (waking a worker and
        then the loop, 100 us or more on a busy 2-core machine). Batches of at
        most ``INLINE_MAX_ROWS`` rows and ``INLINE_MAX_BYTES`` run inline once
        the fastest of the last eight such batches took less than the runner's
        ``inline_budget_us``; anything larger or slower stays off the loop.
        With a :attr:`loop_budget`, a batch of numbers also runs inline as ``LOOP_BUDGET_S``
        says: a fixed cost, or one growing with the square of the data, stays within the
        budget; one execution over it sends the next eight to the thread; a batch of
        strings is never predicted.
        """
        known = self._loop_costs
        if self.loop_budget and len(known) == LOOP_COSTS_KEPT:
            quarter = self.loop_budget / 4
            fast = [seen for seen, took in known if took <= quarter]
            size = _numeric_bytes(inputs)
            if (
                len(fast) >= LOOP_COSTS_KEPT - LOOP_SPIKES_ALLOWED
                and all(took <= self.loop_budget for _, took in known)
                and 0 < size <= 2 * max(fast)
            ):
                return True
        costs = self._small_costs
        if len(costs) < SMALL_COSTS_KEPT or min(costs) > self._inline_budget:
            return False
        return _small(inputs)

    def _processes_inline(self, size: int | None) -> bool:
        """Whether a synchronous processor's call runs on the event loop (``PROCESS_BUDGET_S``):
        never while a call of it runs on its thread, nor for a request of unknown size."""
        known = self._loop_costs
        if self.executing or size is None or len(known) < LOOP_COSTS_KEPT:
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

    def _timed_process(self, data: Any, ctx: RequestContext, size: int | None) -> Any:
        """A synchronous processor's call, its cost recorded with the request's size (none
        for a call that raised: a quick refusal says nothing of what a request that size
        costs when it is processed)."""
        started = time.perf_counter()
        seen = 0
        try:
            result = self._method(data, ctx)
            seen = size or 0
            return result
        finally:
            self._loop_costs.append((seen, time.perf_counter() - started))

    def _timed(self, inputs: Mapping[str, np.ndarray]) -> Any:
        started = time.perf_counter()
        result = self._method(inputs)
        took = time.perf_counter() - started
        if self.loop_budget:
            self._loop_costs.append((_numeric_bytes(inputs), took))
        if _small(inputs):
            # The least of the last few: a run on a worker thread also counts
            # its wait for the GIL, which says nothing about the work itself.
            self._small_costs.append(took)
            if len(self._small_costs) > SMALL_COSTS_KEPT:
                self._small_costs.popleft()
        return result

    def runner_inputs(self, data: Any) -> Mapping[str, np.ndarray]:
        """Turn what reaches a runner into named arrays of its declared inputs.

        Named arrays pass through. A JSON object of nested lists becomes arrays
        of the dtypes the runner's ``metadata()`` declares; a bare list or array
        goes to a runner with exactly one input. With declared inputs, names,
        ranks and fixed dimensions are checked and other datatypes cast when no
        value changes (:func:`plugserve.registry.inputs.conform`): a 400 otherwise.
        """
        if type(data) is Checked and data.by is self:  # checked in this step already
            return data
        if isinstance(data, Mapping):
            if all(isinstance(v, np.ndarray) for v in data.values()):
                inputs = data
            else:
                inputs = {str(k): self._as_array(str(k), v) for k, v in data.items()}
        elif isinstance(data, list | np.ndarray) and len(self._input_dtypes) == 1:
            (name,) = self._input_dtypes
            inputs = {name: self._as_array(name, data)}
        else:
            names = sorted(self._input_dtypes)
            raise InvalidInput(
                f"runner {self.label} takes named inputs {names}, got {type(data).__name__}"
            )
        if not self._inputs or (type(data) is Checked and data.by is self):
            return inputs
        return conform(self._inputs, inputs, f"runner {self.label}", cast=True)

    def _as_array(self, name: str, value: Any) -> np.ndarray:
        if isinstance(value, np.ndarray):
            return value
        dtype = self._input_dtypes.get(name)
        try:
            if dtype is None or dtype.kind == "O":
                return np.asarray(value, dtype=dtype)
            return from_json(value, dtype)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"input {name!r} of runner {self.label}: {exc}") from None


def _needs_threads(component: Any, kind: str) -> bool:
    """Whether a streaming runner has sync methods to run on threads of its own."""
    if kind == "generator":
        return not inspect.isasyncgenfunction(component.infer)
    coroutine = inspect.iscoroutinefunction
    return not (coroutine(component.start) and coroutine(component.step))


def batch_policy(runner: RunnerSection) -> BatchPolicy:
    """The scheduler settings of a manifest's ``[runner]`` table."""
    return BatchPolicy(
        max_batch_size=runner.max_batch_size,
        max_queue_delay_s=runner.max_queue_delay_ms / 1000,
        preferred_batch_sizes=runner.preferred_batch_sizes,
        instances=runner.instances,
        max_queue_size=runner.max_queue_size,
        priority_levels=runner.priority_levels,
        default_priority=runner.default_priority_level,
        tenant_weights=runner.tenant_weights,
    )


def _numeric_bytes(inputs: Mapping[str, np.ndarray]) -> int:
    """The bytes of a batch's tensors; 0 where one holds text or objects (BYTES, numpy
    strings): their size does not say their cost."""
    total = 0
    for array in inputs.values():
        if array.dtype.kind not in "biufc":
            return 0
        total += array.nbytes
    return total


def _small(inputs: Mapping[str, np.ndarray]) -> bool:
    """Whether a batch is small enough for a measured cost to speak for it: at most
    ``INLINE_MAX_ROWS`` rows and ``INLINE_MAX_BYTES`` of data, BYTES elements counted."""
    if _rows(inputs) > INLINE_MAX_ROWS:
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


def _rows(inputs: Mapping[str, np.ndarray]) -> int:
    for value in inputs.values():
        return int(value.shape[0]) if value.ndim else 1
    return 0
