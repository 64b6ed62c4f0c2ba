"""Declared batching (``[runner.batching]``): batch axes, shared and ragged inputs, and
what the scheduler says when requests cannot batch."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

from plugserve.registry.execution import batching
from plugserve.registry.execution.batching import BatchPolicy, Scheduler
from plugserve.registry.execution.layout import BatchLayout, why_apart
from plugserve.registry.manifest import BatchingSection, InputBatching

Arrays = Mapping[str, np.ndarray]


def layout(outputs: dict[str, int] | None = None, **inputs: InputBatching) -> BatchLayout:
    return BatchLayout(BatchingSection(MappingProxyType(inputs), MappingProxyType(outputs or {})))


STATE = layout({"state_out": 1}, state=InputBatching(axis=1), sr=InputBatching(shared=True))


def request(x: float, sr: int = 16000) -> dict[str, np.ndarray]:
    """One row of an audio model: a chunk, its state [2, 1, 3] (rows on axis 1), a rate."""
    return {
        "x": np.full((1, 4), x, np.float32),
        "state": np.full((2, 1, 3), x, np.float32),
        "sr": np.array(sr, np.int64),
    }


def test_rows_on_a_declared_axis_concatenate_and_split_along_it() -> None:
    parts = [request(1.0), request(2.0), request(3.0)]
    signatures = {STATE.signature(p) for p in parts}
    assert len(signatures) == 1 and next(iter(signatures))[0] == 1
    merged = STATE.merge(parts)
    assert merged["x"].shape == (3, 4) and merged["state"].shape == (2, 3, 3)
    assert merged["state"][:, :, 0].tolist() == [[1, 2, 3], [1, 2, 3]]
    assert merged["sr"].shape == () and int(merged["sr"]) == 16000  # once for the batch
    outputs = {"y": merged["x"][:, :1] * 10, "state_out": merged["state"] + 1}
    answers = STATE.split(outputs, [1, 1, 1])
    for value, answer in zip([1.0, 2.0, 3.0], answers, strict=True):
        assert answer["y"].tolist() == [[value * 10]]
        assert answer["state_out"].shape == (2, 1, 3)
        assert (answer["state_out"] == value + 1).all()


def test_a_shared_value_that_differs_keeps_requests_apart() -> None:
    assert STATE.signature(request(1.0, 8000)) != STATE.signature(request(1.0, 16000))
    why = why_apart(STATE, request(1.0, 8000), request(1.0, 16000))
    assert "shared input 'sr' differs" in why


def test_split_refuses_an_output_without_the_batch_on_its_axis() -> None:
    with pytest.raises(ValueError, match=r"'state_out' has shape \(2, 2, 3\).*3 on its axis 1"):
        STATE.split({"state_out": np.zeros((2, 2, 3))}, [1, 1, 1])


def test_padded_inputs_batch_across_widths_with_their_lengths() -> None:
    padded = layout(
        crop=InputBatching(ragged="pad", ragged_axes=(2,), pad_value=-1.0, lengths="width")
    )
    a = {"crop": np.ones((1, 2, 3), np.float32)}
    b = {"crop": np.full((2, 2, 5), 2.0, np.float32)}
    assert padded.signature(a)[1] == padded.signature(b)[1]
    assert padded.signature(b)[0] == 2
    merged = padded.merge([a, b])
    assert merged["crop"].shape == (3, 2, 5)
    assert merged["crop"][0].tolist() == [[1, 1, 1, -1, -1]] * 2
    assert merged["width"].tolist() == [3, 5, 5]
    alone = padded.merge([a])  # alone, the runner still gets its lengths
    assert alone["crop"] is a["crop"] and alone["width"].tolist() == [3]
    # Unlike the undeclared default, whose rows must agree beyond axis 0:
    assert why_apart(None, a, b).startswith("input 'crop' has shape [1, 2, 3] in one request")


def test_concatenated_inputs_are_flattened_with_each_requests_count() -> None:
    flat = layout(tokens=InputBatching(ragged="concat", lengths="counts"))
    parts = [{"tokens": np.arange(n, dtype=np.int64).reshape(1, n)} for n in (2, 5, 1)]
    assert len({flat.signature(p) for p in parts}) == 1
    merged = flat.merge(parts)
    assert merged["tokens"].tolist() == [0, 1, 0, 1, 2, 3, 4, 0]
    assert merged["counts"].tolist() == [2, 5, 1]


def test_why_a_scalar_or_disagreeing_rows_cannot_batch() -> None:
    scalar = {"x": np.ones((1, 4), np.float32), "sr": np.array(16000)}
    assert "input 'sr' has 0 dimensions and no batch axis 0" in why_apart(None, scalar, None)
    assert layout().signature(scalar)[1] is None
    state = {"x": np.ones((1, 4), np.float32), "state": np.ones((2, 1, 3), np.float32)}
    assert layout().signature(state)[1] is None  # 1 row on axis 0 of x, 2 of state
    assert "different rows on their batch axes (state: 2, x: 1)" in why_apart(None, state, None)


class Recorder:
    """A runner that records each execution's inputs and answers y = x * 2 and the state
    plus one (rows on axis 1); held until released, so that a queue forms."""

    def __init__(self) -> None:
        self.batches: list[dict[str, np.ndarray]] = []
        self.gate: asyncio.Future[None] | None = None

    async def execute(self, inputs: Arrays) -> dict[str, np.ndarray]:
        self.batches.append(dict(inputs))
        self.gate = asyncio.get_running_loop().create_future()
        await self.gate
        return {"y": inputs["x"] * 2, "state_out": inputs["state"] + 1}

    async def release(self) -> None:
        for _ in range(10):
            if self.gate is not None and not self.gate.done():
                self.gate.set_result(None)
            await asyncio.sleep(0)


class Said:
    """Stands in for the scheduler's logger: what it warned (structlog's own capture
    misses a logger cached by an earlier test's configuration)."""

    def __init__(self) -> None:
        self.warnings: list[dict[str, Any]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append({"event": event, **fields})


async def test_the_scheduler_batches_by_the_declared_layout_and_says_why_it_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    said = Said()
    monkeypatch.setattr(batching, "log", said)
    runner = Recorder()
    scheduler = Scheduler(runner.execute, BatchPolicy(max_batch_size=8), "runner/vad@1.0.0")
    scheduler.declare(STATE)
    first = asyncio.ensure_future(scheduler.submit(request(0.0)))
    await asyncio.sleep(0)
    same = [asyncio.ensure_future(scheduler.submit(request(float(i)))) for i in (1, 2, 3)]
    other_rate = asyncio.ensure_future(scheduler.submit(request(9.0, sr=8000)))
    for _ in range(4):
        await runner.release()
    answers: list[Any] = await asyncio.gather(first, *same, other_rate)
    assert [b["x"].shape[0] for b in runner.batches] == [1, 3, 1]
    assert runner.batches[1]["state"].shape == (2, 3, 3)
    for value, answer in zip([0, 1, 2, 3, 9], answers, strict=True):
        assert answer["y"].tolist() == [[value * 2] * 4]
        assert answer["state_out"].shape == (2, 1, 3) and (answer["state_out"] == value + 1).all()
    assert scheduler.apart == 1
    assert scheduler.apart_why is not None and "shared input 'sr' differs" in scheduler.apart_why
    warnings = [e for e in said.warnings if e["event"] == "cannot_batch"]
    assert len(warnings) == 1 and warnings[0]["runner"] == "runner/vad@1.0.0"
