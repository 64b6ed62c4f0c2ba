"""Triton's generate extension: ``POST /v2/models/{route}/generate`` and ``.../generate_stream``.

The body is a JSON object: its ``parameters`` object is the request's
parameters, and the rest reaches the chain's first stage as a ``/predict`` JSON
body would (``{"text_input": "...", "max_tokens": 16}``). Each response is the
last stage's output as a JSON object (a one-element array as its value, a
longer one as a list) beside ``model_name`` and ``model_version``.

``generate_stream`` sends every response of a streaming route as a Server-Sent
Event (``data: {...}``); an error after the stream began is its last event,
``data: {"error": "..."}``, as Triton sends it. ``generate`` answers once: a
streaming route's responses merged (text concatenated, arrays joined on their
first axis), any other route's one response. A stream that sends no response (a
generation of no token) still answers its outputs, empty (:func:`none_sent`): one
event, or ``generate``'s one answer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from plugserve.registry.errors import InvalidInput, PluginError, PlugserveError
from plugserve.registry.execution.chain import Chain
from plugserve.server.dataplane.plane import DATA_PLANE, Inference, Served
from plugserve.server.http import sse
from plugserve.server.http.bodies import BODIES
from plugserve.server.http.connections import cancel_on_hangup
from plugserve.server.http.jsonio import json_value, parse_json

PROTOCOL = "generate"


async def generate(request: web.Request) -> web.StreamResponse:
    return await _generate(request, stream=False)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    return await _generate(request, stream=True)


async def _generate(request: web.Request, stream: bool) -> web.StreamResponse:
    cancel_on_hangup(request)
    bodies = request.app[BODIES]

    async def read(served: Served) -> Inference:
        body = await bodies.read(request, json=True)
        data = await bodies.parse(request, body, parse_json)
        if not isinstance(data, dict):
            raise InvalidInput("the body must be a JSON object of inputs and 'parameters'")
        parameters = data.pop("parameters", None) or {}
        if not isinstance(parameters, dict):
            raise InvalidInput("'parameters' must be a JSON object")
        # The deadline of a stream is kept by sse.send, which can still tell the client.
        return Inference(served.route or "", data, parameters, len(body), streams=stream)

    async def answer(served: Served) -> web.StreamResponse:
        chain = served.chain
        head = {"model_name": chain.route, "model_version": chain.runner_version}
        async with contextlib.aclosing(served.responses()) as responses:
            if not stream:
                collected = [r async for r in responses]
                merged = merge(collected) if collected else none_sent(chain)
                body = _encoded(chain, _dumps, {**head, **fields(merged)})
                return web.Response(body=body, content_type="application/json")
            return await sse.send(
                request,
                served,
                responses,
                lambda response: _encoded(chain, sse.event, {**head, **fields(response)}),
                _error_event,
                nothing=lambda: _encoded(chain, sse.event, {**head, **none_sent(chain)}),
            )

    match = request.match_info
    plane = request.app[DATA_PLANE]
    return await plane.infer(request, PROTOCOL, read, answer, match["route"], match.get("version"))


def fields(result: Any) -> dict[str, Any]:
    """A response as the JSON fields of Triton's generate answer."""
    if not isinstance(result, dict):
        return {"output": json_value(result)}
    return {str(name): json_value(value) for name, value in result.items()}


def none_sent(chain: Chain) -> dict[str, Any]:
    """The answer of a stream that sent no response (a generation of no token): each
    output the route's last stage declares, empty (text for ``BYTES``, else a list), or
    ``text_output`` when it declares none, as Triton's generation backends answer."""
    declared = [o for o in chain.metadata()["outputs"] if isinstance(o, dict) and "name" in o]
    if not declared:
        return {"text_output": ""}
    return {str(o["name"]): "" if o.get("datatype") == "BYTES" else [] for o in declared}


def merge(responses: list[Any]) -> Any:
    """A stream's responses as one: strings concatenated, arrays and lists joined, the rest
    the last value (``{}`` for a stream that sent nothing)."""
    if len(responses) <= 1:
        return responses[0] if responses else {}
    if not all(isinstance(r, dict) for r in responses):
        return responses[-1]
    merged: dict[str, Any] = {}
    for name in dict.fromkeys(k for r in responses for k in r):
        values = [r[name] for r in responses if name in r]
        merged[name] = _joined(values)
    return merged


def _joined(values: list[Any]) -> Any:
    texts = [json_value(v) for v in values]
    if all(isinstance(t, str) for t in texts):
        return "".join(texts)
    if all(isinstance(v, np.ndarray) for v in values):
        return np.concatenate([np.atleast_1d(v) for v in values])
    if all(isinstance(v, list) for v in values):
        return [item for v in values for item in v]
    return values[-1]


def _encoded(chain: Chain, encode: Callable[[Any], bytes], payload: dict[str, Any]) -> bytes:
    """``encode(payload)``; a value JSON cannot hold (complex numbers) is the last stage's
    fault, a 500 naming it (an error event once the stream began), not an internal error."""
    try:
        return encode(payload)
    except TypeError as exc:
        raise PluginError(chain.stages[-1].label, exc) from None


def _dumps(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


def _error_event(exc: PlugserveError) -> bytes:
    return sse.event({"error": exc.message})


def add_routes(app: web.Application) -> None:
    for prefix in ("/v2/models/{route}", "/v2/models/{route}/versions/{version}"):
        app.router.add_post(prefix + "/generate", generate)
        app.router.add_post(prefix + "/generate_stream", generate_stream)
