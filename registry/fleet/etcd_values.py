"""Values read from etcd, as outside data: anyone with write access to etcd can put
anything there. Parsed strictly (JSON, a replica's record), and shown safely (keys as
text, reasons clipped)."""

from __future__ import annotations

from typing import Any

from plugserve.registry import checks

MAX_REASON = 500
"""The longest reason kept for an invalid entry (a hostile value can make a long one)."""
MAX_NAME = 1000
"""The longest key name shown (in logs, and as the invalid entry's name)."""

_REPLICA_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "url": str,
    "started_at": (int, float),
    "updated_at": (int, float),
    "ready": list,
}


BadValue = checks.ValueProblem
"""A value read from etcd that is not the JSON expected; the message says why."""


def outside_json(raw: bytes) -> Any:
    """Strict JSON from etcd: UTF-8, finite numbers only. Raises :class:`BadValue`."""
    return checks.parse_json(raw, strict=True)


def replica_record(raw: bytes) -> dict[str, Any]:
    """A replica's record, its known fields checked; raises :class:`BadValue`."""
    record = outside_json(raw)
    if not isinstance(record, dict):
        raise BadValue("", f"a replica record is a JSON object, not {type(record).__name__}")
    for key, kind in _REPLICA_FIELDS.items():
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise BadValue("", f".{key}: missing or not {_kind_name(kind)}")
    if not all(isinstance(label, str) for label in record["ready"]):
        raise BadValue("", ".ready: must be a list of strings")
    return {key: record[key] for key in _REPLICA_FIELDS}


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return "a number" if isinstance(kind, tuple) else f"a {kind.__name__}"


def reason_of(exc: Exception) -> str:
    """An exception from parsing outside data, as a reason to show."""
    return str(exc) if isinstance(exc, BadValue) else f"{type(exc).__name__}: {exc}"


def clipped(text: str) -> str:
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def shown(raw: bytes) -> str:
    """A key (or part of one) as text: UTF-8, other bytes shown as ``\\xff``; a long
    one cut at :data:`MAX_NAME` bytes (no valid route name is that long)."""
    if len(raw) > MAX_NAME:
        return raw[:MAX_NAME].decode("utf-8", errors="backslashreplace") + "..."
    return raw.decode("utf-8", errors="backslashreplace")


def json_or_text(value: bytes) -> Any:
    """A value read from etcd, for a client: its JSON when it is strict JSON, else text."""
    try:
        return outside_json(value)
    except BadValue:
        return clipped(value.decode("utf-8", errors="replace"))
