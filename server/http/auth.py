"""Who may call what: the admin token (or loopback) on ``/admin/``, the inference token elsewhere.

Both checks read ``Authorization: Bearer <token>`` as bytes, whatever bytes the
client sent, and compare in constant time. With no inference token configured
the data plane has no check at all: :func:`middlewares` adds nothing.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Iterable

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware

from plugserve.registry.errors import Forbidden, NotFound, Unauthorized
from plugserve.server.config import Settings
from plugserve.server.http.addresses import is_loopback
from plugserve.server.state import SETTINGS

ADMIN_PREFIX = "/admin"
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/metrics", "/openapi.json"})
"""Data-plane paths served without the inference token: probes, scrapes, the API's description."""


def _as_bytes(text: str) -> bytes:
    """A header value (or token) as bytes; never raises, whatever the client sent.

    aiohttp decodes header bytes that are not UTF-8 as lone surrogates
    (``surrogateescape``): those give back the original bytes.
    """
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


def bearer_token(request: web.Request) -> bytes | None:
    """The token of ``Authorization: Bearer <token>``, or ``None`` without one."""
    return bearer(request.headers.get(hdrs.AUTHORIZATION))


def bearer(header: str | None) -> bytes | None:
    """The token of an ``Authorization`` value ``Bearer <token>``, or ``None``."""
    if header is None:
        return None
    parts = _as_bytes(header).split(None, 1)
    if len(parts) != 2 or parts[0].lower() != b"bearer":
        return None
    return parts[1].strip()


def _digest(token: bytes) -> bytes:
    """What is compared: equal-length digests, so the time taken tells nothing of the length."""
    return hashlib.sha256(token).digest()


def _accepts(given: bytes | None, digests: Iterable[bytes]) -> bool:
    """Whether ``given`` is a token of ``digests``; every one is compared, in constant time."""
    if given is None:
        return False
    given = _digest(given)
    matched = False
    for digest in digests:
        matched |= hmac.compare_digest(given, digest)
    return matched


def _local_port(request: web.Request) -> int | None:
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return int(sockname[1]) if sockname else None


def check_admin(request: web.Request, settings: Settings) -> None:
    """Raise unless the request may use the control plane (:func:`check_admin_call`)."""
    check_admin_call(settings, _local_port(request), request.remote, bearer_token(request))


def check_admin_call(
    settings: Settings, local_port: int | None, remote: str | None, token: bytes | None
) -> None:
    """Raise unless a call that reached ``local_port`` from ``remote`` with bearer ``token``
    may use the control plane: any protocol's admin rules.

    With ``admin_port`` set, the control plane answers on that port only (404
    elsewhere). With a token configured, ``Authorization: Bearer <token>`` must
    match it (the inference token never does); without one, only loopback
    clients are let in.
    """
    check_admin_address(settings, local_port)
    admin_token = settings.admin_token
    if admin_token is None:
        if not is_loopback(remote):
            raise Forbidden("admin calls need a configured token when not from loopback")
        return
    if token is None:
        raise Unauthorized("admin calls need 'Authorization: Bearer <admin token>'")
    if not _accepts(token, (_digest(_as_bytes(admin_token)),)):
        raise Unauthorized("the bearer token given is not the admin token")


def check_admin_address(settings: Settings, local_port: int | None) -> None:
    """Raise 404 when ``admin_port`` is set and the call reached another port."""
    if settings.admin_port is not None and local_port != settings.admin_port:
        raise NotFound("the control plane listens on its own address")


def check_page_address(request: web.Request, settings: Settings) -> None:
    """The status page, open to all, is still only on the control plane's address."""
    check_admin_address(settings, _local_port(request))


def admin_only(handler: Handler) -> Handler:
    """Guard a control-plane handler (no middleware: the data plane pays nothing for it)."""

    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        check_admin(request, request.app[SETTINGS])
        return await handler(request)

    return guarded


def _is_open(request: web.Request) -> bool:
    """Health, metrics and the API description; ``/admin/`` keeps its own rule (admin_only)."""
    resource = request.match_info.route.resource
    if resource is None:  # no route matched: a 404 or 405 is for callers with the token
        return False
    path = resource.canonical
    return path in OPEN_PATHS or path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


def data_plane_tokens(settings: Settings) -> tuple[bytes, ...] | None:
    """What the data plane accepts (the inference token's digest, and the admin token's),
    or ``None`` when it checks nothing (no inference token configured)."""
    if settings.inference_token is None:
        return None
    tokens = [settings.inference_token, settings.admin_token]
    return tuple(_digest(_as_bytes(token)) for token in tokens if token is not None)


def accepts(token: bytes | None, accepted: tuple[bytes, ...] | None) -> bool:
    """Whether a data-plane call with ``token`` may go on (``accepted``: as above)."""
    return accepted is None or _accepts(token, accepted)


def check_inference_token(
    token: bytes | None, accepted: tuple[bytes, ...] | None, header: str = "Authorization"
) -> None:
    """Raise :class:`Unauthorized` unless a data-plane call with ``token`` may go on; a
    missing token and a wrong one get different messages (``header``: as the protocol spells it)."""
    if accepts(token, accepted):
        return
    if token is None:
        raise Unauthorized(f"this call needs '{header}: Bearer <inference token>'")
    raise Unauthorized("the bearer token given is not the inference token (nor the admin token)")


def middlewares(settings: Settings) -> list[Middleware]:
    """The data plane's token check, or nothing when no inference token is configured."""
    accepted = data_plane_tokens(settings)
    if accepted is None:
        return []

    @web.middleware
    async def inference_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not _is_open(request):
            check_inference_token(bearer_token(request), accepted)
        return await handler(request)

    return [inference_token]
