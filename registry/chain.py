"""A resolved inference chain: preprocessors, one runner, postprocessors, fixed for one request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from registry.components import LoadedPlugin
from registry.types import RequestContext


@dataclass(frozen=True, eq=False)
class Chain:
    """The instances one request runs on, start to end, whatever reloads meanwhile."""

    route: str
    preprocess: tuple[LoadedPlugin, ...]
    runner: LoadedPlugin
    postprocess: tuple[LoadedPlugin, ...]
    stages: tuple[LoadedPlugin, ...] = field(init=False)
    versions: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        stages = (*self.preprocess, self.runner, *self.postprocess)
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "versions", {s.manifest.name: s.version for s in stages})

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
        """Run every stage in order; each stage gets what the previous one returned."""
        for stage in self.stages:
            data = await stage.call(data, ctx)
        return data

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
