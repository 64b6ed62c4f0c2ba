"""Triton's shared memory extension over HTTP: ``/v2/systemsharedmemory/...``, the CUDA
routes (which need a GPU), and the shared memory tensors of a v2 inference request."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import orjson
from aiohttp import web

from plugserve.registry.errors import InvalidInput, NotFound
from plugserve.server.http.bodies import BODIES, LARGE_BODY_BYTES
from plugserve.server.triton.requests import InferRequest
from plugserve.server.triton.shared_memory import (
    REGIONS,
    Attachment,
    Regions,
    check_key,
    check_size,
    cuda_unsupported,
)

SYSTEM = "/v2/systemsharedmemory"
CUDA = "/v2/cudasharedmemory"


def _regions(request: web.Request) -> Regions:
    regions = request.app[REGIONS]
    regions.admit(request.remote)
    return regions


async def register(request: web.Request) -> web.Response:
    regions = _regions(request)
    try:
        body = orjson.loads(await request.app[BODIES].read_control(request))
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the register request is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidInput('the register request is {"key", "offset", "byte_size"}')
    key = check_key(body.get("key"))
    offset = check_size(body.get("offset", 0), "offset")
    await regions.register_call(
        request.match_info["name"], key, offset, check_size(body.get("byte_size"), "byte_size")
    )
    return web.Response()


async def status(request: web.Request) -> web.Response:
    return web.json_response(_regions(request).status(request.match_info.get("name")))


async def unregister(request: web.Request) -> web.Response:
    await _regions(request).unregister_call(request.match_info.get("name"))
    return web.Response()


async def cuda_register(request: web.Request) -> web.Response:
    """400 with Triton's words for a server built without GPU support, and the reason."""
    raise InvalidInput(cuda_unsupported(request.match_info["name"]))


async def cuda_status(request: web.Request) -> web.Response:
    """No CUDA region can be registered: none to list, any named one unknown."""
    name = request.match_info.get("name")
    if name is not None:
        raise NotFound(f"Unable to find cuda shared memory region: '{name}'")
    return web.json_response([])


async def cuda_unregister(request: web.Request) -> web.Response:
    """Nothing to unregister (Triton's examples unregister all CUDA regions before they start)."""
    return web.Response()


async def attach(request: web.Request, decoded: InferRequest) -> Attachment | None:
    """The request's shared memory tensors: inputs read now (a large read off the event
    loop), output regions checked and held; ``None`` when it has none."""
    if not decoded.uses_shared_memory:
        return None
    attached = _regions(request).attach(decoded)
    if attached.input_bytes > LARGE_BODY_BYTES:
        await request.app[BODIES].run(lambda: attached.read_inputs(decoded))
    else:
        attached.read_inputs(decoded)
    return attached


async def place(
    request: web.Request, attached: Attachment, outputs: Mapping[str, np.ndarray]
) -> None:
    """Write the outputs asked for in shared memory into their regions."""
    if attached.output_bytes(outputs) > LARGE_BODY_BYTES:
        await request.app[BODIES].run(lambda: attached.write_outputs(outputs))
    else:
        attached.write_outputs(outputs)


def add_routes(app: web.Application) -> None:
    r = app.router
    for root, handlers in (
        (SYSTEM, (register, status, unregister)),
        (CUDA, (cuda_register, cuda_status, cuda_unregister)),
    ):
        on_register, on_status, on_unregister = handlers
        r.add_post(root + "/region/{name}/register", on_register)
        for prefix in (root, root + "/region/{name}"):
            r.add_get(prefix + "/status", on_status)
            r.add_post(prefix + "/unregister", on_unregister)
