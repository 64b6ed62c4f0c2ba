"""A graph route: several runners, processors or other routes, their tensors mapped from
one stage to the next (Triton's ensemble ``input_map``/``output_map``).

The route's tensors start as the request's (after the route's preprocessors). Each step
takes the tensors its ``inputs`` name, under its own input names, and adds its outputs
to the route's tensors under the names its ``outputs`` give. Steps run as soon as the
steps they read from have answered: steps of one wave run concurrently. Each runner
keeps its own queue and batching: concurrent requests of the route batch in each. The
route answers the tensors its ``outputs`` name (by default, those no step reads), then
its postprocessors run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from plugserve.registry.errors import (
    DeadlineExceeded,
    InvalidInput,
    PluginError,
    RoutesTooDeep,
    Unavailable,
)
from plugserve.registry.execution.chain import Chain, StageCall
from plugserve.registry.execution.components.base import LoadedPlugin
from plugserve.registry.execution.together import together
from plugserve.registry.types import RequestContext


@dataclass(frozen=True, eq=False)
class Step:
    """One stage of a graph: what it runs and how its tensors are named."""

    target: LoadedPlugin | Chain
    """A runner or processor instance, or another route's chain (called in-process)."""
    inputs: tuple[tuple[str, str], ...]
    """(the stage's input name, the route tensor it takes)."""
    outputs: tuple[tuple[str, str], ...]
    """(the stage's output name, the route tensor it gives)."""

    @property
    def label(self) -> str:
        target = self.target
        return f"route {target.route}" if isinstance(target, Chain) else target.label

    @property
    def instances(self) -> tuple[LoadedPlugin, ...]:
        target = self.target
        return target.stages if isinstance(target, Chain) else (target,)

    def describe(self) -> dict[str, Any]:
        target = self.target
        what: dict[str, Any] = (
            {"route": target.route, "serving": target.describe()}
            if isinstance(target, Chain)
            else {target.manifest.type: target.label}
        )
        return {**what, "inputs": dict(self.inputs), "outputs": dict(self.outputs)}


