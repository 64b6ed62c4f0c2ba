"""gRPC on the wire, over HTTP/2 (``plugserve.server.transport.h2frames``), as the native gRPC
server (``front.py``) writes and reads it.

Answers are written with header blocks that use HPACK's static table and literals that
are never indexed (RFC 7541 §6.2.2), so that writing them changes no state the client's
decoder keeps: each block is built once and reused. gRPC messages travel in DATA frames,
each prefixed with a compressed flag and a 4-byte big-endian length (gRPC over HTTP2).
"""

from __future__ import annotations

import re
import urllib.parse

from plugserve.server.transport.h2frames import hpack_string, literal

STATUS_200 = b"\x88"  # :status 200, static table entry 8
CONTENT_TYPE = b"\x1f\x10" + hpack_string(
    b"application/grpc"
)  # content-type (static 31), never indexed
RESPONSE_START = STATUS_200 + CONTENT_TYPE
"""The header block that starts every answer."""
STATUS_OK = literal(b"grpc-status", b"0")


def trailers(code: int, message: str, metadata: tuple[tuple[str, str], ...] = ()) -> bytes:
    """The header block of a call's status: ``grpc-status``, ``grpc-message`` (percent-encoded,
    as gRPC says), and trailing metadata."""
    block = [STATUS_OK if code == 0 else literal(b"grpc-status", str(code).encode())]
    if message:
        block.append(literal(b"grpc-message", percent_encode(message).encode("ascii")))
    for key, value in metadata:
        block.append(literal(key.lower().encode("ascii"), value.encode("latin-1")))
    return b"".join(block)


_UNRESERVED = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def percent_encode(message: str) -> str:
    """``grpc-message``'s encoding: UTF-8, and every byte outside printable ASCII (and ``%``)
    as ``%XX``."""
    return urllib.parse.quote(message, safe=_UNRESERVED)


# -- gRPC's own headers -------------------------------------------------------------------

_TIMEOUT = re.compile(r"([0-9]{1,8})([HMSmun])")
_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def timeout_seconds(value: str) -> float | None:
    """``grpc-timeout`` (at most 8 digits and a unit) in seconds; ``None`` if malformed."""
    match = _TIMEOUT.fullmatch(value)
    if match is None:
        return None
    return int(match.group(1)) * _UNITS[match.group(2)]


def message_frame(message: bytes) -> bytes:
    """One gRPC message as it travels: not compressed, its length, its bytes."""
    return b"\x00" + len(message).to_bytes(4, "big") + message
