"""A runner's sequences (``registry/execution/sequences.py``) with a runner held by the test:
orders of arrival and failures a real server meets only by chance."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import numpy as np
import pytest

from plugserve.registry.errors import DeadlineExceeded, InvalidInput
from plugserve.registry.execution.sequences import SeenSequences, Sequences
from plugserve.registry.manifest import SequenceControls, SequenceSection, StateSpec

Arrays = Mapping[str, np.ndarray]
SECTION = SequenceSection(
    idle_timeout_s=60.0, max_sequences=8, states=(StateSpec("s_in", "s_out", "FP32", (1,)),)
)
X = {"x": np.ones((1, 1), np.float32)}


class Held:
    """Adds x to the state; each execution waits for the test, or fails when told."""

    def __init__(self) -> None:
        self.gates: list[asyncio.Future[None]] = []
        self.fail: Exception | None = None

    async def execute(self, inputs: Arrays) -> dict[str, np.ndarray]:
        gate = asyncio.get_running_loop().create_future()
        self.gates.append(gate)
        await gate
        if self.fail is not None:
            raise self.fail
        total = inputs["s_in"] + inputs["x"]
        return {"y": total, "s_out": total}

    async def release(self, rounds: int = 10) -> None:
        for _ in range(rounds):
            for gate in self.gates:
                if not gate.done():
                    gate.set_result(None)
            await asyncio.sleep(0)


async def step(sequences: Sequences, runner: Held, **parameters: object) -> float:
    answer = await sequences.run(X, {"sequence_id": 7, **parameters}, runner.execute)
    return float(answer["y"][0, 0])


async def released(sequences: Sequences, runner: Held, **parameters: object) -> float:
    task = asyncio.ensure_future(step(sequences, runner, **parameters))
    await runner.release()
    return await task


async def test_a_failed_start_starts_nothing_and_a_failed_restart_keeps_the_state() -> None:
    sequences, runner = Sequences(SECTION, "runner/acc@1.0.0"), Held()
    runner.fail = DeadlineExceeded("late")
    with pytest.raises(DeadlineExceeded):
        await released(sequences, runner, sequence_start=True)
    assert sequences.live == 0 and sequences.describe()["started"] == 0
    runner.fail = None
    with pytest.raises(InvalidInput, match="is not running"):
        await released(sequences, runner)
    assert await released(sequences, runner, sequence_start=True) == 1.0
    assert await released(sequences, runner) == 2.0
    runner.fail = DeadlineExceeded("late")
    with pytest.raises(DeadlineExceeded):
        await released(sequences, runner, sequence_start=True)
    runner.fail = None
    assert await released(sequences, runner) == 3.0  # the failed restart reset nothing


async def test_a_start_queued_behind_the_end_begins_the_sequence_again() -> None:
    sequences, runner = Sequences(SECTION, "runner/acc@1.0.0"), Held()
    assert await released(sequences, runner, sequence_start=True) == 1.0
    queued = [
        asyncio.ensure_future(step(sequences, runner)),
        asyncio.ensure_future(step(sequences, runner, sequence_end=True)),
        asyncio.ensure_future(step(sequences, runner, sequence_start=True)),
        asyncio.ensure_future(step(sequences, runner)),
    ]
    await runner.release(40)
    assert [await t for t in queued] == [2.0, 3.0, 1.0, 2.0]
    assert sequences.live == 1


async def test_sequences_expire_soon_after_their_idle_timeout() -> None:
    """The sweep timer waits for the next sequence's expiry, not a whole timeout more."""
    section = SequenceSection(idle_timeout_s=0.3, max_sequences=8, states=SECTION.states)
    sequences, runner = Sequences(section, "runner/acc@1.0.0"), Held()
    await released(sequences, runner, sequence_start=True)
    await asyncio.sleep(0.2)
    await asyncio.gather(
        released(sequences, runner, sequence_start=True),
        sequences.run(X, {"sequence_id": 8, "sequence_start": True}, runner.execute),
    )
    await asyncio.sleep(0.5)  # the first timer (0.3 s) saw them fresh; they expired at 0.5
    assert sequences._live == {}  # swept by the timer, not by reading the figures
    assert sequences.expired == 2


async def test_the_server_feeds_the_control_tensors_triton_names() -> None:
    controls = SequenceControls(start="S", end="E", ready="R", corrid="C")
    section = SequenceSection(idle_timeout_s=60.0, max_sequences=8, controls=controls)
    seen: list[dict[str, list[object]]] = []

    async def execute(inputs: Arrays) -> dict[str, np.ndarray]:
        seen.append({k: v.ravel().tolist() for k, v in inputs.items() if k != "x"})
        assert all(v.shape == (1, 1) for k, v in inputs.items() if k != "x")
        return {"y": inputs["x"]}

    sequences = Sequences(section, "runner/s@1.0.0")
    for parameters in ({"sequence_start": True}, {}, {"sequence_end": True}):
        await sequences.run(X, {"sequence_id": "abc", **parameters}, execute)
    assert seen == [
        {"S": [1], "E": [0], "R": [1], "C": [b"abc"]},
        {"S": [0], "E": [0], "R": [1], "C": [b"abc"]},
        {"S": [0], "E": [1], "R": [1], "C": [b"abc"]},
    ]


async def test_an_integer_corrid_refuses_a_string_id_and_starts_nothing() -> None:
    controls = SequenceControls(corrid="C", corrid_datatype="UINT64")
    section = SequenceSection(idle_timeout_s=60.0, max_sequences=8, controls=controls)
    fed: list[np.ndarray] = []

    async def execute(inputs: Arrays) -> dict[str, np.ndarray]:
        fed.append(inputs["C"])
        return {"y": inputs["x"]}

    sequences = Sequences(section, "runner/s@1.0.0")
    with pytest.raises(InvalidInput, match="takes UINT64 sequence ids, not 'abc'"):
        await sequences.run(X, {"sequence_id": "abc", "sequence_start": True}, execute)
    assert sequences.live == 0
    await sequences.run(X, {"sequence_id": 2**64 - 1, "sequence_start": True}, execute)
    assert fed[0].dtype == np.uint64 and int(fed[0][0, 0]) == 2**64 - 1


async def test_a_worker_keeps_seeing_a_sequence_whose_step_was_refused() -> None:
    """A runner process refusing a step's input (400) keeps the sequence as it was: the
    worker goes on pinning it. A failed start leaves none; an answered end ends it."""
    now = [0.0]
    seen = SeenSequences(SECTION, clock=lambda: now[0])
    ended: list[object] = []
    seen.watch(ended.append)
    seen.answered({"sequence_id": "a", "sequence_start": True}, 200)
    seen.answered({"sequence_id": "a"}, 400)
    seen.answered({"sequence_id": "a", "sequence_end": True}, 400)
    assert seen.holds("a") and ended == []
    seen.answered({"sequence_id": "a", "sequence_end": True}, 200)
    assert not seen.holds("a") and ended == ["a"]
    seen.answered({"sequence_id": "b", "sequence_start": True}, 429)  # no room: not started
    seen.answered({"sequence_id": "c", "sequence_start": True}, 200)
    seen.answered({"sequence_id": "c", "sequence_start": True}, 400)  # a restart refused
    assert not seen.holds("b") and not seen.holds("c") and ended == ["a", "c"]
    seen.answered({"sequence_id": "d"}, 400)  # never seen started: nothing to keep
    assert seen.live == 0
