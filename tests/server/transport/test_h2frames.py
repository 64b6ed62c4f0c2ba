"""HTTP/2 on the wire: frames and HPACK integers as the RFCs say."""

from __future__ import annotations

import pytest

from plugserve.server.transport import h2frames as wire


@pytest.mark.parametrize(
    ("value", "bits", "expected"),
    [(10, 5, b"\x0a"), (1337, 5, b"\x1f\x9a\x0a"), (42, 8, b"\x2a"), (31, 5, b"\x1f\x00")],
)
def test_hpack_integers_as_rfc_7541_c_1(value: int, bits: int, expected: bytes) -> None:
    assert wire.hpack_int(value, bits) == expected


def test_frames() -> None:
    data = wire.frame(wire.Frame.PING, wire.ACK, 0, b"12345678")
    assert data[:9] == b"\x00\x00\x08\x06\x01\x00\x00\x00\x00" and data[9:] == b"12345678"
    assert wire.goaway(7, wire.Error.ENHANCE_YOUR_CALM, "calm")[9:] == (
        b"\x00\x00\x00\x07\x00\x00\x00\x0bcalm"
    )
