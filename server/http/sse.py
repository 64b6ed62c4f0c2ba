"""Server-Sent Events: a stream of responses sent as events, each as soon as it is made.

What fails before the first event is an ordinary error answer (its status, its
JSON); once the stream has begun, an error, or the request's deadline passing,
is sent as the stream's last event, in the shape of the protocol (Triton's
``{"error": ...}``, OpenAI's ``{"error": {...}}``). A client that hangs up
cancels the handler (``server/http/connections.py``), which closes the stream: the
runner is told before its next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from aiohttp import web

from plugserve.registry.errors import PlugserveError
from plugserve.server.dataplane.outcomes import log_failure
from plugserve.server.dataplane.plane import Served, late
from plugserve.server.http.middleware import identify
from plugserve.server.runtime.logs import REQUEST_ID

HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: pass each event on as it comes
}
_END = object()


def event(payload: Any) -> bytes:
    """One ``data:`` event of ``payload`` as JSON (orjson writes no newlines)."""
    return b"data: " + orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"


async def send(
    request: web.Request,
    served: Served,
    responses: AsyncIterator[Any],
    encode: Callable[[Any], bytes],
    fail: Callable[[PlugserveError], bytes],
    last: bytes = b"",
    nothing: Callable[[], bytes] | None = None,
) -> web.StreamResponse:
    """Send ``encode(response)`` for each of ``responses`` as it comes (``nothing()`` when
    there was none), then ``last``.

    The request's deadline bounds the whole stream. The caller closes ``responses``.
    An error once the stream began is its last event, and what ``served`` counts.
    """
    deadline_s = served.deadline_s
    until = None if deadline_s is None else asyncio.get_running_loop().time() + deadline_s
    try:
        async with asyncio.timeout_at(until):
            first = await anext(responses, _END)
    except TimeoutError:
        raise late(deadline_s) from None
    answer = web.StreamResponse(headers=HEADERS)
    identify(answer, REQUEST_ID.get() or "")  # the middleware cannot, once it is sent
    answer.enable_chunked_encoding()
    await answer.prepare(request)
    try:
        async with asyncio.timeout_at(until):
            if first is not _END:
                await answer.write(encode(first))
                async for response in responses:
                    await answer.write(encode(response))
            elif nothing is not None:
                await answer.write(nothing())
        await answer.write(last)
    except TimeoutError:
        passed = late(deadline_s)
        served.status = passed.status
        await answer.write(fail(passed))
    except PlugserveError as exc:
        log_failure(exc, "stream_failed")
        served.status = exc.status
        await answer.write(fail(exc))
    except ConnectionError:  # the client left: nothing more can reach it
        raise
    except Exception as exc:  # a fault of the server's once the answer began: the client is told
        log_failure(exc, stream=True)
        served.status = 500
        await answer.write(fail(PlugserveError("internal server error")))
    await answer.write_eof()
    return answer
