"""``POST /predict/{route}``: the chain with its own input and output formats.

A JSON body (``application/json`` or ``*+json``) reaches the first stage
parsed, any other body as ``bytes``. The last stage's result is sent back:
``bytes`` as is, ``str`` as text, anything else (dicts, lists, numpy arrays
and scalars) as JSON.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from aiohttp import web

from plugserve.registry.errors import PluginError
from plugserve.registry.execution.chain import Chain
from plugserve.server.dataplane.plane import DATA_PLANE, Inference, Served
from plugserve.server.http.bodies import BODIES, LARGE_BODY_BYTES
from plugserve.server.http.connections import cancel_on_hangup
from plugserve.server.http.jsonio import parse_json
from plugserve.server.http_api.v2 import refuse_streaming


def is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


# orjson writes numpy arrays itself (numeric dtypes); the default handles the rest.
_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def encode_result(chain: Chain, result: Any) -> web.Response:
    if isinstance(result, bytes | bytearray | memoryview):
        return web.Response(body=bytes(result), content_type="application/octet-stream")
    if isinstance(result, str):
        return web.Response(text=result, content_type="text/plain")
    try:
        body = orjson.dumps(result, default=_json_default, option=_JSON_OPTIONS)
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise PluginError(chain.stages[-1].label, exc) from None
    return web.Response(body=body, content_type="application/json")


def _size(result: Any) -> int:
    """Roughly how large a result is: its arrays (a dict of them) or its bytes."""
    if isinstance(result, np.ndarray):
        return int(result.nbytes)
    if isinstance(result, bytes | bytearray | str):
        return len(result)
    if isinstance(result, dict):
        return sum(int(v.nbytes) for v in result.values() if isinstance(v, np.ndarray))
    return 0


async def predict(request: web.Request) -> web.Response:
    cancel_on_hangup(request)
    bodies = request.app[BODIES]

    async def read(served: Served) -> Inference:
        json = is_json(request.content_type)
        body = await bodies.read(request, json=json)
        data = await bodies.parse(request, body, parse_json) if json else body
        return Inference(served.route or "", data, dict(request.query), len(body))

    async def answer(served: Served) -> web.Response:
        refuse_streaming(served.chain)
        chain, result = served.chain, await served.result()
        if _size(result) <= LARGE_BODY_BYTES:
            return encode_result(chain, result)
        return await bodies.run(lambda: encode_result(chain, result))  # off the event loop

    plane = request.app[DATA_PLANE]
    return await plane.infer(request, "predict", read, answer, request.match_info["route"])


def add_routes(app: web.Application) -> None:
    app.router.add_post("/predict/{route}", predict)
