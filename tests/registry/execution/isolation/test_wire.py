"""Frames and tensors between a worker and a runner process."""

from __future__ import annotations

import numpy as np
import pytest

from plugserve.registry.errors import InvalidInput, PluginError, TooManyRequests
from plugserve.registry.execution.isolation import wire
from plugserve.registry.execution.isolation.shm import Allocator, Region
from plugserve.registry.execution.isolation.wire import (
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
        list(FrameReader().feed(wire.HEADER.pack(2**32 - 1, 0, 1)))


def test_json_over_a_frames_bound_is_refused_by_its_sender_before_the_frame_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 29 finding 6: a name of 11.5 M control characters made 69 MB of JSON (each
    escaped as \\u0001), sent as one frame that its reader dropped the connection for."""
    monkeypatch.setattr(wire, "MAX_JSON", 64)  # 64 MiB in production
    assert frame({"k": "infer", "i": 1, "x": [["a" * 30]]})
    with pytest.raises(
        FrameTooLarge,
        match=r"a frame of 102 bytes of JSON \(tensor names and descriptors\); at most 64",
    ):
        frame({"k": "infer", "i": 1, "x": [["\x01" * 12]]})  # 12 characters, 72 bytes


def test_a_frame_its_reader_cannot_take_is_skipped_alone_and_named_by_its_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Too large (its bytes dropped as they arrive, however they are split) or not JSON:
    the reader reports the frame's request id and goes on with the next frame."""
    monkeypatch.setattr(wire, "MAX_JSON", 64)
    large = wire.HEADER.pack(65, 3, 7) + b"{" * 65 + b"raw"
    garbled = wire.HEADER.pack(3, 0, 8) + b"{{{"
    listed = wire.HEADER.pack(2, 0, 9) + b"[]"
    data = frame({"k": "a", "i": 6}) + large + garbled + listed + frame({"k": "b", "i": 10})
    for step in (1, 5, len(data)):
        refused: list[tuple[int, ValueError]] = []
        reader = FrameReader(lambda i, problem: refused.append((i, problem)))  # noqa: B023
        got = []
        for at in range(0, len(data), step):
            got += [m["i"] for m, _ in reader.feed(data[at : at + step])]
        assert got == [6, 10]
        assert [i for i, _ in refused] == [7, 8, 9]
        assert isinstance(refused[0][1], FrameTooLarge)
        assert "a frame of 65 bytes of JSON; at most 64" in str(refused[0][1])
        assert "cannot be read" in str(refused[1][1])
        assert "not an object" in str(refused[2][1])
        assert reader._buffer == b""


def test_a_frame_of_no_request_carries_the_no_request_id() -> None:
    data = frame({"k": "free", "o": [0]})
    assert wire.HEADER.unpack_from(data)[2] == wire.NO_REQUEST
    assert wire.HEADER.unpack_from(frame({"k": "cancel", "i": 5}))[2] == 5


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


def test_blocks_taken_before_a_tensor_fails_are_given_back() -> None:
    """From the review of issue 29 finding 6's fix: an answer that failed after some of its
    outputs took blocks (a later output unencodable, the frame too large) left those blocks
    taken for good, shrinking the runner process's region with each such request."""
    region = Region(1 << 16)
    allocator = Allocator(region.size)
    arrays = {
        "x": np.ones((64, 64), dtype=np.float32),  # a block of 16 KiB
        "words": np.array(["\ud800"], dtype=object),  # not UTF-8: fails after x took its block
    }
    with pytest.raises(UnicodeEncodeError):
        put_tensors(arrays, region, allocator)
    assert allocator.alloc(region.size) == 0  # the whole region is free again


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
