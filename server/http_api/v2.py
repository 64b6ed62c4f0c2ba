"""The KServe v2 / Open Inference Protocol data plane, with a route as the model."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from aiohttp import hdrs, web
from aiohttp.typedefs import Handler

from plugserve.registry.errors import InvalidInput
from plugserve.registry.execution.chain import Chain
from plugserve.server.dataplane.plane import DATA_PLANE, Inference, Served
from plugserve.server.http import compression
from plugserve.server.http.auth import admin_only
from plugserve.server.http.bodies import BODIES, LARGE_BODY_BYTES, Bodies
from plugserve.server.http.connections import cancel_on_hangup
from plugserve.server.http.fastpath import FastPath
from plugserve.server.http_api import shm_http
from plugserve.server.http_api.codec import (
    HEADER_LENGTH,
    decode_request,
    encode_response,
    json_header_size,
)
from plugserve.server.state import REGISTRY, SETTINGS
from plugserve.server.transport.h1framing import FastAnswer, FastRequest
from plugserve.server.triton import answers, classification, config, repository
from plugserve.server.triton.answers import READINESS
from plugserve.server.triton.repository import REPOSITORY
from plugserve.server.triton.requests import InferRequest
from plugserve.server.triton.shared_memory import Attachment
from plugserve.server.triton.statistics import STATISTICS, STATS_PATHS


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response(answers.server_metadata())


async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    return web.json_response(await request.app[READINESS].check())


def _resolve(request: web.Request) -> Chain:
    route = request.match_info["route"]
    return request.app[REGISTRY].routes.resolve(route, request.match_info.get("version"))


async def _loaded(request: web.Request) -> Chain:
    """The route's chain, loading what loads on its first request."""
    route = request.match_info["route"]
    return await request.app[DATA_PLANE].chain_of(route, request.match_info.get("version"))


async def model_metadata(request: web.Request) -> web.Response:
    chain = await _loaded(request)
    return web.json_response(answers.metadata(request.app[REGISTRY].routes, chain))


async def model_ready(request: web.Request) -> web.Response:
    chain = _resolve(request)
    return web.json_response({"name": chain.route, "ready": True})


async def model_config(request: web.Request) -> web.Response:
    """Triton's model configuration extension: the route's configuration as its JSON."""
    return web.json_response(config.model_config(await _loaded(request)))


DECOUPLED_HTTP = "HTTP end point doesn't support models with decoupled transaction policy"
"""Triton's words for a one-answer HTTP call to a decoupled model (a streaming route here)."""


def refuse_streaming(chain: Chain) -> None:
    """400 for a one-answer HTTP call to a route that streams, saying where to stream it."""
    if chain.streaming:
        raise InvalidInput(
            f"{DECOUPLED_HTTP}: route {chain.route!r} streams its responses; call "
            ".../generate_stream, .../generate or gRPC ModelStreamInfer (or /v1 for an "
            "OpenAI route)"
        )


async def infer(request: web.Request) -> web.Response:
    """``POST /v2/models/{route}[/versions/{version}]/infer``: a JSON body, or binary
    tensor data after a JSON header (``Inference-Header-Content-Length``)."""
    cancel_on_hangup(request)
    match = request.match_info
    plane = request.app[DATA_PLANE]
    bodies = request.app[BODIES]
    header_length = request.headers.get(HEADER_LENGTH)
    decoded: InferRequest
    shared: Attachment | None = None
    classes: dict[str, int] | None = None

    async def read(served: Served) -> Inference:
        nonlocal decoded, shared, classes
        limits = request.app[SETTINGS].limits
        body = await bodies.read(request, json=header_length is None)
        if header_length is not None:
            bodies.check_json(json_header_size(header_length, len(body)))
        decoded = await bodies.parse(
            request, body, lambda raw: decode_request(raw, header_length, limits)
        )
        classes = decoded.classifications() if decoded.outputs else None
        size = len(body)
        # The request's tensors in shared memory, if any: inputs read, output regions held.
        if decoded.uses_shared_memory:
            shared = await shm_http.attach(request, decoded)
            if shared is not None:
                size += shared.input_bytes
        return Inference(served.route or "", decoded.inputs, decoded.parameters, size)

    async def answer(served: Served) -> web.Response:
        chain = served.chain
        refuse_streaming(chain)
        outputs = answers.named_outputs(chain, await served.result())
        if classes:
            outputs = classification.classify_outputs(chain, outputs, classes)
        if shared is not None:
            await shm_http.place(request, shared, outputs)
        accept = request.headers.get(hdrs.ACCEPT_ENCODING)
        payload, headers = await encoded(bodies, decoded, chain, outputs, accept)
        if len(headers) == 1:  # JSON: no header dict to build
            return web.Response(body=payload, content_type="application/json")
        return web.Response(body=payload, headers=headers)

    return await plane.infer(request, "v2", read, answer, match["route"], match.get("version"))


