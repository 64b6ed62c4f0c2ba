"""A service's methods registered on a gRPC server, with requests that do not parse
answered ``INVALID_ARGUMENT``.

protoc's ``add_..._to_server`` parses each request with ``FromString``: a message
that does not parse then ends the call ``UNKNOWN`` and grpc logs a traceback,
before any token is checked. Here a request that does not parse reaches the method
as :class:`Undecodable`, which ends the call with a clear error and no log line.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass


class Undecodable:
    """A request whose bytes are not the method's message."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


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


def methods(service: ServiceDescriptor, servicer: Any) -> list[Method]:
    """Every method of ``service``, served by the servicer's method of the same name (one
    protoc's base class leaves as is answers ``UNIMPLEMENTED``)."""
    served = []
    for method in service.methods:
        behaviour = getattr(servicer, method.name)
        if not inspect.iscoroutinefunction(behaviour):  # protoc's base class: not served here
            behaviour = _unimplemented(method.full_name)
        served.append(
            Method(
                f"/{service.full_name}/{method.name}",
                method.input_type.name,
                _lenient(GetMessageClass(method.input_type).FromString),
                GetMessageClass(method.output_type).SerializeToString,
                behaviour,
                method.client_streaming,
                method.server_streaming,
            )
        )
    return served


def register(server: Any, served: list[Method]) -> None:
    """Serve ``served`` (:func:`methods`) on a grpc.aio server, a generic handler per service.

    Through generic handlers only, not also as registered methods (as protoc's code does):
    grpc.aio's server keeps a pending call future per registered method and waits on all
    of them for every call: with Triton's 23 methods, 4 % of a ``ModelInfer``'s CPU
    (docs/performance.md, "Where the time goes")."""
    by_service: dict[str, dict[str, Any]] = {}
    for method in served:
        _, service, name = method.path.split("/")
        by_service.setdefault(service, {})[name] = _handler(method)
    server.add_generic_rpc_handlers(
        tuple(grpc.method_handlers_generic_handler(s, h) for s, h in by_service.items())
    )


def _handler(method: Method) -> Any:
    if method.client_streaming:
        make = (
            grpc.stream_stream_rpc_method_handler
            if method.server_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        return make(_checked_stream(method.behaviour, method.what), method.parse, method.serialize)
    make = (
        grpc.unary_stream_rpc_method_handler
        if method.server_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    return make(_checked(method.behaviour, method.what), method.parse, method.serialize)


def _unimplemented(name: str) -> Callable[..., Any]:
    async def call(request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not served here")

    return call


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_keep(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return parse_or_keep


def refusal(what: str, request: Undecodable) -> str:
    return f"the request is not a valid {what} message: {request.error}"


def _checked(behaviour: Callable[..., Any], what: str) -> Callable[..., Any]:
    async def call(request: Any, context: Any) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(what, request))
        return await behaviour(request, context)

    return call


def _checked_stream(behaviour: Callable[..., Any], what: str) -> Callable[..., Any]:
    async def call(requests: AsyncIterator[Any], context: Any) -> Any:
        async def parsed() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(what, request))
                yield request

        return await behaviour(parsed(), context)

    return call
