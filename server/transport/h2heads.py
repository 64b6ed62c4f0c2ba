"""A call's head: the header list of an HTTP/2 request read into what a call needs (gRPC's
headers among them), with RFC 9113's rules for a well-formed request; and the HPACK decoder
of a connection, which reads each header block into its head (:class:`HeadDecoder`).

A request that breaks them is malformed (§8.1.1): its stream is reset ``PROTOCOL_ERROR``, and
the connection and its other calls go on. Malformed are a field name with an upper-case
letter, a control character, a space, a colon or a byte past ASCII (§8.2.1); a value with
NUL, CR or LF, or that starts or ends with a space or tab (§8.2.1); a connection-specific
field, or ``te`` other than ``trailers`` (§8.2.2); a pseudo-header a request does not have,
one given twice or after a regular field, or a request without exactly one ``:method``,
``:scheme`` and non-empty ``:path`` (§8.3); trailers with pseudo-headers (§8.1); a
``content-length`` that is not a number, or that the DATA received does not match (§8.1.1,
checked by the engine as the data comes).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass

import hpack

from plugserve.server.transport.h2frames import ConnectionError_, Error

MAX_HEADER_LIST = 16 << 10
"""``MAX_HEADER_LIST_SIZE``, as gRPC's core: larger metadata is refused."""
HPACK_BOMB_BYTES = 4 * MAX_HEADER_LIST
"""A header block that decodes to more than this ends its connection ``ENHANCE_YOUR_CALM`` (an
HPACK bomb: its decoding stops there, so the connection's table is lost); one over
``MAX_HEADER_LIST`` and within this refuses its call alone."""
BLOCKS_KEPT = 64
BLOCK_KEPT_BYTES = 1024
"""Header blocks remembered per connection, and the largest remembered."""

REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":path", b":authority"})
CONNECTION_SPECIFIC = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)
RESERVED = frozenset(
    {b"content-type", b"te", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding"}
)
"""Headers gRPC reads itself: not part of a call's metadata."""
_NAME_BYTES = bytes(b for b in range(0x21, 0x7F) if not 0x41 <= b <= 0x5A and b != 0x3A)
"""The bytes a field name may hold (RFC 9113 §8.2.1): visible ASCII, no upper case, no colon."""
_BAD_VALUE = re.compile(rb"[\x00\r\n]|^[ \t]|[ \t]$")

Metadata = tuple[tuple[str, str | bytes], ...]


@dataclass(frozen=True, slots=True)
class Head:
    """What a header block says, read once per distinct block (the engine keeps the last
    ones read: clients send the same block with every call)."""

    method: bytes | None
    path: bytes | None
    content_type: bytes | None
    timeout: bytes | None
    encoding: bytes | None
    length: int | None
    """``content-length``, if the client sent one."""
    metadata: Metadata
    size: int
    """The header list's size as RFC 9113 §6.5.2 counts it (name, value and 32 per field)."""
    malformed: str | None
    """Why the block is not a well-formed request's head, if it is not."""
    as_trailers: str | None
    """Why the block is not well-formed trailers, if it is not."""


def read(headers: list[tuple[bytes, bytes]]) -> Head:
    """The head of a decoded header list."""
    method = path = scheme = content_type = timeout = encoding = None
    length: int | None = None
    metadata: list[tuple[str, str | bytes]] = []
    size = 0
    pseudo: set[bytes] = set()
    regular = False
    problem: str | None = None
    field_problem: str | None = None
    for name, value in headers:
        size += len(name) + len(value) + 32
        if name[:1] == b":":
            if problem is None:
                problem = _pseudo_problem(name, pseudo, regular)
            pseudo.add(name)
            if name == b":path":
                path = value
            elif name == b":method":
                method = value
            elif name == b":scheme":
                scheme = value
            continue
        regular = True
        if field_problem is None:
            field_problem = _field_problem(name, value)
        if name == b"content-type":
            content_type = value
        elif name == b"grpc-timeout":
            timeout = value
        elif name == b"grpc-encoding":
            encoding = value
        elif name == b"content-length":
            length = int(value) if value.isdigit() else -1
        if name in RESERVED:
            continue
        key = name.decode("latin-1")
        if key.endswith("-bin"):
            try:
                metadata.append((key, base64.b64decode(value + b"==")))
            except ValueError:
                continue
        else:
            metadata.append((key, value.decode("latin-1")))
    problem = problem or field_problem
    if problem is None:
        if method is None or scheme is None or path is None:
            problem = "a request needs :method, :scheme and :path"
        elif not path:
            problem = "an empty :path"
        elif length is not None and length < 0:
            problem = "content-length is not a number"
    trailers = "pseudo-headers in trailers" if pseudo else field_problem
    return Head(method, path, content_type, timeout, encoding, length, tuple(metadata), size,
                problem, trailers)  # fmt: skip


def _pseudo_problem(name: bytes, seen: set[bytes], regular: bool) -> str | None:
    if regular:
        return "a pseudo-header after a regular field"
    if name not in REQUEST_PSEUDO:
        return f"{name.decode('latin-1')!r} is not a request's pseudo-header"
    if name in seen:
        return f"{name.decode('latin-1')} given twice"
    return None


def _field_problem(name: bytes, value: bytes) -> str | None:
    if not name or name.translate(None, _NAME_BYTES):
        return f"the field name {name[:64]!r} is not lower-case visible ASCII"
    if name in CONNECTION_SPECIFIC:
        return f"the connection-specific field {name.decode('latin-1')!r}"
    if name == b"te" and value != b"trailers":
        return "te other than trailers"
    if _BAD_VALUE.search(value):
        return f"the value of {name.decode('latin-1')!r} has NUL, CR, LF or edge whitespace"
    return None


class HeadDecoder:
    """A connection's HPACK decoder (the ``hpack`` package's, its dynamic table following the
    client's), and the heads of the last header blocks it read: a block seen before under the
    same table is looked up, not decoded again."""

    __slots__ = ("blocks", "decoder")

    def __init__(self) -> None:
        self.decoder = hpack.Decoder(max_header_list_size=HPACK_BOMB_BYTES)
        self.blocks: dict[bytes, Head] = {}

    def decode(self, block: bytes) -> Head:
        """The block's head: looked up when the same bytes came under the same table."""
        known = self.blocks.get(block)
        if known is not None:
            return known
        table = self.decoder.header_table
        before = (table.maxsize, tuple(table.dynamic_entries))
        try:
            headers = [(bytes(n), bytes(v)) for n, v in self.decoder.decode(block, raw=True)]
        except hpack.OversizedHeaderListError:
            raise ConnectionError_(Error.ENHANCE_YOUR_CALM, "header list too large") from None
        except hpack.HPACKError as exc:
            raise ConnectionError_(Error.COMPRESSION_ERROR, type(exc).__name__) from None
        head = read(headers)
        if (table.maxsize, tuple(table.dynamic_entries)) != before:
            self.blocks.clear()  # entries kept meant what they meant under the old table
        elif len(block) <= BLOCK_KEPT_BYTES:
            if len(self.blocks) >= BLOCKS_KEPT:
                del self.blocks[next(iter(self.blocks))]
            self.blocks[block] = head
        return head
