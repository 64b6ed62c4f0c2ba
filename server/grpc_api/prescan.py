"""Bounds read from a request message's wire format before it is parsed.

Parsing a protobuf message makes an object of each nested message it holds, whatever the
limits the request is checked against afterwards: 16 MiB of empty ``inputs`` entries (two
bytes each) parse into 8 million messages, 800 MiB and more than a second of the
interpreter. So a ``ModelInferRequest`` of ``SCAN_FROM`` bytes or more is walked first,
field by field at the top of each nested message, as the wire format lays them out (tag,
then length): more ``inputs`` or ``raw_input_contents`` than ``max_inputs``, more than
``MAX_FIELDS`` fields in all outside tensor contents, or a tensor's contents with more than
``max_bytes_elements`` ``bytes_contents`` elements refuse the request before anything is
built. The walk stops at the first bound passed, so its cost is bounded too; tensor
contents are walked only when they could hold more elements than allowed (a packed array of
numbers is one field, however long).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from plugserve.server.config import Limits

MAX_FIELDS = 4096
"""Fields a request may have, nested ones counted, outside its tensors' contents."""
SCAN_FROM = 2048
"""A shorter message is parsed as it is: it cannot hold more than half as many fields."""
CONTENTS = "inference.InferTensorContents"
BYTES_CONTENTS = 8
"""``InferTensorContents.bytes_contents``: one field on the wire per element."""
LENGTH_DELIMITED, VARINT, FIXED64, FIXED32 = 2, 0, 1, 5


class Malformed(Exception):
    """The wire format ends inside a field: left to the parser to refuse, in its words."""


def bounds(descriptor: Any, limits: Limits) -> Callable[[bytes], str | None]:
    """Why a serialized message of ``descriptor`` (a ``ModelInferRequest``'s: protobuf's
    ``Descriptor``, of its pure Python or its upb implementation) is refused before it is
    parsed, or ``None``."""
    counted = {
        descriptor.fields_by_name[name].number: name for name in ("inputs", "raw_input_contents")
    }

    def refusal(body: bytes) -> str | None:
        if len(body) < SCAN_FROM:
            return None
        try:
            return _walk(body, descriptor, counted, limits)
        except Malformed:
            return None

    return refusal


def _walk(body: bytes, top: Descriptor, counted: dict[int, str], limits: Limits) -> str | None:
    fields = 0
    top_counts = dict.fromkeys(counted, 0)
    pending: list[tuple[int, int, Descriptor]] = [(0, len(body), top)]
    while pending:
        position, end, descriptor = pending.pop()
        by_number = descriptor.fields_by_number
        while position < end:
            tag, position = _varint(body, position)
            number, kind = tag >> 3, tag & 7
            fields += 1
            if fields > MAX_FIELDS:
                return f"the request has more than {MAX_FIELDS} fields outside tensor contents"
            if kind == LENGTH_DELIMITED:
                length, position = _varint(body, position)
                start, position = position, position + length
                if position > end:
                    raise Malformed
                field = by_number.get(number)
                if descriptor is top and number in top_counts:
                    top_counts[number] += 1
                    if top_counts[number] > limits.max_inputs:
                        return (
                            f"more than {limits.max_inputs} {counted[number]} entries (max_inputs)"
                        )
                if field is None or field.type != FieldDescriptor.TYPE_MESSAGE:
                    continue
                nested = field.message_type
                if nested is None:
                    continue
                if nested.full_name != CONTENTS:
                    pending.append((start, position, nested))
                elif length > 2 * limits.max_bytes_elements:  # could hold more: count them
                    why = _bytes_elements(body, start, position, limits.max_bytes_elements)
                    if why is not None:
                        return why
            else:
                position = _skip(body, position, kind)
        if position != end:
            raise Malformed
    return None


def _bytes_elements(body: bytes, position: int, end: int, limit: int) -> str | None:
    """Refuse a tensor's contents with more than ``limit`` ``bytes_contents`` elements."""
    elements = 0
    while position < end:
        tag, position = _varint(body, position)
        kind = tag & 7
        if kind == LENGTH_DELIMITED:
            length, position = _varint(body, position)
            position += length
            if tag >> 3 == BYTES_CONTENTS:
                elements += 1
                if elements > limit:
                    return (
                        f"a tensor's bytes_contents has more than {limit} elements "
                        "(max_bytes_elements)"
                    )
        else:
            position = _skip(body, position, kind)
    return None


def _skip(body: bytes, position: int, kind: int) -> int:
    """Past the value of a field of wire type ``kind`` other than length-delimited."""
    if kind == VARINT:
        return _varint(body, position)[1]
    if kind == FIXED64:
        return position + 8
    if kind == FIXED32:
        return position + 4
    raise Malformed


def _varint(body: bytes, position: int) -> tuple[int, int]:
    try:
        byte = body[position]
        if byte < 0x80:
            return byte, position + 1
        value, shift = byte & 0x7F, 7
        while True:
            position += 1
            byte = body[position]
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, position + 1
            shift += 7
            if shift > 63:
                raise Malformed
    except IndexError:
        raise Malformed from None
