"""A runner that answers each request once: its requests queue, form batches and execute."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.registry.errors import PluginError, PluginLoadError
from plugserve.registry.execution import batch_check
from plugserve.registry.execution.batch_check import BatchCheck
from plugserve.registry.execution.batching import Scheduler
from plugserve.registry.execution.breaker import CircuitBreaker
from plugserve.registry.execution.components.inline import ExecutionCosts, rows
from plugserve.registry.execution.components.runner import Runner, batch_policy
from plugserve.registry.execution.layout import BatchLayout
from plugserve.registry.execution.sequences import Sequences
from plugserve.registry.execution.stats import RunnerStats
from plugserve.registry.manifest import BatchCheckSpec
from plugserve.registry.plugins.calls import call_plugin
from plugserve.registry.types import RequestContext


@dataclass(eq=False)
class BatchedRunner(Runner):
    """A runner in this process whose requests go through its :class:`Scheduler` (batching,
    queue, priorities) behind its circuit breaker.

    A synchronous ``infer`` runs on the instance's own thread pool (ONNX Runtime
    releases the GIL); small batches proven cheap run on the event loop
    (:class:`~plugserve.registry.execution.components.inline.ExecutionCosts`).
    """

    scheduler: Scheduler = field(init=False, repr=False)
    breaker: CircuitBreaker = field(init=False, repr=False)
    stats: RunnerStats = field(init=False, repr=False)
    always_inline: bool = field(init=False, default=False, repr=False)
    """Run every execution on the event loop (:meth:`run_inline`)."""
    _method: Callable[..., Any] = field(init=False, repr=False)
    _is_async: bool = field(init=False, repr=False)
    _costs: ExecutionCosts = field(init=False, repr=False)
    sequences: Sequences | None = field(init=False, default=None, repr=False)
    """The live sequences of a runner that declares ``[runner.sequence]``."""
    batch_check: BatchCheck | None = field(init=False, default=None, repr=False)
    """What ``[runner.batching] check`` found at load (batching off where not exact)."""

    def __post_init__(self) -> None:
        self._method = self._method_named("infer")
        self._is_async = inspect.iscoroutinefunction(self._method)
        super().__post_init__()
        runner = self.section
        if not self._is_async:
            self._executor = ThreadPoolExecutor(runner.instances, thread_name_prefix=self.label)
        self._costs = ExecutionCosts(runner.inline_budget_us / 1e6)
        self.stats = RunnerStats()
        self.breaker = CircuitBreaker(self.label, runner.breaker_failures, runner.breaker_reset_s)
        self.scheduler = Scheduler(
            self._execute,
            batch_policy(runner),
            self.label,
            on_execution=self.stats.record_execution,
            busy=lambda: self.executing,
            on_failure=self._counted,
            stop=self.breaker.open_error,
            on_fallback=self.stats.record_fallback,
        )
        # A synchronous runner's small batches may run on the event loop once proven cheap
        # (ExecutionCosts), where no batch forms while one runs: without gathering, a load
        # that arrives while such batches are measured stays at one row a batch.
        self.scheduler.gather = not self._is_async
        layout = None if runner.batching is None else BatchLayout(runner.batching)
        if layout is not None:
            self.scheduler.declare(layout)
        sequence = runner.sequence
        if sequence is not None:
            sequences = Sequences(sequence, self.label, layout, queue=self.scheduler)
            self.scheduler.held = lambda: sequences.waiting
            self.sequences = sequences

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    def describe(self) -> dict[str, Any]:
        scheduler, breaker = self.scheduler, self.breaker
        figures: dict[str, Any] = {
            "queued": scheduler.queued,
            "executions": scheduler.executions,
            "batched_rows": scheduler.rows,
            "inline_executions": self.inline_executions,
        }
        if breaker.enabled:
            figures["circuit"], figures["circuit_trips"] = breaker.state, breaker.trips
        if self.sequences is not None:
            figures["sequences"] = self.sequences.describe()
        if scheduler.apart:
            figures["cannot_batch"] = {"count": scheduler.apart, "why": scheduler.apart_why}
        stats = self.stats
        if stats.batch_fallbacks:
            figures["batch_fallbacks"] = {
                "count": stats.batch_fallbacks,
                "requests": stats.fallback_requests,
                "why": scheduler.fallback_why,
            }
        checked = self.batching_checked()
        if checked is not None:
            figures["batching_check"] = checked
        return figures

    def batching_checked(self) -> dict[str, Any] | None:
        """What ``[runner.batching] check`` found at load, and whether batching is on."""
        if self.batch_check is None:
            return None
        batching = "on" if self.batch_check.exact else "off"
        return {"batching": batching, **self.batch_check.as_json()}

    # -- what batching does to answers ---------------------------------------------------

    async def warmup(self, within: float) -> None:
        """Warm up; with ``[runner.batching] check``, then check that batching keeps the
        answers, in what is left of ``within``: batching is turned off where it does not
        (a warning names the outputs), and the load fails where the check cannot run."""
        started = time.monotonic()
        await super().warmup(within)
        batching = self.section.batching
        if batching is None or batching.check is None:
            return
        left = within - (time.monotonic() - started)
        found: BatchCheck = await call_plugin(
            functools.partial(self.check_batching, batching.check),
            left, self.label, "batching check", "load_timeout_s",
        )  # fmt: skip
        if found.skipped is not None:
            return
        if found.error is not None:
            raise PluginLoadError(
                f"{self.label}: [runner.batching] check could not run: {found.error}"
            )
        self.batch_check = found
        if found.exact:
            self.info.logger.info("batching_checked", result=found.text())
            return
        self.scheduler.policy = dataclasses.replace(self.scheduler.policy, max_batch_size=0)
        self.info.logger.warning(
            "batching_off",
            outputs=found.outputs,
            found=found.problems(),
            why=found.why(),
            batching="off: each request runs alone and gets the answer it gets alone",
            fix="to batch anyway, widen the check's rtol and atol past these differences, "
            "or remove the check",
        )

    async def check_batching(self, spec: BatchCheckSpec) -> BatchCheck:
        """Whether batching keeps this runner's answers (:mod:`~plugserve.registry.
        execution.batch_check`): skipped where requests never batch."""
        limit = self.section.max_batch_size
        if limit <= 1:
            return BatchCheck(spec, skipped=f"max_batch_size = {limit}: requests never batch")
        if self.sequences is not None:
            return BatchCheck(spec, skipped="a sequence's requests carry the server's state")
        layout = self.scheduler.layout
        return await batch_check.check_batching(self._execute, layout, self._inputs, spec, limit)

    async def probe_outputs(self, sample: Path | None = None) -> list[str]:
        """Run one sample input (from ``sample``, a ``.npz``, where given): where its outputs
        contradict the declared shapes
        (:func:`~plugserve.registry.execution.batch_check.probe_outputs`)."""
        if self.sequences is not None:
            return []
        return await batch_check.probe_outputs(
            self._execute,
            self.scheduler.layout,
            self._inputs,
            self._metadata,
            self.section.max_batch_size > 1,
            sample,
        )

    async def call(self, data: Any, ctx: RequestContext) -> Any:
        """The request's outputs, once the batch it joined executed (a sequence's request
        in its sequence's turn, with its state: ``registry/execution/sequences.py``)."""
        inputs = self.runner_inputs(data)
        self.validate_request(inputs)
        layout = self.scheduler.layout
        ctx.rows = rows(inputs) if layout is None else layout.rows(inputs)
        self.breaker.allow()
        started = time.perf_counter()

        scheduler = self.scheduler
        try:
            if self.sequences is None:
                return await scheduler.submit(
                    inputs, ctx.deadline, ctx.priority, ctx.tenant, ctx.timings
                )
            return await self.sequences.run(
                inputs,
                ctx.parameters,
                lambda fed: scheduler.submit(
                    fed, ctx.deadline, ctx.priority, ctx.tenant, ctx.timings
                ),
            )
        finally:
            self.breaker.release()
            ctx.timings["compute_infer"] = (
                time.perf_counter() - started - ctx.timings.get("queue", 0.0)
            )

    def live_sequences(self) -> Sequences | None:
        return self.sequences

    async def wait_idle(self, within: float) -> bool:
        """Idle (:meth:`LoadedPlugin.wait_idle`), and, for a runner keeping sequences,
        every sequence ended: a reload leaves a running sequence its version until it ends
        or expires (within its idle timeout, however short ``within``)."""
        idle = await super().wait_idle(within)
        if not idle or self.sequences is None:
            return idle
        return await self.sequences.wait_ended(
            max(within, self.sequences.section.idle_timeout_s + 1.0)
        )

    async def close(self, within: float) -> None:
        self.scheduler.close()
        if self.sequences is not None:
            self.sequences.clear()
        await super().close(within)

    # -- where executions run ------------------------------------------------------------

    def run_on_loop(self, budget: float) -> None:
        """Let a synchronous runner's batches run on the event loop within ``budget``
        seconds each (:attr:`ExecutionCosts.loop_budget`); its scheduler gathers each loop
        turn's requests, as every synchronous runner's does. A runner with several
        instances, or with ``inline_budget_us = 0``, keeps its threads."""
        runner = self.section
        if (
            self._is_async
            or runner.instances > 1  # executions side by side: they need threads
            or runner.inline_budget_us == 0  # the runner's own "never on the loop"
        ):
            return
        self._costs.loop_budget = budget

    def run_inline(self) -> None:
        """Run every execution on the event loop (a runner process, whose loop has nothing
        else to do: requests that arrive meanwhile wait in the socket and form the next
        batch). A synchronous ``infer`` then runs in the loop step that cut its batch
        (:meth:`execute_inline`), with no task of its own."""
        self.always_inline = True
        if not self._is_async:
            self.scheduler.inline = self.execute_inline

    async def _execute(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """One execution on a (batched) input; what the scheduler calls."""
        try:
            if self._is_async:
                result = await self._method(inputs)
            elif self.always_inline or self._costs.runs_inline(inputs):
                self.inline_executions += 1
                result = self._timed(inputs)
            else:
                result = await self._on_thread(self._timed, inputs)
        except Exception as exc:
            self._raise_fault(exc)
        return self._result(result)

    def execute_inline(self, inputs: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """:meth:`_execute` on the caller's thread, for a sync runner that always runs
        inline (:meth:`run_inline`): a batch then runs in the loop step that cut it."""
        self.inline_executions += 1
        try:
            result = self._timed(inputs)
        except Exception as exc:
            self._raise_fault(exc)
        return self._result(result)

    def _timed(self, inputs: Mapping[str, np.ndarray]) -> Any:
        started = time.perf_counter()
        result = self._method(inputs)
        self._costs.record(inputs, time.perf_counter() - started)
        return result

    # -- outcomes ------------------------------------------------------------------------

    def _counted(self, exc: Exception) -> None:
        """An execution of one request failed with ``exc`` (the scheduler reports it once it
        knows whose fault it is): counted against the runner unless it is the request's own
        mistake (400) or the runner's own 503 or 504."""
        if getattr(exc, "status", 500) == 500:
            self.breaker.failure()

    def _result(self, result: Any) -> Mapping[str, np.ndarray]:
        if not isinstance(result, Mapping):
            problem = TypeError(f"infer() returned {type(result).__name__}, not a dict of arrays")
            raise PluginError(self.label, problem)
        self.breaker.success()
        return result
