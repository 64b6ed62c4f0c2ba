"""structlog setup: key-value events with bound context, for a console or as JSON.

Logging never stops or breaks serving: a log call never raises (a line that
cannot be rendered is replaced by one saying so), the streams written to never
raise or block (``server/runtime/stdio.py``), and tracebacks never show local variables, so
request data stays out of the log.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
from collections.abc import MutableMapping, Sequence
from contextvars import ContextVar
from typing import Any

import structlog
from aiohttp.http_exceptions import HttpProcessingError

from plugserve.registry.execution.chain import Chain

REQUEST_ID: ContextVar[str | None] = ContextVar("plugserve_request_id", default=None)
"""The id of the request being served; set once per request by the middleware."""
REQUEST_CHAIN: ContextVar[Chain | None] = ContextVar("plugserve_chain", default=None)
"""The chain serving the request, once resolved: its route, versions and variant."""

REQUEST_ID_HEADER = "X-Request-ID"

# Unique per process start; a counter after it. uuid4() reads the kernel's random
# source on every call, which profiles showed as 8% of a busy server's time.
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count()


MAX_REQUEST_ID = 128
"""Longest ``X-Request-ID`` taken from a client; a longer or odd one is replaced."""


def client_request_id(value: str | None) -> str | None:
    """The client's request id if it is short printable ASCII without spaces, else ``None``:
    it is echoed in a header and written to every log line of the request."""
    if value and len(value) <= MAX_REQUEST_ID and value.isascii() and value.isprintable():
        return None if " " in value else value
    return None


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


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


class _NeverRaising:
    """Runs the processors; a line they cannot render becomes a line saying so."""

    def __init__(self, processors: Sequence[structlog.typing.Processor], as_json: bool) -> None:
        self.processors = processors
        self.as_json = as_json

    def __call__(self, logger: Any, name: str, event: MutableMapping[str, Any]) -> Any:
        result: Any = event
        original = event.get("event")  # before a renderer pops it
        try:
            for processor in self.processors:
                result = processor(logger, name, result)
        except structlog.DropEvent:
            raise
        except Exception as exc:
            line = {"event": "log_line_unrenderable", "level": name, "error": type(exc).__name__}
            line["original_event"] = _safe_str(original)
            if self.as_json:
                return json.dumps(line)
            return " ".join(f"{k}={v}" for k, v in line.items())
        return result


def _safe_str(value: object) -> str:
    try:
        return str(value)
    except Exception:
        return f"<unprintable {type(value).__name__}>"


class ProtocolLogger(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's connection-level logger, for its request handlers (``logger=``).

    A request its parser refuses (not valid HTTP: a 400 sent before any handler)
    is the client's mistake: logged at debug, without the traceback whose message
    quotes the bytes sent (headers, tokens). Anything else goes on to aiohttp's logger.
    """

    def exception(self, msg: object, *args: Any, **kwargs: Any) -> None:
        error = kwargs.get("exc_info")
        if isinstance(error, HttpProcessingError) and 400 <= error.code < 500:
            structlog.get_logger("plugserve.server").debug(
                "request_unparsable", status=error.code, error=error.message
            )
            return
        self.logger.exception(msg, *args, **kwargs)


def protocol_logger() -> ProtocolLogger:
    return ProtocolLogger(logging.getLogger("aiohttp.server"))


def configure_logging(log_format: str = "console", level: str = "info") -> None:
    """Route structlog (and the standard library's ``logging``) to stderr.

    Every event carries the request id of the request being served (one
    ContextVar, set per request: cheaper than re-binding structlog's context),
    anything bound with ``structlog.contextvars``, and the logger's own
    bindings (plugin, version). Tracebacks are plain, without local variables
    (structlog would show them through rich or better-exceptions where installed).
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
        renderer = structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
    structlog.configure(
        processors=[_NeverRaising([*shared, renderer], as_json=log_format == "json")],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # One write per line (message and newline together): with several worker processes
        # on one stderr, lines written in two parts would interleave.
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr, force=True)
