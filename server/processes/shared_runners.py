"""Isolated runners with several workers: the supervisor runs them, every worker uses them.

The supervisor holds the :class:`plugserve.registry.execution.isolation.host.RunnerHost`; a worker's
registry asks it for the processes of each isolated version it loads
(:class:`SupervisedRunners`, its ``Runners``), connects to them and sends its
requests there, so one process batches the requests of every worker. Workers
loading the same content join the same processes (a worker is a *holder*);
the last holder to release them ends them, and a worker that dies releases
what it held.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Metric, generate_latest
from prometheus_client.registry import Collector

from plugserve.registry.errors import PluginLoadError, Unavailable
from plugserve.registry.execution.isolation.groups import (
    ProcessSettings,
    RunnerGroup,
    RunnerProcess,
    RunnerSpec,
    group_from_json,
)
from plugserve.registry.execution.isolation.host import RunnerHost
from plugserve.registry.execution.stats import RunnerStats
from plugserve.server.processes.unix import Reply, UnixClient
from plugserve.server.runtime.metrics import add_process_figures, execution_families

log = structlog.get_logger("plugserve.worker")

RUNNERS = web.AppKey("runners", RunnerHost)
PREFIX = "/_supervisor/runners"
SUPERVISOR_GONE = (aiohttp.ClientError, OSError, TimeoutError)
"""What a call to a supervisor that is not there (killed, or ended) raises."""


def supervisor_gone(exc: BaseException) -> Unavailable:
    """The answer to a request that needed the supervisor once it is gone: the worker
    drains and exits (docs/operations.md, Workers), so the server is shutting down."""
    return Unavailable(
        f"the server is shutting down: its supervisor is not answering ({type(exc).__name__})",
        retry_after_s=1,
    )


class SupervisedRunners:
    """A worker's isolated runners, run by its supervisor for every worker."""

    def __init__(self, supervisor: UnixClient, holder: str, settings: ProcessSettings) -> None:
        self.supervisor = supervisor
        self.holder = holder
        self.settings = settings

    async def acquire(self, content: str, spec: RunnerSpec) -> RunnerGroup:
        reply = await self.supervisor.call(
            "POST",
            PREFIX,
            json_body={"content": content, "holder": self.holder, "spec": spec.as_json()},
        )
        if reply.status != 200:
            raise PluginLoadError(_message(reply.json()))
        return group_from_json(reply.json(), spec)

    async def ready(self, key: str, index: int) -> RunnerProcess:
        reply = await self._call("/ready", {"key": key, "index": index})
        doc = reply.json()
        if reply.status != 200:
            raise Unavailable(_message(doc), retry_after_s=1)
        process = RunnerProcess(index, doc["device"], Path(doc["socket"]), doc["pid"])
        process.up.set()
        return process

    async def ended(self, key: str, index: int, pid: int) -> str | None:
        reply = await self._call("/ended", {"key": key, "index": index, "pid": pid})
        how = reply.json().get("how")
        return None if how is None else str(how)

    async def _call(self, path: str, body: dict[str, Any]) -> Reply:
        """A call about a request in flight; :class:`Unavailable` once the supervisor is gone
        (its runner processes end with it)."""
        try:
            return await self.supervisor.call("POST", PREFIX + path, json_body=body)
        except SUPERVISOR_GONE as exc:
            log.debug("supervisor_not_answering", path=path, error=repr(exc))
            raise supervisor_gone(exc) from None

    async def release(self, key: str) -> None:
        try:
            await self.supervisor.call(
                "POST", PREFIX + "/release", json_body={"key": key, "holder": self.holder}
            )
        except SUPERVISOR_GONE as exc:
            # The supervisor is gone (the worker is draining to exit): it ended them, or
            # its runner processes end with it (parent-death signal).
            log.debug("runner_release_skipped", key=key, error=str(exc))

    async def figures(self, key: str) -> dict[str, Any]:
        """Nothing here: the supervisor adds the processes' figures to what it answers."""
        return {}

    async def close(self) -> None:
        """Nothing: the supervisor ends the processes (this worker's holds with it)."""


def _message(doc: Any) -> str:
    return str(doc.get("error", doc)) if isinstance(doc, dict) else str(doc)


async def _acquire(request: web.Request) -> web.Response:
    body = await request.json()
    spec = RunnerSpec.from_json(body["spec"])
    group = await request.app[RUNNERS].acquire(str(body["content"]), spec, str(body["holder"]))
    return web.json_response(group.as_json())


async def _ready(request: web.Request) -> web.Response:
    body = await request.json()
    process = await request.app[RUNNERS].ready(str(body["key"]), int(body["index"]))
    return web.json_response(
        {"socket": str(process.socket), "pid": process.pid, "device": process.device}
    )


async def _ended(request: web.Request) -> web.Response:
    body = await request.json()
    how = await request.app[RUNNERS].ended(str(body["key"]), int(body["index"]), int(body["pid"]))
    return web.json_response({"how": how})


async def _release(request: web.Request) -> web.Response:
    body = await request.json()
    await request.app[RUNNERS].release(str(body["key"]), str(body["holder"]))
    return web.json_response({"released": True})


def add_routes(app: web.Application, host: RunnerHost) -> None:
    """The supervisor's side (its control app)."""
    app[RUNNERS] = host
    app.router.add_post(PREFIX, _acquire)
    app.router.add_post(PREFIX + "/ready", _ready)
    app.router.add_post(PREFIX + "/ended", _ended)
    app.router.add_post(PREFIX + "/release", _release)


async def metrics_text(host: RunnerHost) -> str:
    """The executions of the runner processes (counted here, not by the workers), in the
    exposition format of the workers' own series, to be merged with theirs."""
    queued, circuit, batch, executions = execution_families()
    for group in list(host.current.values()):
        if group.stopping:
            continue
        figures = await host.figures(group.key)
        kind, rest = group.spec.label.split("/", 1)
        name, version = rest.rsplit("@", 1)
        key = [kind, name, version]
        add_process_figures((queued, circuit), key, figures)
        stats = figures.get("stats")
        if isinstance(stats, RunnerStats):
            batch.add_metric(key, stats.batch_sizes.cumulative(), sum_value=stats.batch_sizes.total)
            executions.add_metric(key, stats.execution_count)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([queued, circuit, batch, executions]))
    return generate_latest(registry).decode()


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self.families
