"""A runner that answers a request with a stream of responses (``registry/streaming.py``)."""

from __future__ import annotations

import inspect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NoReturn

from plugserve.registry.errors import StreamingOnly
from plugserve.registry.execution.breaker import CircuitBreaker
from plugserve.registry.execution.components.inline import rows
from plugserve.registry.execution.components.runner import Runner, batch_policy
from plugserve.registry.execution.stats import RunnerStats
from plugserve.registry.execution.streaming import Stream, StreamKind, StreamScheduler, stream_kind
from plugserve.registry.types import RequestContext


@dataclass(eq=False)
class StreamingRunner(Runner):
    """A generator (``infer`` yields) or step runner (``start`` and ``step``), its streams
    admitted, ordered and run by its :class:`StreamScheduler` behind its circuit breaker.

    Its synchronous methods run on threads of its own (``instances`` of them); an async
    generator, or ``async`` ``start`` and ``step``, on the event loop.
    """

    streams: StreamScheduler = field(init=False, repr=False)
    breaker: CircuitBreaker = field(init=False, repr=False)
    stats: RunnerStats = field(init=False, repr=False)

    def __post_init__(self) -> None:
        kind = stream_kind(self.component)
        assert kind is not None  # the loader makes a streaming runner of a streaming component
        super().__post_init__()
        runner = self.section
        self.breaker = CircuitBreaker(self.label, runner.breaker_failures, runner.breaker_reset_s)
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

    @property
    def queued(self) -> int:
        """Streams waiting for a place (``max_streams``)."""
        return self.streams.waiting

    async def call(self, data: Any, ctx: RequestContext) -> NoReturn:
        """Refused: a streaming runner answers :meth:`open_stream` only."""
        raise StreamingOnly(ctx.route)

    def open_stream(self, data: Any, ctx: RequestContext) -> Stream:
        """The responses to ``data``: started now, or queued for a place."""
        inputs = self.runner_inputs(data)
        self.validate_request(inputs)
        ctx.rows = rows(inputs)
        return self.streams.open(inputs, ctx.priority)

    async def close(self, within: float) -> None:
        self.streams.close()
        await super().close(within)


def _needs_threads(component: Any, kind: StreamKind) -> bool:
    """Whether a streaming runner has sync methods to run on threads of its own."""
    if kind == "generator":
        return not inspect.isasyncgenfunction(component.infer)
    coroutine = inspect.iscoroutinefunction
    return not (coroutine(component.start) and coroutine(component.step))
