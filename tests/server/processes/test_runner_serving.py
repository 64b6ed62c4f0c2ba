"""A runner process's side of one worker's connection (server/processes/runner_process.py), driven
frame by frame in this process: a real scheduler, breaker, shared memory and wire format;
the loaded plugin is a stand-in with the attributes ``Serving`` reads (no ONNX model)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pytest

from plugserve.registry.execution.batching import BatchPolicy, Scheduler
from plugserve.registry.execution.breaker import CircuitBreaker
from plugserve.registry.execution.isolation import wire
from plugserve.registry.execution.isolation.shm import Region
from plugserve.registry.execution.isolation.wire import FrameReader, frame, put_tensors
from plugserve.server.processes.runner_process import RunnerProcess, Serving

LABEL = "runner/double@1.0.0"


@dataclass
class Loaded:
    """What ``Serving`` uses of a ``BatchedRunner``: a sync runner that doubles ``x``."""

    scheduler: Scheduler
    breaker: CircuitBreaker
    label: str = LABEL
    stats: Any = None
    sequences: Any = None  # no [runner.sequence]
    batches: list[int] = field(default_factory=list)

    def validate_request(self, inputs: Any) -> None:
        return None

    def run(self, inputs: Any) -> dict[str, np.ndarray]:
        self.batches.append(int(inputs["x"].shape[0]))
        return {"y": inputs["x"] * 2}


class Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        pass


def serving(
    kind: type[Loaded] = Loaded, failures: int = 1, shm_bytes: int = 1 << 16
) -> tuple[RunnerProcess, Serving, Loaded, Transport]:
    breaker = CircuitBreaker(LABEL, failures=failures)
    loaded = kind(Scheduler(_never, BatchPolicy(max_batch_size=8), LABEL), breaker)
    loaded.scheduler.inline = loaded.run
    owner = RunnerProcess({"shm_bytes": shm_bytes}, -1)
    owner.loaded = loaded  # type: ignore[assignment]
    regions = Region(shm_bytes), Region(shm_bytes)
    connection = Serving(owner, loaded, *regions)  # type: ignore[arg-type]
    transport = Transport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    return owner, connection, loaded, transport


async def _never(inputs: Any) -> Any:
    raise AssertionError("a sync runner's batches run inline")


def infer(request_id: int, value: float) -> bytes:
    descriptors, chunks, _ = put_tensors({"x": np.full((1, 2), value, np.float32)}, None, None)
    return frame({"k": "infer", "i": request_id, "x": descriptors}, chunks)


def answers(transport: Transport) -> list[dict[str, Any]]:
    reader = FrameReader()
    return [message for data in transport.writes for message, _ in reader.feed(data)]


async def test_what_one_step_read_is_run_answered_and_written_in_one_pump() -> None:
    owner, connection, loaded, transport = serving()
    connection.data_received(infer(1, 1.0) + infer(2, 2.0) + infer(3, 3.0))
    assert transport.writes == []  # nothing runs before the pump: other connections may add
    owner._pump()
    assert loaded.batches == [3]
    assert len(transport.writes) == 1  # the three answers in one write
    assert [(a["k"], a["i"]) for a in answers(transport)] == [("ok", 1), ("ok", 2), ("ok", 3)]
    assert connection.requests == {}
    await asyncio.sleep(0)
    assert len(transport.writes) == 1  # no flush left scheduled to write again


async def test_a_request_read_in_the_step_its_connection_is_lost_frees_the_breaker() -> None:
    """The worker is gone before the pump: the request is answered to nobody, and the
    half-open circuit's probe it held is given back (else: 503 for every later request)."""
    owner, connection, _loaded, transport = serving()
    breaker = connection.loaded.breaker
    assert breaker is not None
    breaker.state, breaker.opened_at = "open", float("-inf")  # due for a probe
    connection.data_received(infer(1, 1.0))
    assert breaker.rejecting  # the request holds the probe
    connection.connection_lost(None)
    assert not breaker.rejecting
    owner._pump()
    assert transport.writes == []


async def test_a_malformed_field_fails_its_request_alone_without_holding_the_breaker() -> None:
    owner, connection, _loaded, transport = serving()
    breaker = connection.loaded.breaker
    assert breaker is not None
    breaker.state, breaker.opened_at = "open", float("-inf")
    descriptors, chunks, _ = put_tensors({"x": np.ones((1, 2), np.float32)}, None, None)
    bad = frame({"k": "infer", "i": 1, "x": descriptors, "t": ["not", "a", "name"]}, chunks)
    connection.data_received(bad)
    assert not transport.aborted
    assert not breaker.rejecting
    connection.data_received(infer(2, 2.0))  # the connection goes on
    owner._pump()
    answered = answers(transport)
    assert [(a["k"], a["i"]) for a in answered] == [("error", 1), ("ok", 2)]
    assert answered[0]["s"] == 400


async def test_a_frame_too_large_fails_its_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29 finding 6: a frame over the JSON bound (a name of megabytes) dropped the
    worker's connection, and every request on it failed. Its request alone is answered
    413; its bytes are skipped as they arrive; the requests around it are answered."""
    owner, connection, _loaded, transport = serving()
    monkeypatch.setattr(wire, "MAX_JSON", 256)  # 64 MiB in production
    descriptors, chunks, _ = put_tensors({"\x01" * 60: np.ones((1, 2), np.float32)}, None, None)
    body = orjson.dumps({"k": "infer", "i": 2, "x": descriptors})
    raw = b"".join(chunks)
    large = wire.HEADER.pack(len(body), len(raw), 2) + body + raw
    data = infer(1, 1.0) + large + infer(3, 3.0)
    for at in range(0, len(data), 100):  # as a socket may deliver it
        connection.data_received(data[at : at + 100])
    owner._pump()
    answered = answers(transport)
    assert [(a["k"], a["i"]) for a in answered] == [("error", 2), ("ok", 1), ("ok", 3)]
    assert answered[0]["s"] == 413
    assert f"a frame of {len(body)} bytes of JSON; at most 256" in answered[0]["m"]
    assert not transport.aborted


async def test_an_answer_too_large_gives_its_blocks_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """From the review of issue 29 finding 6's fix: an answer whose outputs took blocks of
    the runner's region, then failed as a frame (over the JSON bound: an output named at
    length), was answered 500 and its blocks stayed taken for good: each such request
    shrank the region."""

    class LongName(Loaded):
        def run(self, inputs: Any) -> dict[str, np.ndarray]:
            return {"y" * 600: inputs["x"] * 2}

    owner, connection, _, transport = serving(LongName, failures=0, shm_bytes=1 << 20)
    descriptors, chunks, _ = put_tensors({"x": np.ones((1, 40_000), np.float32)}, None, None)
    monkeypatch.setattr(wire, "MAX_JSON", 400)  # the request's and the error's fit; not y's
    connection.data_received(frame({"k": "infer", "i": 1, "x": descriptors}, chunks))
    owner._pump()
    (answered,) = answers(transport)
    assert (answered["k"], answered["i"], answered["s"]) == ("error", 1, 500)
    assert connection.allocator.alloc(1 << 20) == 0  # every block given back
