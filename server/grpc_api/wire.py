"""HTTP/2 and gRPC on the wire, as the native gRPC server (``front.py``) reads and writes them.

Frames (RFC 9113 §4.1): a 9-byte header (length, type, flags, stream id) and a payload.
Answers are written with header blocks that use HPACK's static table and literals that
are never indexed (RFC 7541 §6.2.2), so that writing them changes no state the client's
decoder keeps: each block is built once and reused. gRPC messages travel in DATA frames,
each prefixed with a compressed flag and a 4-byte big-endian length (gRPC over HTTP2).
"""

from __future__ import annotations

import re
import urllib.parse
from enum import IntEnum

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER = 9
DEFAULT_FRAME_SIZE = 16_384
DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1


class Frame(IntEnum):
    DATA = 0
    HEADERS = 1
    PRIORITY = 2
    RST_STREAM = 3
    SETTINGS = 4
    PUSH_PROMISE = 5
    PING = 6
    GOAWAY = 7
    WINDOW_UPDATE = 8
    CONTINUATION = 9


class Error(IntEnum):
    NO_ERROR = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2
    FLOW_CONTROL_ERROR = 3
    STREAM_CLOSED = 5
    FRAME_SIZE_ERROR = 6
    REFUSED_STREAM = 7
    CANCEL = 8
    COMPRESSION_ERROR = 9
    ENHANCE_YOUR_CALM = 11


class Setting(IntEnum):
    HEADER_TABLE_SIZE = 1
    ENABLE_PUSH = 2
    MAX_CONCURRENT_STREAMS = 3
    INITIAL_WINDOW_SIZE = 4
    MAX_FRAME_SIZE = 5
    MAX_HEADER_LIST_SIZE = 6


END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY = 0x20


class ConnectionError_(Exception):
    """The connection breaks the protocol: it is ended with GOAWAY and ``code``."""

    def __init__(self, code: Error, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload
    )


def settings(values: dict[Setting, int]) -> bytes:
    payload = b"".join(int(k).to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in values.items())
    return frame(Frame.SETTINGS, 0, 0, payload)


def window_update(stream: int, increment: int) -> bytes:
    return frame(Frame.WINDOW_UPDATE, 0, stream, increment.to_bytes(4, "big"))


def rst_stream(stream: int, code: Error) -> bytes:
    return frame(Frame.RST_STREAM, 0, stream, int(code).to_bytes(4, "big"))


def goaway(last_stream: int, code: Error, debug: str = "") -> bytes:
    payload = last_stream.to_bytes(4, "big") + int(code).to_bytes(4, "big") + debug.encode()
    return frame(Frame.GOAWAY, 0, 0, payload)


# -- HPACK, as written here -----------------------------------------------------------------


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) with ``first``'s high bits set in its first byte."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(text: bytes) -> bytes:
    return hpack_int(len(text), 7) + text


def literal(name: bytes, value: bytes) -> bytes:
    """A header never indexed, with a literal name (RFC 7541 §6.2.3): it changes no table."""
    return b"\x10" + _string(name) + _string(value)


STATUS_200 = b"\x88"  # :status 200, static table entry 8
CONTENT_TYPE = b"\x1f\x10" + _string(b"application/grpc")  # content-type (static 31), never indexed
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
