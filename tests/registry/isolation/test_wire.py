"""Frames and tensors between a worker and a runner process."""

from __future__ import annotations

import numpy as np
import pytest

from registry.errors import InvalidInput, PluginError, TooManyRequests
from registry.isolation import wire
from registry.isolation.shm import Allocator, Region
from registry.isolation.wire import (
    FrameReader,
    FrameTooLarge,
    error_from,
    error_message,
    frame,
    get_tensors,
    put_tensors,
)


def test_frames_split_however_the_bytes_arrive() -> None:
    data = frame({"k": "a", "i": 1}) + frame({"k": "b", "i": 2}, [b"xyz", b"!"])
    reader = FrameReader()
    got = []
    for byte in range(len(data)):  # one byte at a time: the worst a stream can do
        got += [(m, bytes(r)) for m, r in reader.feed(data[byte : byte + 1])]
    assert got == [({"k": "a", "i": 1}, b""), ({"k": "b", "i": 2}, b"xyz!")]


def test_tensors_too_large_for_a_frame_are_refused_not_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Attack round on issue 14: a 4 GiB answer overflowed the frame header (struct.error):
    no answer was sent and the request hung until its deadline."""
    monkeypatch.setattr(wire, "MAX_RAW", 8)  # 4 GiB in production: too much for a test
    assert frame({"k": "ok"}, [b"12345678"])
    with pytest.raises(FrameTooLarge, match="9 bytes of tensors outside the shared memory"):
        frame({"k": "ok"}, [b"12345", b"6789"])


def test_a_frame_claiming_more_json_than_any_message_is_refused() -> None:
    with pytest.raises(ValueError, match="a frame of"):
        list(FrameReader().feed(b"\xff\xff\xff\xff\x00\x00\x00\x00"))


def test_tensors_cross_through_shared_memory_as_read_only_views() -> None:
    region = Region(1 << 16)
    allocator = Allocator(region.size)
    arrays = {
        "x": np.arange(12, dtype=np.float32).reshape(3, 4),
        "ids": np.array([[1, 2]], dtype=np.int64),
        "empty": np.zeros((0, 4), dtype=np.float16),
        "words": np.array([b"ab", "c\u00e9".encode()], dtype=object),
    }
    descriptors, chunks, taken = put_tensors(arrays, region, allocator)
    assert [d[3] for d in descriptors] == ["s", "s", "r", "b"]
    assert len(taken) == 2
    out = get_tensors(descriptors, region, memoryview(b"".join(chunks)))
    for name, array in arrays.items():
        assert out[name].shape == array.shape
        assert out[name].tolist() == array.tolist()
    assert out["x"].dtype == np.float32
    assert not out["x"].flags.writeable
    assert np.shares_memory(out["x"], np.frombuffer(region.map, np.uint8))


def test_a_tensor_that_does_not_fit_goes_inline() -> None:
    region = Region(4096)
    big = np.ones((64, 64), dtype=np.float32)  # 16 KiB
    descriptors, chunks, taken = put_tensors({"big": big}, region, Allocator(region.size))
    assert descriptors[0][3] == "r"
    assert taken == []
    assert np.array_equal(get_tensors(descriptors, region, memoryview(chunks[0]))["big"], big)


def test_a_descriptor_outside_the_region_is_refused() -> None:
    region = Region(4096)
    with pytest.raises(ValueError, match="outside the shared memory"):
        get_tensors([["x", "<f4", [2048], "s", 0, 8192]], region, memoryview(b""))


def test_errors_keep_their_class_status_message_and_headers() -> None:
    relayed = error_from(error_message(3, InvalidInput("bad x", input="x")))
    assert type(relayed) is InvalidInput
    assert (relayed.status, relayed.message, relayed.fields) == (400, "bad x", {"input": "x"})
    busy = error_from(error_message(4, TooManyRequests("queue full", retry_after_s=2)))
    assert busy.status == 429
    assert busy.headers() == {"Retry-After": "2"}
    crashed = error_from(error_message(5, PluginError("runner/a@1", ValueError("boom"))))
    assert crashed.status == 500
    assert crashed.message == "plugin runner/a@1 raised ValueError: boom"
    assert crashed.fields == {"plugin": "runner/a@1", "exception": "ValueError"}