@dataclass(frozen=True, eq=False)
class Graph(Chain):
    """A route's graph of steps between its preprocessors and postprocessors.

    ``runner`` is the graph's last runner step: its version names the route's variant
    and version, as a single runner's does.
    """

    steps: tuple[Step, ...] = ()
    answers: tuple[str, ...] = ()
    """The route tensors the graph answers."""
    waves: tuple[tuple[Step, ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        seen: dict[int, LoadedPlugin] = {}
        for stage in (*self.preprocess, *(i for s in self.steps for i in s.instances)):
            seen.setdefault(id(stage), stage)
        for stage in self.postprocess:
            seen.setdefault(id(stage), stage)
        stages = tuple(seen.values())
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "versions", {s.manifest.name: s.version for s in stages})
        steps = " + ".join(s.label for s in self.steps)
        ends = [
            *(s.label for s in self.preprocess),
            f"[{steps}]",
            *(s.label for s in self.postprocess),
        ]
        object.__setattr__(self, "label", " > ".join(ends))
        object.__setattr__(self, "waves", _waves(self.steps))

    def _checked(self, data: Any) -> Any:
        """Each step checks what it takes (its runner's declared inputs): the request's
        tensors are the route's, under the route's names."""
        return data

    def _infer(self, call: StageCall, data: Any, ctx: RequestContext) -> Awaitable[Any]:
        return self._run_graph(call, data, ctx)

    async def _run_graph(self, call: StageCall, data: Any, ctx: RequestContext) -> Any:
        if not isinstance(data, Mapping):
            raise InvalidInput(
                f"route {self.route!r} runs a graph: it takes named tensors, not "
                f"{type(data).__name__}"
            )
        tensors = dict(data)
        for wave in self.waves:
            if len(wave) == 1:
                await self._step(wave[0], tensors, call, ctx)
            else:  # the first step to fail stops the others; the wave raises the ranked error
                await together([self._step(step, tensors, call, ctx) for step in wave])
        return {name: tensors[name] for name in self.answers}

    async def _step(
        self, step: Step, tensors: dict[str, Any], call: StageCall, ctx: RequestContext
    ) -> None:
        fed = {}
        for name, tensor in step.inputs:
            if tensor not in tensors:
                raise InvalidInput(
                    f"route {self.route!r}: {step.label} takes tensor {tensor!r}, which the "
                    f"request does not send (it sends {sorted(tensors)})"
                )
            fed[name] = tensors[tensor]
        target = step.target
        if isinstance(target, Chain):
            answer = await target.run(fed, child_context(ctx, target.route))
        else:
            answer = await call(target, fed, ctx)
        if not isinstance(answer, Mapping):
            raise PluginError(
                step.label,
                TypeError(f"answered {type(answer).__name__}; a graph step answers named tensors"),
            )
        for name, tensor in step.outputs:
            if name not in answer:
                raise PluginError(
                    step.label,
                    KeyError(f"answered no output {name!r} (it answered {sorted(answer)})"),
                )
            tensors[tensor] = answer[name]

    def _record(self, ok: bool, started: float, ctx: RequestContext) -> None:
        """The request in each runner step's statistics (each served it; a shadow copy
        served no client)."""
        if ctx.shadow:
            return
        took = time.perf_counter() - started
        for step in self.steps:
            target = step.target
            if isinstance(target, Chain) or target.manifest.type != "runner":
                continue
            if target.stats is not None:
                target.stats.record_request(ok, took, ctx.timings, ctx.rows)

    @property
    def streaming(self) -> bool:
        return False

    def metadata(self) -> dict[str, Any]:
        """The route's inputs (what the steps take that no step gives, as the first stage
        that takes each declares it) and outputs (its answers, as their steps declare them);
        processors around the graph stand in for their side, as in a chain."""
        given = {tensor for step in self.steps for _, tensor in step.outputs}
        inputs: dict[str, dict[str, Any]] = {}
        outputs: dict[str, dict[str, Any]] = {}
        for step in self.steps:
            declared = step.target.metadata() or {}
            specs = {spec.get("name"): spec for spec in declared.get("inputs", [])}
            for name, tensor in step.inputs:
                if tensor not in given and tensor not in inputs and name in specs:
                    inputs[tensor] = {**specs[name], "name": tensor}
            specs = {spec.get("name"): spec for spec in declared.get("outputs", [])}
            for name, tensor in step.outputs:
                if tensor in self.answers and name in specs:
                    outputs[tensor] = {**specs[name], "name": tensor}
        shown = {
            "inputs": list(inputs.values()),
            "outputs": [outputs[a] for a in self.answers if a in outputs],
        }
        if self.preprocess:
            shown["inputs"] = list((self.preprocess[0].metadata() or {}).get("inputs", []))
        if self.postprocess:
            shown["outputs"] = list((self.postprocess[-1].metadata() or {}).get("outputs", []))
        return shown

    def describe(self) -> dict[str, Any]:
        return {
            "preprocess": [s.label for s in self.preprocess],
            "runner": self.runner.label,
            "graph": [step.describe() for step in self.steps],
            "outputs": list(self.answers),
            "postprocess": [s.label for s in self.postprocess],
        }


def _waves(steps: tuple[Step, ...]) -> tuple[tuple[Step, ...], ...]:
    """Steps grouped by when they can run: a step's wave follows those of the steps whose
    outputs it takes (a step only takes outputs of steps before it)."""
    producer: dict[str, int] = {}
    levels: list[int] = []
    for index, step in enumerate(steps):
        level = max((levels[producer[t]] + 1 for _, t in step.inputs if t in producer), default=0)
        levels.append(level)
        for _, tensor in step.outputs:
            producer[tensor] = index
    waves: list[list[Step]] = [[] for _ in range(max(levels, default=-1) + 1)]
    for step, level in zip(steps, levels, strict=True):
        waves[level].append(step)
    return tuple(tuple(wave) for wave in waves)


MAX_DEPTH = 8
"""Routes calling routes (graph steps, ``ctx.infer``) nest at most this deep."""


def child_context(ctx: RequestContext, route: str) -> RequestContext:
    """The ``ctx`` of a route called on behalf of ``ctx``'s request: the same request id,
    deadline, priority, tenant and headers; its own state and timings."""
    depth = ctx.depth + 1
    if depth > MAX_DEPTH:
        raise RoutesTooDeep(
            f"route {route!r}: routes call routes more than {MAX_DEPTH} deep (a loop?)"
        )
    return derived_context(ctx, {}, route=route, depth=depth)


def derived_context(
    ctx: RequestContext,
    parameters: Mapping[str, Any],
    route: str | None = None,
    depth: int | None = None,
) -> RequestContext:
    """A context for one more run on behalf of ``ctx``'s request (its id, headers,
    deadline, priority, tenant, router): its own parameters, state, timings and usage;
    another ``route`` starts with no versions of its own."""
    return dataclasses.replace(
        ctx,
        route=ctx.route if route is None else route,
        parameters=parameters,
        versions=dict(ctx.versions) if route is None else {},
        state={},
        timings={},
        rows=0,
        usage={},
        depth=ctx.depth if depth is None else depth,
    )


Resolve = Callable[[str, str | None, float | None], Awaitable[Chain]]
"""``resolve(route, version, within_s)``: the chain serving ``route`` now, loading what
loads on its first request (waiting at most ``within_s``), as a client's request does."""


TIMER_SLACK_S = 0.01
"""How much before the request's deadline, by ``time.monotonic()``, a wait bounded by it may
end: uvloop's timers count whole milliseconds."""


class RouteCaller:
    """``ctx.infer(route, inputs)``: another route's chain run in-process for a plugin,
    resolved from the route table as it stands, as a client's request to it would be."""

    __slots__ = ("_resolve",)

    def __init__(self, resolve: Resolve) -> None:
        self._resolve = resolve

    async def __call__(
        self, ctx: RequestContext, route: str, inputs: Any, version: str | None = None
    ) -> Any:
        sub = child_context(ctx, route)
        chain = await self._chain(ctx, route, version)
        chain.enter()  # in the step that resolved it: no reload releases it meanwhile
        try:
            return await chain.run(inputs, sub)
        finally:
            chain.leave()

    async def _chain(self, ctx: RequestContext, route: str, version: str | None) -> Chain:
        """The chain serving ``route``, waiting for its load until the request's deadline:
        a wait that the deadline ends is the request's 504, not the route's 503."""
        deadline = ctx.deadline
        within = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            return await self._resolve(route, version, within)
        except Unavailable:
            if deadline is None or time.monotonic() < deadline - TIMER_SLACK_S:
                raise
        # Raised here, outside the handler: it keeps nothing of the 503 it stands for.
        raise DeadlineExceeded(f"route {route!r} was not ready when the request's deadline passed")
