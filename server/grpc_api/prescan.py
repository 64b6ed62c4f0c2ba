"""Bounds read from a request message's wire format before it is parsed.

Parsing a protobuf message makes an object of each nested message it holds, whatever the
limits the request is checked against afterwards: 16 MiB of empty ``inputs`` entries (two
bytes each) parse into 8 million messages, 800 MiB and more than a second of the
interpreter. So a ``ModelInferRequest`` of ``SCAN_FROM`` bytes or more is walked first,
field by field at the top of each nested message, as the wire format lays them out (tag,
then length): more ``inputs`` or ``raw_input_contents`` than ``max_inputs``, more fields in
all outside tensor contents than ``MAX_FIELDS`` (or eight a permitted input), a tensor's
contents of more fields than ``max_bytes_elements`` and ``MAX_FIELDS`` together (a packed
array of numbers is one field, however long), or a group (a wire type the message has no
field of, which the parser would keep) refuse the request before anything is built. The
walk stops at the first bound passed, so its cost is bounded too; a tensor's contents are
walked only when they could hold more fields than allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plugserve.server.config import Limits

MAX_FIELDS = 4096
"""Fields a request may have, nested ones counted, outside its tensors' contents (at least;
eight for each input ``max_inputs`` permits)."""
SCAN_FROM = 2 * MAX_FIELDS
"""A shorter message is parsed as it is: it holds fewer than ``MAX_FIELDS`` fields."""
CONTENTS = "inference.InferTensorContents"
LENGTH_DELIMITED, VARINT, FIXED64, FIXED32 = 2, 0, 1, 5

Plan = dict[str, dict[int, str]]
"""For each message type (by full name), its message-typed fields: number to their type."""


class Malformed(Exception):
    """The wire format ends inside a field: left to the parser to refuse, in its words."""


class Refused(Exception):
    """The request passes a bound; why."""


def bounds(descriptor: Any, limits: Limits) -> Callable[[bytes], str | None]:
    """Why a serialized message of ``descriptor`` (a ``ModelInferRequest``'s: protobuf's
    ``Descriptor``, of its pure Python or its upb implementation) is refused before it is
    parsed, or ``None``."""
    plan: Plan = {}
    _plan(descriptor, plan)
    counted = {
        descriptor.fields_by_name[name].number: name for name in ("inputs", "raw_input_contents")
    }
    walk = _Walk(plan, descriptor.full_name, counted, limits)

    def refusal(body: bytes) -> str | None:
        if len(body) < SCAN_FROM:
            return None
        try:
            walk.run(body)
        except Refused as why:
            return str(why)
        except Malformed:
            return None
        return None

    return refusal


def _plan(descriptor: Any, plan: Plan) -> None:
    """The message-typed fields of ``descriptor`` and of every type it holds, read once from
    the descriptors (reading them during a walk would cost more than the walk)."""
    if descriptor.full_name in plan:
        return
    fields = plan[descriptor.full_name] = {}
    for field in descriptor.fields:
        if field.message_type is not None:
            fields[field.number] = field.message_type.full_name
            _plan(field.message_type, plan)


class _Walk:
    def __init__(self, plan: Plan, top: str, counted: dict[int, str], limits: Limits) -> None:
        self.plan, self.top, self.counted, self.limits = plan, top, counted, limits
        self.max_fields = max(MAX_FIELDS, 8 * limits.max_inputs)
        self.contents_fields = limits.max_bytes_elements + MAX_FIELDS

    def run(self, body: bytes) -> None:
        """Raise :class:`Refused` for a request past a bound. A nested message is walked only
        when the fields it could hold (half its length) would pass the bound: a request's
        small messages (its tensors' names, types and shapes) are counted at that, unread."""
        fields = could = 0
        counts = dict.fromkeys(self.counted, 0)
        pending = [(0, len(body), self.top)]
        while pending:
            position, end, kind_of = pending.pop()
            nested_types = self.plan[kind_of]
            top = kind_of == self.top
            while position < end:
                tag = body[position]
                if tag < 0x80:
                    position += 1
                else:
                    tag, position = _varint(body, position)
                fields += 1
                if fields + could > self.max_fields:
                    raise Refused(
                        f"the request has more than {self.max_fields} fields outside tensor "
                        "contents"
                    )
                if tag & 7 != LENGTH_DELIMITED:
                    position = _skip(body, position, tag & 7)
                    continue
                length = body[position] if position < end else 0x80
                if length < 0x80:
                    position += 1
                else:
                    length, position = _varint(body, position)
                start, position = position, position + length
                if position > end:
                    raise Malformed
                number = tag >> 3
                if top and number in counts:
                    counts[number] += 1
                    if counts[number] > self.limits.max_inputs:
                        raise Refused(
                            f"more than {self.limits.max_inputs} {self.counted[number]} "
                            "entries (max_inputs)"
                        )
                nested = nested_types.get(number)
                if nested is None:
                    continue
                if nested == CONTENTS:
                    if length > 2 * self.contents_fields:  # could hold more: count them
                        self._contents(body, start, position)
                elif fields + could + length // 2 > self.max_fields:
                    pending.append((start, position, nested))
                else:
                    could += length // 2
            if position != end:
                raise Malformed

    def _contents(self, body: bytes, position: int, end: int) -> None:
        """Refuse a tensor's contents of more fields than ``max_bytes_elements`` (each
        ``bytes_contents`` element is one) and ``MAX_FIELDS`` together."""
        fields, limit = 0, self.contents_fields
        while position < end:
            tag, position = _varint(body, position)
            kind = tag & 7
            if kind == LENGTH_DELIMITED:
                length, position = _varint(body, position)
                position += length
            else:
                position = _skip(body, position, kind)
            fields += 1
            if fields > limit:
                raise Refused(
                    f"a tensor's contents has more than {limit} fields (max_bytes_elements "
                    "elements of bytes_contents, and numbers sent packed)"
                )


def _skip(body: bytes, position: int, kind: int) -> int:
    """Past the value of a field of wire type ``kind`` other than length-delimited; a group
    (wire types 3 and 4) is refused: the request's messages have none, and the parser would
    keep it, however many fields it holds."""
    if kind == VARINT:
        return _varint(body, position)[1]
    if kind == FIXED64:
        return position + 8
    if kind == FIXED32:
        return position + 4
    if kind in (3, 4):
        raise Refused("the request holds a group, a field of no ModelInferRequest")
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
