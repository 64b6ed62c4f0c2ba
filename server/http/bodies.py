"""Request bodies: read within ``max_body_bytes``; large ones decoded (and encoded) off the loop.

The event loop only moves bytes: a body arrives in small chunks (aiohttp inflates
a ``Content-Encoding`` body step by step as it is read, never all at once), and
one over ``LARGE_BODY_BYTES``, or a compressed one, is parsed on a small thread
pool of its own. At most ``max_large_bodies`` such parses run or wait at once;
the next gets 429 with ``Retry-After``, so a flood of big bodies can neither take
every thread nor pile up memory.

A request's JSON is at most ``max_json_bytes`` (413 once read, before it is parsed):
a JSON parser holds the interpreter for the whole text, so even on a thread of its own
a long one stops the event loop, where binary tensor data is only copied. A control
request's body (a region to register, a model to load) is at most
``CONTROL_BODY_BYTES``, parsed where it is read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestPayloadError

from plugserve.registry.errors import PayloadTooLarge, TooManyRequests, UnreadableBody
from plugserve.server.http.budget import ByteBudget

T = TypeVar("T")

LARGE_BODY_BYTES = 256 * 1024
"""Bodies above this size (after inflation) are parsed off the event loop."""


CONTROL_BODY_BYTES = 1024 * 1024
"""A control request's body (shared memory registration, repository index and load)."""


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the request body is larger than max_body_bytes = {limit} bytes", max_body_bytes=limit
    )


def json_too_large(size: int, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the request's JSON is {size} bytes, more than max_json_bytes = {limit}: send large "
        "tensors as binary data (the binary tensor extension, gRPC or shared memory)",
        max_json_bytes=limit,
    )


class Slot:
    """One of the ``max_large_bodies`` places a large body holds from its first byte read
    until it is parsed (or its request ends), with the body's bytes counted against the
    process's byte budget meanwhile; released once."""

    __slots__ = ("_bodies", "held")

    def __init__(self, bodies: Bodies) -> None:
        self._bodies: Bodies | None = bodies
        self.held = 0

    def hold(self, size: int) -> None:
        """Count ``size`` more bytes of the body; 503 past the byte budget."""
        bodies = self._bodies
        if bodies is None:
            return
        if not bodies.budget.take("http", size):
            raise bodies.budget.unavailable()
        self.held += size

    def release(self) -> None:
        bodies = self._bodies
        if bodies is not None:
            bodies.large -= 1
            bodies.budget.give("http", self.held)
            self.held = 0
            self._bodies = None


BODY_BYTES = web.RequestKey("body_bytes", int)
"""The length of the request's body as read (inflated): the size ``ctx.body_bytes`` gives."""

SLOT = web.RequestKey("large_body_slot", Slot)
"""The slot a request's large body holds; the request middleware frees one never handed
to a parser (a body a plugin takes as bytes) when the request ends."""


def release_slot(request: web.BaseRequest) -> None:
    """Free the request's large-body slot, if it still holds one."""
    slot = request.get(SLOT)
    if slot is not None:
        slot.release()


