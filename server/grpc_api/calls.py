"""One gRPC call as the request path sees it, and plugserve's errors as gRPC status codes."""

from __future__ import annotations

from typing import Any

import grpc
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from plugserve.registry.errors import PlugserveError
from plugserve.server.triton.shared_memory import grpc_peer

GRPC_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
"""Each HTTP status plugserve's errors carry (``registry/errors.py``), as gRPC's code."""


def grpc_code(status: int) -> grpc.StatusCode:
    """The gRPC status code of an HTTP status; other 4xx are the caller's, 5xx the server's."""
    code = GRPC_CODES.get(status)
    if code is not None:
        return code
    return grpc.StatusCode.INVALID_ARGUMENT if status < 500 else grpc.StatusCode.INTERNAL


MAX_DETAILS = 4096
"""The longest error message sent: it travels in a header, which gRPC caps (16 KiB), and
may repeat what the client sent (a long model name)."""


def error_details(exc: PlugserveError) -> str:
    """What a gRPC client reads of an error: the message, cut to ``MAX_DETAILS`` characters
    (a longer one would arrive as RESOURCE_EXHAUSTED in place of its own code)."""
    message = exc.message
    return message if len(message) <= MAX_DETAILS else message[: MAX_DETAILS - 3] + "..."


class Call:
    """A gRPC call with what :class:`plugserve.server.dataplane.context.Incoming` reads:
    the metadata as headers (``-bin`` keys left out); and the app, and where it came from."""

    __slots__ = ("app", "content_type", "context", "headers")

    def __init__(self, app: web.Application, context: Any) -> None:
        self.app = app
        self.context = context
        self.content_type = "application/grpc"
        metadata = context.invocation_metadata() or ()
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(
            CIMultiDict((key, value) for key, value in metadata if isinstance(value, str))
        )

    @property
    def peer(self) -> tuple[str | None, bool]:
        """The peer's IP address (``None`` for a Unix socket), and whether it is one."""
        return grpc_peer(self.context.peer() or "")