def add_fast_routes(app: web.Application, fast: FastPath) -> None:
    """``POST /v2/models/{route}/infer`` on the fast path (``server/http/fastpath.py``): a
    request decoded here and run through the data plane as :func:`infer` runs it. Declined,
    for :func:`infer` to answer as it answers everything: a body the decoder refuses or
    the JSON limit refuses (the request's 400 or 413 comes, as always, after its route's
    admission), tensors in shared memory, classification outputs."""
    plane, bodies, settings = app[DATA_PLANE], app[BODIES], app[SETTINGS]

    async def serve(request: FastRequest) -> FastAnswer | None:
        body, headers = request.body, request.headers
        header_length = headers.get(HEADER_LENGTH)
        try:
            json_size = len(body)
            if header_length is not None:
                json_size = json_header_size(header_length, len(body))
            if json_size > bodies.max_json_bytes:
                return None
            decoded = decode_request(body, header_length, settings.limits)
        except Exception:  # 400, 413 or worse: answered by infer, after admission, as ever
            return None
        if decoded.uses_shared_memory or (decoded.outputs and decoded.classifications()):
            return None
        inference = Inference(request.route, decoded.inputs, decoded.parameters, len(body))

        async def read(served: Served) -> Inference:
            return inference

        async def answer(served: Served) -> tuple[bytes, dict[str, str]]:
            chain = served.chain
            refuse_streaming(chain)
            outputs = answers.named_outputs(chain, await served.result())
            return await encoded(bodies, decoded, chain, outputs, accept)

        accept = headers.get(hdrs.ACCEPT_ENCODING)
        payload, out = await plane.infer(request, "v2", read, answer, request.route)
        return FastAnswer(200, out, payload)

    registry = app[REGISTRY]
    fast.add_post("/v2/models/", "/infer", serve, lambda route: route in registry.routes.entries)


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


async def encoded(
    bodies: Bodies,
    decoded: InferRequest,
    chain: Chain,
    outputs: dict[str, np.ndarray],
    accept: str | None,
) -> tuple[bytes, dict[str, str]]:
    """The v2 response body and headers, compressed when ``accept`` (the request's
    ``Accept-Encoding``) asks for it; a large response encoded or compressed off the loop."""
    route, version = chain.route, chain.runner_version
    if sum(a.nbytes for a in outputs.values()) <= LARGE_BODY_BYTES:
        payload, headers = encode_response(decoded, route, version, outputs)
    else:
        payload, headers = await bodies.run(
            lambda: encode_response(decoded, route, version, outputs)
        )
    coding = compression.accepted(accept) if accept else None
    if coding is None or len(payload) < compression.MIN_BYTES:
        return payload, headers
    if len(payload) <= compression.OFF_LOOP_BYTES:
        payload = compression.compress(payload, coding)
    else:
        payload = await bodies.run(lambda: compression.compress(payload, coding))
    return payload, {**headers, hdrs.CONTENT_ENCODING: coding, hdrs.VARY: hdrs.ACCEPT_ENCODING}


async def statistics(request: web.Request) -> web.Response:
    """Triton's statistics extension: per route and runner version, cumulative since load."""
    route, version = request.match_info.get("route"), request.match_info.get("version")
    return web.json_response(await request.app[STATISTICS].of(route, version))


def add_stats_routes(app: web.Application, handler: Handler = statistics) -> None:
    for path in STATS_PATHS:
        app.router.add_get(path, handler)


def add_routes(app: web.Application) -> None:
    """The v2 routes of the KServe protocol and Triton's extensions over HTTP."""
    r = app.router
    # The router tries resources in order: the hot path first.
    r.add_post("/v2/models/{route}/infer", infer)
    r.add_post("/v2/models/{route}/versions/{version}/infer", infer)
    add_stats_routes(app)
    r.add_get("/v2", server_metadata)
    r.add_get("/v2/health/live", live)
    r.add_get("/v2/health/ready", ready)
    add_repository_routes(app, admin_only)
    for prefix in ("/v2/models/{route}", "/v2/models/{route}/versions/{version}"):
        r.add_get(prefix, model_metadata)
        r.add_get(prefix + "/ready", model_ready)
        r.add_get(prefix + "/config", model_config)
