"""A runner in processes of its own (``isolation = "process"``), as a worker's chain sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from plugserve.registry.errors import PlugserveError
from plugserve.registry.execution.components.inline import rows
from plugserve.registry.execution.components.runner import Runner
from plugserve.registry.execution.isolation.remote import RemoteRunner
from plugserve.registry.execution.sequences import SeenSequences
from plugserve.registry.execution.stats import RunnerStats
from plugserve.registry.types import RequestContext


@dataclass(eq=False)
class IsolatedRunner(Runner):
    """An isolated runner version: its component is the :class:`RemoteRunner` that sends each
    request to one of its processes, where a scheduler batches it and the runner executes.

    Its statistics count the requests this process sent; the executions are the
    processes' own (:attr:`RemoteRunner.executions`).
    """

    remote: RemoteRunner = field(init=False, repr=False)
    stats: RunnerStats = field(init=False, repr=False)
    seen: SeenSequences | None = field(init=False, default=None, repr=False)
    """The sequences this worker's requests run in its processes (``[runner.sequence]``)."""
    metadata_from_model: ClassVar[bool] = False  # its processes' runners answer as shown

    def __post_init__(self) -> None:
        if not isinstance(self.component, RemoteRunner):
            raise TypeError(f"{self.label}: an isolated runner's component is a RemoteRunner")
        super().__post_init__()
        self.remote = self.component
        self.stats = RunnerStats()
        sequence = self.section.sequence
        self.seen = None if sequence is None else SeenSequences(sequence)

    def describe(self) -> dict[str, Any]:
        return self.remote.describe()

    def live_sequences(self) -> SeenSequences | None:
        return self.seen

    async def call(self, data: Any, ctx: RequestContext) -> Any:
        """The request's outputs, from the runner process that took it."""
        inputs = self.runner_inputs(data)
        ctx.rows = rows(inputs)
        seen = self.seen
        if seen is None:
            return await self.remote.infer(inputs, ctx)
        try:
            answer = await self.remote.infer(inputs, ctx)
        except PlugserveError as exc:
            seen.answered(ctx.parameters, exc.status)
            raise
        seen.answered(ctx.parameters, 200)
        return answer

    async def wait_idle(self, within: float) -> bool:
        """Idle, and every sequence this worker's requests run in its processes ended: a
        reload leaves a running sequence its version until it ends or expires."""
        idle = await super().wait_idle(within)
        if not idle or self.seen is None:
            return idle
        return await self.seen.wait_ended(max(within, self.seen.section.idle_timeout_s + 1.0))

    async def close(self, within: float) -> None:
        """Close its connections and release its processes (they end once nobody uses them)."""
        if self.seen is not None:
            self.seen.clear()
        await self.remote.close()
