"""Triton's statistics extension, protocol-neutral: per route and runner version, cumulative
since load. :class:`LocalStatistics` counts this process's; a worker among several asks
its supervisor (``server/processes/supervised.py``), which merges every worker's."""

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import quote

from aiohttp import web

from plugserve.registry.execution.chain import Chain
from plugserve.registry.lifecycle.registry import Registry

ISOLATED_RUNNER = "_isolated_runner"
"""Marks, in a worker's statistics, an isolated runner whose executions its supervisor
counts (and fills in, removing the mark)."""

STATS_PATHS = (
    "/v2/models/stats",
    "/v2/models/{route}/stats",
    "/v2/models/{route}/versions/{version}/stats",
)
"""The statistics extension's HTTP paths (a supervisor answers them all for its workers)."""


def stats_path(route: str | None = None, version: str | None = None) -> str:
    """The statistics extension's path for ``route`` (and ``version``), quoted."""
    if route is None:
        return STATS_PATHS[0]
    path = f"/v2/models/{quote(route, safe='')}"
    if version is not None:
        path += f"/versions/{quote(version, safe='')}"
    return path + "/stats"


class Statistics(Protocol):
    """The whole server's statistics, of every route or of ``route`` (and ``version``)."""

    async def of(self, route: str | None = None, version: str | None = None) -> dict[str, Any]:
        """Triton's ``{"model_stats": [...]}``; 404/503 for a route not served, as inference."""
        ...


class LocalStatistics:
    """This process's statistics: the single server's, or one worker's own."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def of(self, route: str | None = None, version: str | None = None) -> dict[str, Any]:
        registry = self.registry
        await registry.refresh_isolated()  # their processes count the executions
        table = registry.routes
        if route is not None:
            resolved = table.resolve(route, version)  # 404/503 as for inference
            if version is not None:  # an integer alias ("1") names the version it resolves to
                version = resolved.runner_version
        stats = []
        for name, entry in sorted(table.entries.items()):
            if route is not None and name != route:
                continue
            for runner_version, chain in entry.by_version.items():
                if version is not None and runner_version != version:
                    continue
                counted = chain.runner.stats if isinstance(chain, Chain) else None
                if isinstance(chain, Chain) and counted is not None:
                    runner, remote = chain.runner, chain.runner.remote
                    executions = remote.executions if remote is not None else None
                    answer = counted.as_triton(name, runner_version, executions)
                    if remote is not None and executions is None:
                        answer[ISOLATED_RUNNER] = runner.label
                    stats.append(answer)
        return {"model_stats": stats}


STATISTICS: web.AppKey[Statistics] = web.AppKey("statistics")
"""Triton's statistics of the whole server: this process's, or through the supervisor."""
