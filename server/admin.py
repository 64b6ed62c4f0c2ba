"""The control plane under ``/admin/``: bearer-token protected, loopback-only without a token."""

from __future__ import annotations

import hmac
import ipaddress

from aiohttp import web
from aiohttp.typedefs import Handler

from registry.errors import Forbidden, Unauthorized
from registry.registry import Registry
from server.config import Settings
from server.state import REGISTRY, SETTINGS

ADMIN_PREFIX = "/admin"


def is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_admin(request: web.Request, settings: Settings) -> None:
    """Raise unless the request may use the control plane.

    With a token configured, ``Authorization: Bearer <token>`` must match it
    (compared in constant time); without one, only loopback clients are let in.
    """
    token = settings.admin_token
    if token is None:
        if not is_loopback(request.remote):
            raise Forbidden("admin calls need a configured token when not from loopback")
        return
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), token.encode()
    ):
        raise Unauthorized("admin calls need 'Authorization: Bearer <token>'")


@web.middleware
async def admin_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path == ADMIN_PREFIX or request.path.startswith(ADMIN_PREFIX + "/"):
        check_admin(request, request.app[SETTINGS])
    return await handler(request)


async def list_plugins(request: web.Request) -> web.Response:
    registry: Registry = request.app[REGISTRY]
    return web.json_response({"plugins": [r.as_json() for r in registry.plugins()]})


async def list_routes(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    table = registry.routes
    return web.json_response(
        {
            "routes": table.describe(),
            "errors": list(table.errors),
            "routes_file": {"path": str(registry.routes_file), "error": registry.routes_file_error},
        }
    )


def add_routes(app: web.Application) -> None:
    app.router.add_get(ADMIN_PREFIX + "/plugins", list_plugins)
    app.router.add_get(ADMIN_PREFIX + "/routes", list_routes)
