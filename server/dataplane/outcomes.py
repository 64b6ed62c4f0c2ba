"""How a request ended: the one table from an error to the status it is counted and
answered with, and the level it is logged at, for every front end.

:class:`~plugserve.registry.errors.PlugserveError` carries its HTTP status (gRPC maps it
to a code, ``server/grpc_api/calls.py``). A fault of the server or of a plugin (500) is
an error, logged with its traceback; a refusal (400s, 429, 503, 504) is an expected
outcome, logged at debug. Anything else raised while serving is an internal error: a 500
whose details go to the log only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import structlog

from plugserve.registry.errors import PluginError, PlugserveError, one_error

CLIENT_CLOSED_REQUEST = 499
"""The status counted for a request whose client hung up before its answer (as nginx does)."""

log = structlog.get_logger("plugserve.server")


def status_of(exc: BaseException) -> int:
    """The status a request that raised ``exc`` is counted with (an exception group's: its
    one error's, :func:`~plugserve.registry.errors.one_error`)."""
    exc = one_error(exc)
    if isinstance(exc, PlugserveError):
        return exc.status
    status = getattr(exc, "status", None)  # aiohttp's own HTTP errors (a body too large)
    if isinstance(status, int):
        return status
    if isinstance(exc, asyncio.CancelledError):
        return CLIENT_CLOSED_REQUEST
    return 500


def is_fault(exc: PlugserveError) -> bool:
    """Whether ``exc`` is the server's or a plugin's fault (logged as an error), not a
    refusal: the client's mistake, a limit, an overload (503) or a deadline (504)."""
    return exc.status >= 500 and exc.status not in (503, 504)


def log_failure(exc: BaseException, event: str = "request_failed", **where: Any) -> None:
    """Log a request's failure at its level, with ``where`` it happened bound.

    A plugin's exception logs as ``plugin_raised`` (unless ``event`` names the moment,
    as ``stream_failed`` does) with the plugin's traceback; anything not a
    :class:`PlugserveError` as ``internal_error`` with its own.
    """
    if not isinstance(exc, PlugserveError):
        log.error("internal_error", exc_info=exc, **where)
        return
    if isinstance(exc, PluginError):
        name = "plugin_raised" if event == "request_failed" else event
        log.error(name, error=exc.message, status=exc.status, exc_info=exc.exc, **where)
        return
    level = logging.ERROR if is_fault(exc) else logging.DEBUG
    log.log(level, event, error=exc.message, status=exc.status, **where)
