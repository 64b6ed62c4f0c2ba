"""OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``.

The official clients raise by status (``BadRequestError`` for 400,
``AuthenticationError`` for 401, ``NotFoundError``, ``RateLimitError``,
``InternalServerError``...) and show ``message``; the OpenAI front end has the
middleware answer every error under ``/v1/`` in this shape (``routes.add_routes``).
"""

from __future__ import annotations

from typing import Any

from plugserve.registry.errors import NotFound, PlugserveError

PREFIX = "/v1/"

_CODES = {401: "invalid_api_key", 429: "rate_limit_exceeded", 504: "timeout"}


def body(status: int, message: str, param: str | None = None, code: str | None = None) -> Any:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    return {
        "error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": code or _CODES.get(status),
        }
    }


def of(exc: PlugserveError) -> Any:
    """The OpenAI body of one of plugserve's errors."""
    code = "model_not_found" if isinstance(exc, NotFound) else None
    return body(exc.status, exc.message, getattr(exc, "param", None), code)
