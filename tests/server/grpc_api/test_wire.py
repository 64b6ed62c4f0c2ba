"""gRPC on the wire: the blocks the native server writes read back with an independent HPACK
decoder (the ``hpack`` package's), timeouts and messages as gRPC says."""

from __future__ import annotations

import urllib.parse

import hpack
import pytest

from plugserve.server.grpc_api import wire


def test_answer_blocks_decode_and_leave_the_table_alone() -> None:
    decoder = hpack.Decoder()
    block = wire.RESPONSE_START + wire.trailers(14, "ünïcode 100% \n done", (("retry-after", "1"),))
    headers = decoder.decode(block)
    assert headers == [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("grpc-status", "14"),
        ("grpc-message", "%C3%BCn%C3%AFcode 100%25 %0A done"),
        ("retry-after", "1"),
    ]
    assert urllib.parse.unquote(headers[3][1]) == "ünïcode 100% \n done"
    assert len(decoder.header_table.dynamic_entries) == 0  # never indexed: no state
    assert decoder.decode(wire.STATUS_OK) == [("grpc-status", "0")]


def test_a_long_message_takes_a_multi_byte_length() -> None:
    message = "x" * 5000
    assert hpack.Decoder().decode(wire.trailers(2, message))[1] == ("grpc-message", message)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1S", 1.0), ("250m", 0.25), ("99999999u", 99.999999), ("2H", 7200.0), ("5n", 5e-9)],
)
def test_grpc_timeouts(text: str, seconds: float) -> None:
    assert wire.timeout_seconds(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "S", "123456789S", "1s", "-1S", "1.5S", "1 S", "\u0661S"])
def test_malformed_grpc_timeouts(text: str) -> None:
    assert wire.timeout_seconds(text) is None


def test_messages() -> None:
    assert wire.message_frame(b"abc") == b"\x00\x00\x00\x00\x03abc"
