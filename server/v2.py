"""The KServe v2 / Open Inference Protocol data plane, with a route as the model."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

import numpy as np
from aiohttp import hdrs, web
from aiohttp.typedefs import Handler

from plugserve.registry.cache import run_chain
from plugserve.registry.chain import Chain
from plugserve.registry.errors import PluginError, Unavailable
from plugserve.registry.routes import RouteTable
from plugserve.server import __version__, compression
from plugserve.server.auth import admin_only
from plugserve.server.bodies import LARGE_BODY_BYTES, Bodies
from plugserve.server.codec import (
    HEADER_LENGTH,
    as_tensor,
    decode_request,
    encode_response,
    json_header_size,
)
from plugserve.server.serving import admit, deadline_seconds, measured, request_context, serve
from plugserve.server.state import (
    BODIES,
    DRAIN,
    REGISTRY,
    REPOSITORY,
    RESPONSE_CACHE,
    ROUTE_STORE,
    SETTINGS,
    WORKER,
)
from plugserve.server.triton import classification, config, repository, shm_http

EXTENSIONS = [
    "binary_tensor_data",
    "statistics",
    "classification",
    "model_repository",
    "model_configuration",
    "system_shared_memory",
]
"""Triton's extensions this server speaks, by Triton's names."""


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response(
        {"name": "plugserve", "version": __version__, "extensions": EXTENSIONS}
    )


async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    return web.json_response(await readiness(request.app))


async def readiness(app: web.Application) -> dict[str, Any]:
    """The server's readiness answer; :class:`Unavailable` (with why) when not ready."""
    if not app[REGISTRY].started:
        raise Unavailable("the server is starting: plugins are still loading")
    if app[DRAIN].draining:
        raise Unavailable("the server is shutting down")
    lost = app[REGISTRY].lost_roots
    if lost:
        # Loaded versions keep serving; what the folder will hold is unknown until it is back.
        raise Unavailable(
            "watched folder missing: " + ", ".join(sorted(str(p) for p in lost)),
            missing=sorted(str(p) for p in lost),
        )
    store = app[ROUTE_STORE]
    worker = app.get(WORKER)
    if worker is not None and worker.spec.fleet:  # the supervisor follows the fleet
        is_ready, details = await worker.fleet_health()
    elif store.mode == "local":
        return {"ready": True}
    else:
        is_ready, details = store.ready, store.health()
    # A fleet replica: ready once it has read the fleet's route table; an etcd
    # outage after that keeps it ready (it serves the last table) and shows here.
    if not is_ready:
        raise Unavailable("the fleet's route table has not been read from etcd yet", fleet=details)
    return {"ready": True, "fleet": details}


def _resolve(request: web.Request) -> Chain:
    route = request.match_info["route"]
    return request.app[REGISTRY].routes.resolve(route, request.match_info.get("version"))


async def model_metadata(request: web.Request) -> web.Response:
    chain = _resolve(request)
    return web.json_response(metadata(request.app[REGISTRY].routes, chain))


def metadata(routes: RouteTable, chain: Chain) -> dict[str, Any]:
    """A route's model metadata: its versions, platform, chain and tensors."""
    backend = chain.runner.manifest.runner.backend if chain.runner.manifest.runner else None
    return {
        "name": chain.route,
        "versions": routes.entries[chain.route].versions,
        "platform": backend or "python",
        "chain": chain.describe(),
        **chain.metadata(),
    }


async def model_ready(request: web.Request) -> web.Response:
    chain = _resolve(request)
    return web.json_response({"name": chain.route, "ready": True})


async def model_config(request: web.Request) -> web.Response:
    """Triton's model configuration extension: the route's configuration as its JSON."""
    return web.json_response(config.model_config(_resolve(request)))


async def infer(request: web.Request) -> web.Response:
    route = request.match_info["route"]
    return await measured(request, route, "v2", _infer(request, route))


async def _infer(request: web.Request, route: str) -> web.Response:
    app = request.app
    # 404/503/429 before a byte of the body is read or parsed; serve() resolves again.
    admit(request, route, request.match_info.get("version"))
    bodies = app[BODIES]
    header_length, limits = request.headers.get(HEADER_LENGTH), app[SETTINGS].limits
    body = await bodies.read(request, json=header_length is None)
    if header_length is not None:
        bodies.check_json(json_header_size(header_length, len(body)))
    decoded = await bodies.parse(
        request, body, lambda raw: decode_request(raw, header_length, limits)
    )

    deadline = deadline_seconds(request, decoded.parameters)
    ctx = request_context(request, route, "v2", decoded.parameters, deadline)
    cache = app[RESPONSE_CACHE]
    # The request's tensors in shared memory, if any: inputs read, output regions held.
    shared = await shm_http.attach(request, decoded) if decoded.uses_shared_memory else None
    if shared is not None and ctx.body_bytes is not None:
        ctx.body_bytes += shared.input_bytes

    classes = decoded.classifications() if decoded.outputs else None
    accept = request.headers.get(hdrs.ACCEPT_ENCODING)
    coding = compression.accepted(accept) if accept else None

    async def run(chain: Chain) -> web.Response:
        ctx.versions = dict(chain.versions)
        result = await run_chain(cache, chain, decoded.inputs, ctx)
        outputs = named_outputs(chain, result)
        if classes:
            outputs = classification.classify_outputs(chain, outputs, classes)
        if shared is not None:
            await shm_http.place(request, shared, outputs)
        version = chain.runner_version
        if sum(a.nbytes for a in outputs.values()) <= LARGE_BODY_BYTES:
            payload, headers = encode_response(decoded, route, version, outputs)
        else:  # a large response is encoded off the event loop
            payload, headers = await bodies.run(
                lambda: encode_response(decoded, route, version, outputs)
            )
        if coding is not None and len(payload) >= compression.MIN_BYTES:
            return await _compressed(payload, headers, coding, bodies)
        if len(headers) == 1:  # JSON: no header dict to build
            return web.Response(body=payload, content_type="application/json")
        return web.Response(body=payload, headers=headers)

    return await serve(request, route, request.match_info.get("version"), run, deadline)


