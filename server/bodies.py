"""Request bodies: read within ``max_body_bytes``; large ones decoded (and encoded) off the loop.

The event loop only moves bytes: a body arrives in small chunks (aiohttp inflates
a ``Content-Encoding`` body step by step as it is read, never all at once), and
one over ``LARGE_BODY_BYTES``, or a compressed one, is parsed on a small thread
pool of its own. At most ``max_large_bodies`` such parses run or wait at once;
the next gets 429 with ``Retry-After``, so a flood of big bodies can neither take
every thread nor pile up memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestPayloadError

from registry.errors import PayloadTooLarge, TooManyRequests, UnreadableBody

T = TypeVar("T")

LARGE_BODY_BYTES = 256 * 1024
"""Bodies above this size (after inflation) are parsed off the event loop."""


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"the request body is larger than max_body_bytes = {limit} bytes", max_body_bytes=limit
    )


class Bodies:
    """Reads request bodies and runs parsers of large ones on its own threads."""

    def __init__(self, max_body_bytes: int, threads: int, max_large: int) -> None:
        self.max_body_bytes = max_body_bytes
        self.max_large = max_large
        self.large = 0
        """Large bodies being parsed or waiting for a thread."""
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="plugserve-body")

    async def read(self, request: web.BaseRequest) -> bytes:
        """The whole body, inflated; 413 as soon as it passes ``max_body_bytes``, 400 if
        it cannot be inflated (or its chunked framing is broken).

        Read chunk by chunk (``request.read()`` would raise aiohttp's buffer to
        the whole limit, which inflates a compressed body in one step).
        """
        try:
            return await self._read(request)
        except RequestPayloadError as exc:
            # Nothing more is read from this body: aiohttp would otherwise read on after
            # the answer, meet the error again and log it with a traceback.
            request.content.feed_eof()
            request.protocol.close()  # after the answer: the rest of the body is unread
            raise UnreadableBody(f"the request body cannot be read: {_reason(exc)}") from None

    async def _read(self, request: web.BaseRequest) -> bytes:
        limit = self.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise too_large(limit)
        content = request.content
        first = await content.readany()
        if content.at_eof():  # the usual case: the whole body came with the headers
            if len(first) > limit:
                raise too_large(limit)
            return first
        body = bytearray(first)
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

    def is_large(self, request: web.BaseRequest, body: bytes) -> bool:
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity")
        return len(body) > LARGE_BODY_BYTES or encoding.lower() != "identity"

    async def parse(self, request: web.BaseRequest, body: bytes, parse: Callable[[bytes], T]) -> T:
        """``parse(body)``: inline for a small body, on the pool for a large one."""
        if not self.is_large(request, body):
            return parse(body)
        return await self.offload(parse, body)

    async def offload(self, work: Callable[[bytes], T], body: bytes) -> T:
        """Run ``work(body)`` on the pool, counted against ``max_large_bodies``.

        A request cancelled meanwhile (its client hung up) stops waiting; its
        slot is freed only when the thread is done with it.
        """
        if self.large >= self.max_large:
            raise TooManyRequests(
                f"{self.large} large request bodies are being parsed, the limit "
                f"(max_large_bodies = {self.max_large}); try again shortly",
                retry_after_s=1,
            )
        self.large += 1
        loop = asyncio.get_running_loop()
        try:
            future = self._pool.submit(work, body)
        except BaseException:
            self.large -= 1
            raise
        future.add_done_callback(lambda _: _call_soon(loop, self._release))
        return await asyncio.wrap_future(future)

    async def run(self, work: Callable[[], T]) -> T:
        """Run ``work()`` on the pool (encoding a large response); not counted."""
        future: Future[T] = self._pool.submit(work)
        return await asyncio.wrap_future(future)

    def _release(self) -> None:
        self.large -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _reason(exc: RequestPayloadError) -> str:
    """aiohttp's message for a body it could not read, without its status prefix."""
    cause = exc.__cause__ or exc
    return str(getattr(cause, "message", cause)).strip() or type(cause).__name__


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """Schedule ``callback`` on ``loop`` from any thread; nothing once the loop is closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)
