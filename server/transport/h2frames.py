"""HTTP/2 frames on the wire, as the engine reads and writes them (RFC 9113 §4.1): a 9-byte
header (length, type, flags, stream id) and a payload; and HPACK's integers and literals as
the header blocks it writes use them (RFC 7541).

Answers are written with header blocks that use HPACK's static table and literals that
are never indexed (RFC 7541 §6.2.2), so that writing them changes no state the client's
decoder keeps: each block is built once and reused.
"""

from __future__ import annotations

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


def unpadded(flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS frame's payload without its padding."""
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ConnectionError_(Error.PROTOCOL_ERROR, "bad padding")
    return payload[1 : len(payload) - payload[0]]


def depends_on(priority: bytes) -> int:
    """The stream a priority block (RFC 9113 §5.3) says its stream depends on."""
    return int.from_bytes(priority[:4], "big") & 0x7FFFFFFF


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


def hpack_string(text: bytes) -> bytes:
    """An HPACK string literal, not Huffman-coded (RFC 7541 §5.2)."""
    return hpack_int(len(text), 7) + text


def literal(name: bytes, value: bytes) -> bytes:
    """A header never indexed, with a literal name (RFC 7541 §6.2.3): it changes no table."""
    return b"\x10" + hpack_string(name) + hpack_string(value)