async def repository_index(request: web.Request) -> web.Response:
    """Triton's repository index: every route, each runner version with its state."""
    ready_only = repository.index_request(await request.app[BODIES].read_control(request))
    return web.json_response(await request.app[REPOSITORY].index(ready_only))


async def repository_load(request: web.Request) -> web.Response:
    """Load a route from its files (or with Triton's ``config`` over its runner settings)."""
    config = repository.load_request(await request.app[BODIES].read_control(request))
    route = request.match_info["route"]
    return web.json_response(await request.app[REPOSITORY].load(route, config))


async def repository_unload(request: web.Request) -> web.Response:
    """Unload every version of a route's runner (``unload_dependents`` changes nothing)."""
    return web.json_response(await request.app[REPOSITORY].unload(request.match_info["route"]))


REPOSITORY_PATHS = (
    ("/v2/repository/index", repository_index),
    ("/v2/repository/models/{route}/load", repository_load),
    ("/v2/repository/models/{route}/unload", repository_unload),
)
"""Triton's model repository extension: control-plane calls, under the admin rules."""


def add_repository_routes(app: web.Application, guard: Callable[[Handler], Handler]) -> None:
    for path, handler in REPOSITORY_PATHS:
        app.router.add_post(path, guard(handler))


async def _compressed(
    payload: bytes, headers: dict[str, str], coding: str, bodies: Bodies
) -> web.Response:
    """The response in ``coding``; a large one compressed off the event loop."""
    if len(payload) <= compression.OFF_LOOP_BYTES:
        body = compression.compress(payload, coding)
    else:
        body = await bodies.run(lambda: compression.compress(payload, coding))
    return web.Response(
        body=body,
        headers={**headers, hdrs.CONTENT_ENCODING: coding, hdrs.VARY: hdrs.ACCEPT_ENCODING},
    )


ISOLATED_RUNNER = "_isolated_runner"
"""Marks, in a worker's statistics, an isolated runner whose executions its supervisor
counts (and fills in, removing the mark)."""


async def statistics(request: web.Request) -> web.Response:
    """Triton's statistics extension: per route and runner version, cumulative since load."""
    route, version = request.match_info.get("route"), request.match_info.get("version")
    return web.json_response(await statistics_of(request.app, route, version))


async def statistics_of(
    app: web.Application, route: str | None = None, version: str | None = None
) -> dict[str, Any]:
    """This process's statistics, of every route or of ``route`` (and ``version``)."""
    await app[REGISTRY].refresh_isolated()  # their processes count the executions
    table = app[REGISTRY].routes
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


def named_outputs(chain: Chain, result: Any) -> dict[str, np.ndarray]:
    """The chain's result as named tensors; anything else is the last stage's fault."""
    if type(result) is not dict and not isinstance(result, Mapping):  # a dict: no ABC check
        last = chain.stages[-1]
        raise PluginError(
            last.label,
            TypeError(f"returned {type(result).__name__}; v2 needs a dict of named tensors"),
        )
    try:
        return {str(name): as_tensor(str(name), value) for name, value in result.items()}
    except (TypeError, ValueError) as exc:
        raise PluginError(chain.stages[-1].label, exc) from None


STATS_PATHS = (
    "/v2/models/stats",
    "/v2/models/{route}/stats",
    "/v2/models/{route}/versions/{version}/stats",
)
"""Triton's statistics extension: every route of it (a supervisor answers them all)."""


def stats_path(route: str | None = None, version: str | None = None) -> str:
    """The statistics extension's path for ``route`` (and ``version``), quoted."""
    if route is None:
        return STATS_PATHS[0]
    path = f"/v2/models/{quote(route, safe='')}"
    if version is not None:
        path += f"/versions/{quote(version, safe='')}"
    return path + "/stats"


def add_stats_routes(app: web.Application, handler: Handler) -> None:
    for path in STATS_PATHS:
        app.router.add_get(path, handler)


def add_routes(app: web.Application, through: Handler | None = None) -> None:
    """The v2 routes; ``through`` answers the statistics instead (a worker's supervisor)."""
    stats = through or statistics
    r = app.router
    # The router tries resources in order: the hot path first.
    r.add_post("/v2/models/{route}/infer", infer)
    r.add_post("/v2/models/{route}/versions/{version}/infer", infer)
    add_stats_routes(app, stats)
    r.add_get("/v2", server_metadata)
    r.add_get("/v2/health/live", live)
    r.add_get("/v2/health/ready", ready)
    add_repository_routes(app, admin_only)
    for prefix in ("/v2/models/{route}", "/v2/models/{route}/versions/{version}"):
        r.add_get(prefix, model_metadata)
        r.add_get(prefix + "/ready", model_ready)
        r.add_get(prefix + "/config", model_config)
