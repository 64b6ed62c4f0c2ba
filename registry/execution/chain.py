"""A resolved inference chain: preprocessors, one runner, postprocessors, fixed for one request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plugserve.registry.errors import Unavailable
from plugserve.registry.execution import tracing
from plugserve.registry.execution.components.base import LoadedPlugin
from plugserve.registry.execution.components.streaming import StreamingRunner
from plugserve.registry.types import RequestContext

StageCall = Callable[[LoadedPlugin, Any, RequestContext], Awaitable[Any]]


@dataclass(frozen=True, eq=False)
class Chain:
    """The instances one request runs on, start to end, whatever reloads meanwhile."""

    route: str
    preprocess: tuple[LoadedPlugin, ...]
    runner: LoadedPlugin
    postprocess: tuple[LoadedPlugin, ...]
    stages: tuple[LoadedPlugin, ...] = field(init=False)
    versions: dict[str, str] = field(init=False)
    label: str = field(init=False)
    variant: str = field(init=False)
    """The runner version, ``name@version``: the response's ``X-Plugserve-Variant``."""

    def __post_init__(self) -> None:
        stages = (*self.preprocess, self.runner, *self.postprocess)
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "versions", {s.manifest.name: s.version for s in stages})
        object.__setattr__(self, "variant", f"{self.runner.manifest.name}@{self.runner.version}")
        object.__setattr__(
            self, "label", " > ".join(f"{s.manifest.name}@{s.version}" for s in stages)
        )

    @property
    def runner_version(self) -> str:
        return self.runner.version

    def enter(self) -> None:
        """Count the request in on every instance; call in the step that resolved the chain."""
        for stage in self.stages:
            stage.enter()

    def leave(self) -> None:
        for stage in self.stages:
            stage.leave()

    async def run(self, data: Any, ctx: RequestContext) -> Any:
        """Run every stage in order; each stage gets what the previous one returned.

        Named tensors (a v2 request) are first checked against the first
        stage's declared inputs, when it declares some
        (:meth:`LoadedPlugin.check_request`): a client's mistake is a 400 here,
        not an exception inside a plugin. Times the stages into ``ctx.timings``
        (``compute_input`` for the preprocessors, ``queue`` and ``compute_infer``
        for the runner, ``compute_output`` for the postprocessors) and records
        the request in the runner version's statistics.
        """
        started = time.perf_counter()
        ok = cancelled = False
        call = _call if tracing.TRACER is None else _traced
        try:
            if self.preprocess:
                data = await self._preprocess(data, ctx, call, started)
            else:  # the runner first: its check alone, without a coroutine of its own
                data = self._checked(data)
                ctx.timings["compute_input"] = time.perf_counter() - started
            data = await self._infer(call, data, ctx)
            mark = time.perf_counter()
            for stage in self.postprocess:
                data = await call(stage, data, ctx)
            ctx.timings["compute_output"] = time.perf_counter() - mark
            ok = True
            return data
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and not task.cancelling():
                # Not this request's cancellation (its client hanging up, a deadline, a
                # shutdown): a plugin raised CancelledError, or its runner cancelled the
                # batch. Left as it was, the request would end with no answer at all.
                raise Unavailable(
                    f"{self.label}: the request was cancelled inside the server (a plugin "
                    "raised CancelledError, or its runner was stopping)",
                    retry_after_s=1,
                ) from None
            cancelled = True  # the client hung up: neither a success nor a failure
            raise
        finally:
            if not cancelled:
                self._record(ok, started, ctx)

    def _infer(self, call: StageCall, data: Any, ctx: RequestContext) -> Awaitable[Any]:
        """What runs between the processors: the runner (a graph's steps, ``graph.py``)."""
        return call(self.runner, data, ctx)

    async def _preprocess(self, data: Any, ctx: RequestContext, call: Any, started: float) -> Any:
        """The request checked against the first stage's inputs, through the preprocessors."""
        data = self._checked(data)
        for stage in self.preprocess:
            data = await call(stage, data, ctx)
        ctx.timings["compute_input"] = time.perf_counter() - started
        return data

    def _checked(self, data: Any) -> Any:
        """Named tensors checked against the first stage's declared inputs; other data as is."""
        return self.stages[0].check_request(data, self.route) if _tensors(data) else data

    def _record(self, ok: bool, started: float, ctx: RequestContext) -> None:
        """The request in the runner version's statistics (a shadow copy serves no client:
        it is not counted)."""
        if self.runner.stats is not None and not ctx.shadow:
            took = time.perf_counter() - started
            self.runner.stats.record_request(ok, took, ctx.timings, ctx.rows)

    @property
    def streaming(self) -> bool:
        """Whether the runner streams: several responses a request (``streaming.py``)."""
        return isinstance(self.runner, StreamingRunner)

    async def stream(self, data: Any, ctx: RequestContext) -> AsyncGenerator[Any, None]:
        """Run the chain on a request answered by a stream of responses, in order.

        The preprocessors run once; each runner response then goes through every
        postprocessor (a postprocessor's ``None`` sends nothing for it), counted
        in ``ctx.usage["completion_tokens"]``. A runner that answers once gives
        one response. Closing this generator (``aclose()``: the client left)
        closes the runner's stream before its next step.
        """
        runner = self.runner
        if not isinstance(runner, StreamingRunner):
            yield await self.run(data, ctx)
            return
        started = time.perf_counter()
        ok = cancelled = False
        call = _call if tracing.TRACER is None else _traced
        usage = ctx.usage
        try:
            data = await self._preprocess(data, ctx, call, started)
            responses = runner.open_stream(data, ctx)
            try:
                async for response in responses:
                    usage["completion_tokens"] = usage.get("completion_tokens", 0) + 1
                    for stage in self.postprocess:
                        response = await call(stage, response, ctx)
                        if response is None:
                            break
                    else:
                        yield response
            finally:
                responses.close()
            ok = True
        except (asyncio.CancelledError, GeneratorExit):  # the client left
            cancelled = True
            raise
        finally:
            if not cancelled:
                self._record(ok, started, ctx)

    def metadata(self) -> dict[str, Any]:
        """Tensor specs of the route: the first stage's inputs and the last stage's outputs.

        A stage without ``metadata()`` has no specs to show; the runner's stand
        in for a side of the chain that has no processors.
        """
        first = self.stages[0].metadata() or {}
        last = self.stages[-1].metadata() or {}
        return {"inputs": list(first.get("inputs", [])), "outputs": list(last.get("outputs", []))}

    def describe(self) -> dict[str, Any]:
        return {
            "preprocess": [s.label for s in self.preprocess],
            "runner": self.runner.label,
            "postprocess": [s.label for s in self.postprocess],
        }


def _tensors(data: Any) -> bool:
    """Whether ``data`` is named tensors (a v2 request), not a ``/predict`` body."""
    if not isinstance(data, dict) and not isinstance(data, Mapping):  # a dict: no ABC check
        return False
    return bool(data) and all(isinstance(value, np.ndarray) for value in data.values())


def _call(stage: LoadedPlugin, data: Any, ctx: RequestContext) -> Awaitable[Any]:
    return stage.call(data, ctx)  # the coroutine itself: no extra layer when not tracing


async def _traced(stage: LoadedPlugin, data: Any, ctx: RequestContext) -> Any:
    with tracing.TRACER.start_as_current_span(
        f"{stage.manifest.type} {stage.manifest.name}",
        attributes={"plugserve.plugin": stage.label},
    ):
        return await stage.call(data, ctx)
