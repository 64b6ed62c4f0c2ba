"""A service's methods registered on a gRPC server, with requests that do not parse
answered ``INVALID_ARGUMENT``.

protoc's ``add_..._to_server`` parses each request with ``FromString``: a message
that does not parse then ends the call ``UNKNOWN`` and grpc logs a traceback,
before any token is checked. Here a request that does not parse reaches the method
as :class:`Undecodable`, which ends the call with a clear error and no log line.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from plugserve.registry.errors import TooManyRequests
from plugserve.server.grpc_api.admission import Ended
from plugserve.server.http.bodies import LARGE_BODY_BYTES
from plugserve.server.http.budget import ByteBudget


class Undecodable:
    """A request whose bytes are not the method's message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class Refused(Undecodable):
    """A request refused before it is parsed, for a bound its wire format passes
    (``prescan.py``); ``error`` says which."""


class Unparsed:
    """A request message read off the event loop (:func:`read_message`): one over
    ``LARGE_BODY_BYTES``, or compressed (``encoding``, the native engine's)."""

    __slots__ = ("body", "encoding")

    def __init__(self, body: bytes, encoding: str | None = None) -> None:
        self.body = body
        self.encoding = encoding


Offload = Callable[[Callable[[], Any]], Awaitable[Any]]
"""Runs work on the body threads within gRPC's count of them (``Bodies.read_message``)."""


@dataclass(frozen=True)
class Reader:
    """Reads request messages off the event loop, as both engines do: one over
    ``LARGE_BODY_BYTES`` (whose parse would hold the loop for its length) and one compressed
    (inflated within ``limit`` bytes and the byte budget), on the body threads, at most
    ``max_large_bodies`` at once (``Bodies.read_message``)."""

    limit: int
    offload: Offload
    budget: ByteBudget

    def deferred(self, method: Method, body: bytes) -> Any:
        """The request of ``body``: parsed now if it is small, else :class:`Unparsed`."""
        return Unparsed(body) if len(body) > LARGE_BODY_BYTES else method.parse(body)

    async def read(self, method: Method, message: Unparsed) -> Any:
        """``message`` inflated and parsed; :class:`Ended` with the call's status if it cannot
        be."""

        def read() -> Any:
            if message.encoding is None:
                return method.parse(message.body)
            body, held = inflate(message.encoding, message.body, self.limit, self.budget)
            try:
                return method.parse(body)
            finally:
                self.budget.give("grpc", held)

        try:
            return await self.offload(read)
        except TooManyRequests as exc:
            raise Ended(grpc.StatusCode.RESOURCE_EXHAUSTED, exc.message) from None


INFLATE_STEP = 1 << 20
"""Inflated bytes counted against the byte budget at a time."""


def inflate(encoding: str, body: bytes, limit: int, budget: ByteBudget) -> tuple[bytes, int]:
    """A gzip or deflate message, at most ``limit`` bytes once inflated, and the bytes it holds
    of the byte budget (to give back once parsed); :class:`Ended` with the call's status if
    it cannot be read."""
    inflater = zlib.decompressobj(31 if encoding == "gzip" else 15)
    out = bytearray()
    data = body
    try:
        while True:
            chunk = inflater.decompress(data, INFLATE_STEP)
            data = inflater.unconsumed_tail
            if len(out) + len(chunk) > limit:
                raise Ended(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Received message larger than max (more than {limit} bytes inflated)",
                )
            if chunk and not budget.take("grpc", len(chunk)):
                raise Ended(grpc.StatusCode.RESOURCE_EXHAUSTED, budget.refusal())
            out += chunk
            if not data and len(chunk) < INFLATE_STEP:
                break
    except zlib.error as exc:
        budget.give("grpc", len(out))
        raise Ended(grpc.StatusCode.INTERNAL, f"the message does not decompress: {exc}") from None
    except BaseException:
        budget.give("grpc", len(out))
        raise
    if not inflater.eof or inflater.unused_data:
        budget.give("grpc", len(out))
        raise Ended(grpc.StatusCode.INTERNAL, f"the message is not one whole {encoding} stream")
    return bytes(out), len(out)


