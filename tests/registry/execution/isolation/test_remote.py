"""A worker's connection to a runner process (``registry/execution/isolation/remote.py``), driven
directly: a stand-in transport takes what the worker writes, and the runner process's
answers are fed in as its socket would deliver them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from plugserve.registry.errors import Unavailable
from plugserve.registry.execution.isolation import wire
from plugserve.registry.execution.isolation.groups import RunnerGroup, RunnerProcess, RunnerSpec
from plugserve.registry.execution.isolation.host import RunnerHost
from plugserve.registry.execution.isolation.remote import (
    Connection,
    RemoteRunner,
    RunnerCrashed,
    UnreadableAnswer,
)
from plugserve.registry.execution.isolation.shm import Allocator, Region
from plugserve.registry.execution.isolation.wire import SMALL_BYTES, FrameReader, frame, put_tensors
from plugserve.registry.types import RequestContext


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


async def test_an_answer_this_worker_cannot_read_fails_its_request_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 29 finding 6, the worker's side: an answer over the JSON bound (an output
    name of megabytes), or one whose descriptors are malformed, closed the connection
    and failed every request on it. Each fails its own request; the third is answered."""
    monkeypatch.setattr(wire, "MAX_JSON", 256)  # 64 MiB in production
    connection = Connection(7, Region(1 << 16), Region(1 << 16))
    connection.connection_made(Transport())  # type: ignore[arg-type]
    requests = [
        asyncio.create_task(connection.request({"x": np.ones((1, 4), np.float32)}, context()))
        for _ in range(3)
    ]
    await asyncio.sleep(0)
    body = orjson.dumps({"k": "ok", "i": 0, "y": [["\x01" * 60, "<f4", [1], "r", 0, 4]]})
    large = wire.HEADER.pack(len(body), 4, 0) + body + b"\0\0\0\0"
    malformed = frame({"k": "ok", "i": 1, "y": [["y", "<f4"]]})
    descriptors, chunks, _ = put_tensors({"y": np.full((1, 4), 3, np.float32)}, None, None)
    connection.data_received(
        large + malformed + frame({"k": "ok", "i": 2, "y": descriptors}, chunks)
    )
    for request in requests[:2]:
        with pytest.raises(
            UnreadableAnswer, match="runner process 7 sent an answer that cannot be read"
        ):
            await asyncio.wait_for(request, 1.0)
    assert (await requests[2])["y"].tolist() == [[3.0, 3.0, 3.0, 3.0]]
    assert connection.alive
    assert connection.outstanding == 0


async def test_a_connection_lost_while_its_runner_process_goes_on_says_so(tmp_path: Path) -> None:
    """Issue 29 finding 6: the requests on a connection the runner process dropped failed
    500 "its runner process (pid N) ended during the request", though nothing ended. The
    host has no end recorded for the process (it waits 2 s for one): 503, saying so."""
    host = RunnerHost()
    spec = RunnerSpec(tmp_path, "runner/r@1.0.0", tmp_path)
    process = RunnerProcess(0, None, tmp_path / "r.sock", pid=7)
    group = host.groups["r#1"] = RunnerGroup("r#1", "r@1", spec, [process])
    runner = RemoteRunner(host, group)
    connection = Connection(7, Region(1 << 16), Region(1 << 16))
    connection.connection_made(Transport())  # type: ignore[arg-type]
    runner._connections[0] = connection
    request = asyncio.create_task(runner.infer({"x": np.ones((1, 4), np.float32)}, context()))
    await asyncio.sleep(0)
    connection.connection_lost(None)
    with pytest.raises(Unavailable, match=r"the connection to its runner process \(pid 7\) "
                       "closed during the request; the process did not end"):  # fmt: skip
        await asyncio.wait_for(request, 10.0)
    process.ended[7] = "killed by SIGKILL"  # and where it did end: 500, how it ended
    connection = Connection(7, Region(1 << 16), Region(1 << 16))
    connection.connection_made(Transport())  # type: ignore[arg-type]
    runner._connections[0] = connection
    request = asyncio.create_task(runner.infer({"x": np.ones((1, 4), np.float32)}, context()))
    await asyncio.sleep(0)
    connection.connection_lost(None)
    with pytest.raises(RunnerCrashed, match=r"ended during the request: killed by SIGKILL"):
        await asyncio.wait_for(request, 10.0)
