"""A worker's connection to a runner process (``registry/isolation/remote.py``), driven
directly: a stand-in transport takes what the worker writes, and the runner process's
answers are fed in as its socket would deliver them."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from registry.errors import Unavailable
from registry.isolation.remote import Connection
from registry.isolation.shm import Allocator, Region
from registry.isolation.wire import SMALL_BYTES, FrameReader, frame, put_tensors
from registry.types import RequestContext


class Transport:
    """Keeps what the worker writes to the runner process's socket."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def messages(self) -> list[dict[str, Any]]:
        return [message for message, _ in FrameReader().feed(b"".join(self.written))]


def context() -> RequestContext:
    return RequestContext(request_id="", route="m", parameters={}, headers={}, content_type="")


async def test_an_answer_to_a_request_cancelled_a_moment_before_is_dropped() -> None:
    """A client that hangs up cancels its request's future at once, but the request's
    task resumes only at its next step. An answer read in between was set on the
    cancelled future: InvalidStateError, out of ``data_received``, which closed the
    connection and failed every other request on it (seen at c=512 with wrk's timeouts)."""
    ours, theirs = Region(1 << 20), Region(1 << 20)
    connection = Connection(7, ours, theirs)
    transport = Transport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    first = asyncio.create_task(connection.request({"x": np.ones((1, 4), np.float32)}, context()))
    second = asyncio.create_task(
        connection.request({"x": np.full((1, 4), 2, np.float32)}, context())
    )
    await asyncio.sleep(0)  # both requests registered and queued
    await asyncio.sleep(0)  # and flushed to the socket
    assert [m["i"] for m in transport.messages() if m["k"] == "infer"] == [0, 1]

    first.cancel()  # its future is cancelled now; its task hears of it at its next step
    # The process's answers to both, read before that step. The first's output is
    # large enough to come back through the process's region.
    large = np.arange(32768, dtype=np.float32).reshape(1, -1)
    blocks = Allocator(theirs.size)
    descriptors, chunks, taken = put_tensors({"y": large}, theirs, blocks, SMALL_BYTES)
    assert taken == [0]
    connection.data_received(frame({"k": "ok", "i": 0, "y": descriptors}, chunks))
    small = np.full((1, 4), 3, np.float32)
    descriptors, chunks, _ = put_tensors({"y": small}, theirs, blocks, SMALL_BYTES)
    connection.data_received(frame({"k": "ok", "i": 1, "y": descriptors}, chunks))

    with pytest.raises(asyncio.CancelledError):
        await first
    answer = await second
    assert answer["y"].tolist() == [[3.0, 3.0, 3.0, 3.0]]
    assert connection.alive
    await asyncio.sleep(0)  # the next flush
    messages = transport.messages()
    assert {"k": "free", "o": [0]} in messages  # the dropped answer's block went back
    assert not any(m["k"] == "cancel" for m in messages)  # it was answered: nothing to cancel
    assert connection.outstanding == 0


async def test_a_request_its_runner_process_cancelled_fails_instead_of_waiting_for_ever() -> None:
    """The process answers ``cancelled`` when its scheduler cancels a batch it did not
    finish (its plugin raised CancelledError, or it was stopping). That answer took the
    request out of the pending ones and settled nothing: the request waited for ever, and
    not even a lost connection could fail it any more."""
    connection = Connection(7, Region(1 << 16), Region(1 << 16))
    connection.connection_made(Transport())  # type: ignore[arg-type]
    request = asyncio.create_task(connection.request({"x": np.ones((1, 4), np.float32)}, context()))
    await asyncio.sleep(0)
    connection.data_received(frame({"k": "cancelled", "i": 0}))
    with pytest.raises(Unavailable, match="runner process 7 cancelled the request") as caught:
        await asyncio.wait_for(request, 1.0)
    assert caught.value.status == 503
    assert connection.outstanding == 0
