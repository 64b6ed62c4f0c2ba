"""JSON in and out of the HTTP front ends: a body parsed (its fault a 400), and a chain's
value written as JSON (a one-element array as its item, text decoded)."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from plugserve.registry.errors import InvalidInput


def parse_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the body is not valid JSON: {exc}") from None


def json_value(value: Any) -> Any:
    """A response's value as JSON: a one-element array as its item, text decoded."""
    if isinstance(value, np.ndarray):
        if value.size == 1:
            value = value.reshape(()).item()
        else:
            if value.dtype.kind in "OUS":  # orjson writes no text arrays
                return [json_value(v) for v in value.tolist()]
            return np.ascontiguousarray(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, np.generic):
        return value.item()
    return value
