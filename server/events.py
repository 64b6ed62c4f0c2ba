"""Server-Sent Events: a stream of responses sent as events, each as soon as it is made.

What fails before the first event is an ordinary error answer (its status, its
JSON); once the stream has begun, an error, or the request's deadline passing,
is sent as the stream's last event, in the shape of the protocol (Triton's
``{"error": ...}``, OpenAI's ``{"error": {...}}``). A client that hangs up
cancels the handler (``server/connections.py``), which closes the stream: the
runner is told before its next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import structlog
from aiohttp import web

from plugserve.registry.errors import DeadlineExceeded, PluginError, PlugserveError
from plugserve.server.logs import REQUEST_ID
from plugserve.server.middleware import identify

HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: pass each event on as it comes
}
_END = object()
STREAM_STATUS = web.RequestKey("stream_status", int)
"""The status of the error that ended a stream after it began (its answer said 200): what
the request is counted as (``server/serving.py`` measured)."""

log = structlog.get_logger("plugserve.server")


def event(payload: Any) -> bytes:
    """One ``data:`` event of ``payload`` as JSON (orjson writes no newlines)."""
    return b"data: " + orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"


async def send(
    request: web.Request,
    responses: AsyncIterator[Any],
    encode: Callable[[Any], bytes],
    fail: Callable[[PlugserveError], bytes],
    deadline_s: float | None = None,
    last: bytes = b"",
) -> web.StreamResponse:
    """Send ``encode(response)`` for each of ``responses`` as it comes, then ``last``.

    ``deadline_s`` bounds the whole stream. The caller closes ``responses``.
    """
    until = None if deadline_s is None else asyncio.get_running_loop().time() + deadline_s
    try:
        async with asyncio.timeout_at(until):
            first = await anext(responses, _END)
    except TimeoutError:
        raise _late(deadline_s) from None
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
        await answer.write(last)
    except TimeoutError:
        late = _late(deadline_s)
        request[STREAM_STATUS] = late.status
        await answer.write(fail(late))
    except PlugserveError as exc:
        cause = exc.exc if isinstance(exc, PluginError) else None  # its traceback, logged
        log.log(40 if exc.status == 500 else 10, "stream_failed", error=exc.message, exc_info=cause)
        request[STREAM_STATUS] = exc.status
        await answer.write(fail(exc))
    except ConnectionError:  # the client left: nothing more can reach it
        raise
    except Exception:  # a fault of the server's once the answer began: the client is told
        log.exception("stream_internal_error")
        request[STREAM_STATUS] = 500
        await answer.write(fail(PlugserveError("internal server error")))
    await answer.write_eof()
    return answer


def _late(deadline_s: float | None) -> DeadlineExceeded:
    return DeadlineExceeded(f"the request's deadline of {deadline_s:g} s passed")