class Bodies:
    """Reads request bodies and runs parsers of large ones on its own threads.

    A large body (declared over ``LARGE_BODY_BYTES``, compressed, or growing past
    it) takes one of ``max_large_bodies`` slots before more of it is read, and
    holds it until parsed: at most that many large bodies are in memory at once.
    """

    def __init__(
        self,
        max_body_bytes: int,
        threads: int,
        max_large: int,
        max_json_bytes: int | None = None,
        budget: ByteBudget | None = None,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self.max_json_bytes = max_body_bytes if max_json_bytes is None else max_json_bytes
        self.max_large = max_large
        self.large = 0
        """Large bodies being parsed or waiting for a thread."""
        self.messages = 0
        """gRPC messages (large or compressed) being read on the threads or waiting for one."""
        self.budget = budget if budget is not None else ByteBudget(8 * max_body_bytes)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="plugserve-body")

    async def read(self, request: web.BaseRequest, json: bool = False) -> bytes:
        """The whole body, inflated; 413 as soon as it passes ``max_body_bytes``, 400 if
        it cannot be inflated (or its chunked framing is broken). With ``json`` (the body
        is all JSON), 413 once read when it is longer than ``max_json_bytes``: a body the
        server accepts is read whole, so that its client, still sending, gets the answer.

        Read chunk by chunk (``request.read()`` would raise aiohttp's buffer to
        the whole limit, which inflates a compressed body in one step).
        """
        limit = self.max_body_bytes
        try:
            length = request.content_length
            if length is not None and length > limit:
                raise too_large(limit)
            if (length is not None and length > LARGE_BODY_BYTES) or _compressed(request):
                self.take(request)
            content = request.content
            first = await content.readany()
            slot = request.get(SLOT)
            if slot is not None:
                slot.hold(len(first))
            if not content.at_eof():
                body = await self._read_rest(request, bytearray(first))
            elif len(first) > limit:  # the usual case: the whole body came with the headers
                raise too_large(limit)
            else:
                body = first
            if json:
                self.check_json(len(body))
            request[BODY_BYTES] = len(body)
            return body
        except RequestPayloadError as exc:
            release_slot(request)
            # Nothing more is read from this body: aiohttp would otherwise read on after
            # the answer, meet the error again and log it with a traceback.
            request.content.feed_eof()
            request.protocol.close()  # after the answer: the rest of the body is unread
            raise UnreadableBody(f"the request body cannot be read: {_reason(exc)}") from None
        except BaseException:
            release_slot(request)
            raise

    async def _read_rest(self, request: web.BaseRequest, body: bytearray) -> bytes:
        """The rest of a body that did not come whole with its headers."""
        limit, content = self.max_body_bytes, request.content
        while True:
            # readany() returns buffered data without yielding, and taking it lets aiohttp
            # inflate the next piece at once: yield, or a compressed body is inflated whole
            # in one step of this task.
            await asyncio.sleep(0)
            chunk = await content.readany()
            if not chunk:
                return bytes(body)
            body += chunk
            if len(body) > limit:
                raise too_large(limit)
            slot = request.get(SLOT)
            if slot is not None:
                slot.hold(len(chunk))
            elif len(body) > LARGE_BODY_BYTES:
                self.take(request)  # chunked, of no declared length: large after all
                request[SLOT].hold(len(body))

    def check_json(self, size: int) -> None:
        """413 for a JSON text of ``size`` bytes, over ``max_json_bytes``."""
        if size > self.max_json_bytes:
            raise json_too_large(size, self.max_json_bytes)

    async def read_control(self, request: web.BaseRequest) -> bytes:
        """:func:`read_control` within ``max_body_bytes`` too."""
        return await read_control(request, self.max_body_bytes)

    def take(self, request: web.BaseRequest) -> None:
        """Give the request a large-body slot; 429 when all ``max_large_bodies`` are held."""
        if self.large >= self.max_large:
            raise TooManyRequests(
                f"{self.large} large request bodies are being read or parsed, the limit "
                f"(max_large_bodies = {self.max_large}); try again shortly",
                retry_after_s=1,
            )
        self.large += 1
        request[SLOT] = Slot(self)

    async def parse(self, request: web.BaseRequest, body: bytes, parse: Callable[[bytes], T]) -> T:
        """``parse(body)``: inline for a small body, on the pool for a large one, which
        hands its slot to the thread: a request cancelled meanwhile (its client hung up)
        stops waiting, and the slot is freed only when the thread is done with it."""
        slot = request.get(SLOT) if self.large else None  # a miss raises inside: skip it
        if slot is None:
            return parse(body)
        del request[SLOT]
        loop = asyncio.get_running_loop()
        try:
            future = self._pool.submit(parse, body)
        except BaseException:
            slot.release()
            raise
        future.add_done_callback(lambda _: _call_soon(loop, slot.release))
        return await asyncio.wrap_future(future)

    async def run(self, work: Callable[[], T]) -> T:
        """Run ``work()`` on the pool (encoding a large response); not counted."""
        future: Future[T] = self._pool.submit(work)
        return await asyncio.wrap_future(future)

    async def read_message(self, work: Callable[[], T]) -> T:
        """Run ``work()`` on the pool for a gRPC request message (a large one parsed, a
        compressed one inflated): at most ``max_large_bodies`` at once, running or waiting,
        apart from HTTP's (so that neither protocol's floods hold the other's place);
        :class:`TooManyRequests` beyond. The place is freed when the thread is done."""
        if self.messages >= self.max_large:
            raise TooManyRequests(
                f"{self.messages} large or compressed gRPC messages are being read, the "
                f"limit (max_large_bodies = {self.max_large}); try again shortly",
                retry_after_s=1,
            )
        self.messages += 1
        loop = asyncio.get_running_loop()
        try:
            future: Future[T] = self._pool.submit(work)
        except BaseException:
            self.messages -= 1
            raise
        future.add_done_callback(lambda _: _call_soon(loop, self._message_read))
        return await asyncio.wrap_future(future)

    def _message_read(self) -> None:
        self.messages -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def read_control(request: web.BaseRequest, max_body_bytes: int | None = None) -> bytes:
    """A control request's body: at most ``CONTROL_BODY_BYTES`` or ``max_body_bytes``,
    the smaller (413), else 400 as :meth:`Bodies.read` for one that cannot be read."""
    limit = min(CONTROL_BODY_BYTES, max_body_bytes or CONTROL_BODY_BYTES)
    too_big = (
        too_large(limit)
        if limit < CONTROL_BODY_BYTES
        else PayloadTooLarge(f"a control request's body is at most {limit} bytes")
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_big
    body = bytearray()
    try:
        while chunk := await request.content.readany():
            body += chunk
            if len(body) > limit:
                raise too_big
    except RequestPayloadError as exc:
        request.content.feed_eof()
        request.protocol.close()
        raise UnreadableBody(f"the request body cannot be read: {_reason(exc)}") from None
    return bytes(body)


def _reason(exc: RequestPayloadError) -> str:
    """aiohttp's message for a body it could not read, without its status prefix."""
    cause = exc.__cause__ or exc
    return str(getattr(cause, "message", cause)).strip() or type(cause).__name__


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """Schedule ``callback`` on ``loop`` from any thread; nothing once the loop is closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)


def _compressed(request: web.BaseRequest) -> bool:
    return request.headers.get(hdrs.CONTENT_ENCODING, "identity").lower() != "identity"


BODIES = web.AppKey("bodies", Bodies)
"""The app's body reader (one per process)."""
