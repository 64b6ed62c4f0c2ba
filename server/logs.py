"""structlog setup: key-value events with bound context, for a console or as JSON."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from contextvars import ContextVar
from typing import Any

import structlog

from registry.chain import Chain

REQUEST_ID: ContextVar[str | None] = ContextVar("plugserve_request_id", default=None)
"""The id of the request being served; set once per request by the middleware."""
REQUEST_CHAIN: ContextVar[Chain | None] = ContextVar("plugserve_chain", default=None)
"""The chain serving the request, once resolved: its route, versions and variant."""


def add_request_id(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: every line logged while serving a request names it."""
    request_id = REQUEST_ID.get()
    if request_id is not None:
        event.setdefault("request_id", request_id)
        chain = REQUEST_CHAIN.get()
        if chain is not None:
            event.setdefault("route", chain.route)
            event.setdefault("versions", chain.label)
    return event


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS["error"] = logging.ERROR


def configure_logging(log_format: str = "console", level: str = "info") -> None:
    """Route structlog (and the standard library's ``logging``) to stderr.

    Every event carries the request id of the request being served (one
    ContextVar, set per request: cheaper than re-binding structlog's context),
    anything bound with ``structlog.contextvars``, and the logger's own
    bindings (plugin, version).
    """
    numeric = _LEVELS[level]
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        add_request_id,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr, force=True)