@dataclass(frozen=True)
class Method:
    """One method of a service as a server serves it: its path, how its messages are read and
    written (a request that does not parse is :class:`Undecodable`), and the servicer's
    behaviour."""

    path: str
    what: str
    """The request message's name, for the error of one that does not parse."""
    parse: Callable[[bytes], Any]
    serialize: Callable[[Any], bytes]
    behaviour: Callable[..., Any]
    client_streaming: bool
    server_streaming: bool


Check = Callable[[bytes], str | None]
"""Why a serialized request is refused before it is parsed (``prescan.py``), or ``None``."""


def methods(
    service: ServiceDescriptor, servicer: Any, checks: dict[str, Check] | None = None
) -> list[Method]:
    """Every method of ``service``, served by the servicer's method of the same name (one
    protoc's base class leaves as is answers ``UNIMPLEMENTED``); its requests checked by
    ``checks`` of their message's full name before they are parsed."""
    served = []
    for method in service.methods:
        behaviour = getattr(servicer, method.name)
        if not inspect.iscoroutinefunction(behaviour):  # protoc's base class: not served here
            behaviour = _unimplemented(method.full_name)
        check = (checks or {}).get(method.input_type.full_name)
        served.append(
            Method(
                f"/{service.full_name}/{method.name}",
                method.input_type.name,
                _lenient(GetMessageClass(method.input_type).FromString, check),
                GetMessageClass(method.output_type).SerializeToString,
                behaviour,
                method.client_streaming,
                method.server_streaming,
            )
        )
    return served


def register(server: Any, served: list[Method], reader: Reader) -> None:
    """Serve ``served`` (:func:`methods`) on a grpc.aio server, a generic handler per service.

    Through generic handlers only, not also as registered methods (as protoc's code does):
    grpc.aio's server keeps a pending call future per registered method and waits on all
    of them for every call: with Triton's 23 methods, 4 % of a ``ModelInfer``'s CPU
    (docs/performance.md, "Where the time goes")."""
    by_service: dict[str, dict[str, Any]] = {}
    for method in served:
        _, service, name = method.path.split("/")
        by_service.setdefault(service, {})[name] = _handler(method, reader)
    server.add_generic_rpc_handlers(
        tuple(grpc.method_handlers_generic_handler(s, h) for s, h in by_service.items())
    )


def _handler(method: Method, reader: Reader) -> Any:
    def parse(body: bytes) -> Any:
        return reader.deferred(method, body)

    if method.client_streaming:
        make = (
            grpc.stream_stream_rpc_method_handler
            if method.server_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        return make(_checked_stream(method, reader), parse, method.serialize)
    make = (
        grpc.unary_stream_rpc_method_handler
        if method.server_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(_checked(method, reader), parse, method.serialize)


def _unimplemented(name: str) -> Callable[..., Any]:
    async def call(request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not served here")

    return call


def _lenient(parse: Callable[[bytes], Any], check: Check | None) -> Callable[[bytes], Any]:
    def parse_or_keep(data: bytes) -> Any:
        if check is not None and (why := check(data)) is not None:
            return Refused(why)
        try:
            return parse(data)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return parse_or_keep


def refusal(what: str, request: Undecodable) -> str:
    if isinstance(request, Refused):
        return request.error
    return f"the request is not a valid {what} message: {request.error}"


async def parsed(method: Method, request: Any, context: Any, reader: Reader) -> Any:
    """The request a method's behaviour takes: an :class:`Unparsed` one read (off the event
    loop); the call aborted with its status for one that cannot be read or does not parse."""
    if isinstance(request, Unparsed):
        try:
            request = await reader.read(method, request)
        except Ended as exc:
            await context.abort(exc.code, exc.message)
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(method.what, request))
    return request


def _checked(method: Method, reader: Reader) -> Callable[..., Any]:
    behaviour = method.behaviour

    async def call(request: Any, context: Any) -> Any:
        return await behaviour(await parsed(method, request, context, reader), context)

    return call


def _checked_stream(method: Method, reader: Reader) -> Callable[..., Any]:
    behaviour = method.behaviour

    async def call(requests: AsyncIterator[Any], context: Any) -> Any:
        async def each() -> AsyncIterator[Any]:
            async for request in requests:
                yield await parsed(method, request, context, reader)

        return await behaviour(each(), context)

    return call
