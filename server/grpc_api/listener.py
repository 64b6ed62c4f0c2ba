"""The gRPC listener's lifetime: bound once the plugins are loaded, stopped after the drain.

The engine (``grpc_engine``) runs on the server's own event loop: the native one
(``front.py``), or ``grpc.aio``. With several workers, each binds the port with
``SO_REUSEPORT`` (the supervisor holds it meanwhile, as it holds the HTTP port, so that no
other process takes it); a single process binds it alone, so that a port in use is an
error at start, not a shared port.

Its calls are counted and swept by :class:`plugserve.server.grpc_api.admission.Admission`
(``max_connections`` data calls, health apart; idle and unread streams ended); its
connections by the engine: the HTTP/2 handshake within ``header_timeout_s`` (else
closed), and ``GOAWAY`` to a connection with no call open for ``grpc_idle_timeout_s``
(gRPC's own options, for grpc.aio).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import structlog
from aiohttp import web

from plugserve.registry.errors import ConfigError
from plugserve.server.config import Settings
from plugserve.server.grpc_api.admission import Admission, CallLimits
from plugserve.server.grpc_api.front import NativeServer
from plugserve.server.grpc_api.service import add_to_server, reader, served_methods
from plugserve.server.http.startup import DEFAULT_MAX_CONNECTIONS
from plugserve.server.state import SETTINGS

log = structlog.get_logger("plugserve.grpc")

STOP_GRACE_S = 1.0
"""What stopping gives calls still open after the drain (streams, mostly): the drain has
already waited for every inference in flight."""


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def grpc_lifetime(shared: bool) -> Callable[[web.Application], AsyncIterator[None]]:
    """An aiohttp ``cleanup_ctx``: serve gRPC on ``grpc_port`` while the app runs, the port
    ``shared`` with the other workers (``SO_REUSEPORT``) or not."""

    def lifetime(app: web.Application) -> AsyncIterator[None]:
        return _serve(app, shared)

    return lifetime


async def _serve(app: web.Application, shared: bool) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    if not settings.grpc_port:
        yield
        return
    admission = Admission(call_limits(settings))
    where = address(settings.host, settings.grpc_port)
    if settings.grpc_engine == "native":
        native = NativeServer(
            served_methods(app, settings.grpc_port),
            admission,
            settings.max_body_bytes,
            settings.header_timeout_s,
            settings.grpc_idle_timeout_s,
            reader(app),
        )
        await native.start(settings.host, settings.grpc_port, shared)
        stop: Callable[[float], Awaitable[None]] = native.stop
    else:
        server = grpc.aio.server(options=server_options(settings, shared), interceptors=[admission])
        add_to_server(server, app, settings.grpc_port)
        try:
            server.add_insecure_port(where)
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen for gRPC on {where}: {exc}") from None
        await server.start()
        stop = server.stop
    admission.start()
    log.info(
        "grpc_serving",
        address=where,
        engine=settings.grpc_engine,
        max_calls=admission.limits.max_calls,
    )
    try:
        yield
    finally:
        await admission.stop()
        await stop(STOP_GRACE_S)


def call_limits(settings: Settings) -> CallLimits:
    """As ``max_connections`` bounds HTTP's connections, it bounds gRPC's data calls."""
    return CallLimits(
        max_calls=settings.max_connections or DEFAULT_MAX_CONNECTIONS,
        idle_timeout_s=settings.grpc_idle_timeout_s,
        send_timeout_s=settings.body_timeout_s,
        request_timeout_s=settings.body_timeout_s,
        health_request_timeout_s=settings.header_timeout_s,
    )


def server_options(settings: Settings, shared: bool) -> list[tuple[str, int]]:
    """gRPC core's options: the port shared or not, message sizes, and the connection bounds."""
    return [
        ("grpc.so_reuseport", 1 if shared else 0),
        ("grpc.max_receive_message_length", settings.max_body_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.server_handshake_timeout_ms", _ms(settings.header_timeout_s)),
        ("grpc.max_connection_idle_ms", _ms(settings.grpc_idle_timeout_s)),
    ]


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
