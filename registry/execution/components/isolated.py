"""A runner in processes of its own (``isolation = "process"``), as a worker's chain sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plugserve.registry.execution.components.inline import rows
from plugserve.registry.execution.components.runner import Runner
from plugserve.registry.execution.isolation.remote import RemoteRunner
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

    def __post_init__(self) -> None:
        if not isinstance(self.component, RemoteRunner):
            raise TypeError(f"{self.label}: an isolated runner's component is a RemoteRunner")
        super().__post_init__()
        self.remote = self.component
        self.stats = RunnerStats()

    def describe(self) -> dict[str, Any]:
        return self.remote.describe()

    async def call(self, data: Any, ctx: RequestContext) -> Any:
        """The request's outputs, from the runner process that took it."""
        inputs = self.runner_inputs(data)
        ctx.rows = rows(inputs)
        return await self.remote.infer(inputs, ctx)

    async def close(self, within: float) -> None:
        """Close its connections and release its processes (they end once nobody uses them)."""
        await self.remote.close()
