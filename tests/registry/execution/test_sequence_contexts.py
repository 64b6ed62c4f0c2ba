"""A sequence's contexts (``[[runner.sequence.state]]`` with ``from_input``,
``registry/execution/sequences.py``): what the runner is fed with each request and what
is kept for the next, against a loop that keeps the context as a streaming model's own
wrapper does."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from plugserve.registry.errors import DeadlineExceeded, InvalidInput, PluginLoadError
from plugserve.registry.execution.layout import BatchLayout, TensorBounds
from plugserve.registry.execution.sequences import Sequences, inputs_as_sent
from plugserve.registry.manifest import (
    BatchingSection,
    ContextSpec,
    InputBatching,
    SequenceSection,
    StateSpec,
)

Arrays = Mapping[str, np.ndarray]
LABEL = "runner/vad@1.0.0"
PREPENDED = ContextSpec("input", "input", 1, "FP32", (4,))
"""Four samples of context in front of each chunk of ``input`` [1, samples]."""


def section(*contexts: ContextSpec, states: tuple[StateSpec, ...] = ()) -> SequenceSection:
    return SequenceSection(idle_timeout_s=60.0, max_sequences=8, states=states, contexts=contexts)


class Recorder:
    """Answers each request with the sum of what it was fed, and remembers the feed."""

    def __init__(self) -> None:
        self.fed: list[dict[str, np.ndarray]] = []
        self.fail: Exception | None = None

    async def execute(self, inputs: Arrays) -> dict[str, np.ndarray]:
        self.fed.append({name: array.copy() for name, array in inputs.items()})
        if self.fail is not None:
            raise self.fail
        total = sum(float(a.sum()) for a in inputs.values() if a.dtype.kind == "f")
        return {"y": np.full((1, 1), total, np.float32)}


def wrapper_inputs(chunks: list[np.ndarray], keep: int) -> list[np.ndarray]:
    """What a streaming wrapper feeds its model: ``[context, chunk]`` on axis 1, the
    context being the last ``keep`` samples of the previous feed (zeros at the start)."""
    context = np.zeros((1, keep), np.float32)
    feeds = []
    for chunk in chunks:
        x = np.concatenate([context, chunk], axis=1)
        feeds.append(x)
        context = x[..., -keep:]
    return feeds


async def run(sequences: Sequences, runner: Recorder, inputs: Arrays, **parameters: object) -> None:
    await sequences.run(inputs, {"sequence_id": "s", **parameters}, runner.execute)


@pytest.mark.parametrize("size", [7, 4, 3, 1])
async def test_each_chunk_reaches_the_model_behind_the_samples_before_it(size: int) -> None:
    """Chunks longer than, as long as or shorter than the context: a short chunk keeps
    part of the context before it, as the wrapper's ``x[..., -keep:]`` does."""
    rng = np.random.default_rng(size)
    chunks = [rng.standard_normal((1, size)).astype(np.float32) for _ in range(6)]
    sequences, runner = Sequences(section(PREPENDED), LABEL), Recorder()
    for i, chunk in enumerate(chunks):
        await run(sequences, runner, {"input": chunk}, sequence_start=i == 0)
    expected = wrapper_inputs(chunks, keep=4)
    assert [f["input"].shape for f in runner.fed] == [(1, 4 + size)] * 6
    for fed, want in zip(runner.fed, expected, strict=True):
        assert fed["input"].tobytes() == want.tobytes()


async def test_a_context_of_its_own_is_fed_beside_the_chunk() -> None:
    """``input`` names another model input: the context arrives there, the chunk unchanged."""
    spec = ContextSpec("past", "x", 1, "FP32", (3,), initial=-1.0)
    sequences, runner = Sequences(section(spec), LABEL), Recorder()
    chunks = [np.arange(5, dtype=np.float32).reshape(1, 5) + 10 * i for i in range(3)]
    for i, chunk in enumerate(chunks):
        await run(sequences, runner, {"x": chunk}, sequence_start=i == 0)
    assert [f["past"].tolist() for f in runner.fed] == [[[-1, -1, -1]], [[2, 3, 4]], [[12, 13, 14]]]
    assert all(f["x"].tobytes() == c.tobytes() for f, c in zip(runner.fed, chunks, strict=True))


async def test_a_time_major_input_keeps_its_context_where_its_rows_are_not() -> None:
    """``audio`` [T, N, C] with its rows on axis 1: the context is [frames, 1, C]."""
    spec = ContextSpec("audio", "audio", 0, "FP32", (2, 3))
    layout = BatchLayout(BatchingSection(inputs={"audio": InputBatching(axis=1)}))
    sequences, runner = Sequences(section(spec), LABEL, layout), Recorder()
    first = np.arange(15, dtype=np.float32).reshape(5, 1, 3)
    await run(sequences, runner, {"audio": first}, sequence_start=True)
    await run(sequences, runner, {"audio": first + 100})
    fed = [f["audio"] for f in runner.fed]
    assert fed[0].shape == (7, 1, 3) and not fed[0][:2].any()
    assert fed[1][:2].tobytes() == first[-2:].tobytes()
    assert fed[1][2:].tobytes() == (first + 100).tobytes()


async def test_contexts_and_states_start_again_and_survive_a_failed_request() -> None:
    """A failed request keeps the context it found; a restart goes back to silence."""
    state = StateSpec("h", "h_out", "FP32", (1,))
    sequences = Sequences(section(PREPENDED, states=(state,)), LABEL)
    fed: list[np.ndarray] = []
    failing: list[Exception] = []

    async def execute(inputs: Arrays) -> dict[str, np.ndarray]:
        fed.append(inputs["input"].copy())
        if failing:
            raise failing.pop()
        return {"y": inputs["h"], "h_out": inputs["h"] + 1}

    ones = np.ones((1, 6), np.float32)
    await sequences.run({"input": ones}, {"sequence_id": 1, "sequence_start": True}, execute)
    failing.append(DeadlineExceeded("late"))
    with pytest.raises(DeadlineExceeded):
        await sequences.run({"input": ones * 2}, {"sequence_id": 1}, execute)
    await sequences.run({"input": ones * 3}, {"sequence_id": 1}, execute)
    # The failed request's samples never became the context.
    assert fed[2][0, :4].tolist() == [1.0] * 4
    await sequences.run({"input": ones * 4}, {"sequence_id": 1, "sequence_start": True}, execute)
    assert fed[3][0, :4].tolist() == [0.0] * 4


async def test_a_chunk_that_does_not_fit_its_context_is_a_400_and_starts_nothing() -> None:
    sequences, runner = Sequences(section(PREPENDED), LABEL), Recorder()
    cases = [
        ({"other": np.ones((1, 8), np.float32)}, "keeps a context of input 'input'"),
        ({"input": np.ones((1, 8), np.float64)}, "input 'input' is FP64; .* as FP32"),
        ({"input": np.ones((1, 2, 8), np.float32)}, r"has shape \[1, 2, 8\]; .* \[1, -1\]"),
        ({"input": np.ones(1, np.float32)}, r"has shape \[1\]; .* \[1, -1\]"),
    ]
    for inputs, message in cases:
        with pytest.raises(InvalidInput, match=message):
            await run(sequences, runner, inputs, sequence_start=True)
        assert sequences.live == 0 and sequences.describe()["started"] == 0
    assert runner.fed == []


async def test_each_sequence_keeps_its_own_context() -> None:
    sequences, runner = Sequences(section(PREPENDED), LABEL), Recorder()
    for sequence_id, value in (("a", 1.0), ("b", 2.0)):
        chunk = np.full((1, 5), value, np.float32)
        await sequences.run(
            {"input": chunk}, {"sequence_id": sequence_id, "sequence_start": True}, runner.execute
        )
    for sequence_id in ("b", "a"):
        await sequences.run(
            {"input": np.zeros((1, 5), np.float32)}, {"sequence_id": sequence_id}, runner.execute
        )
    assert runner.fed[2]["input"][0, :4].tolist() == [2.0] * 4
    assert runner.fed[3]["input"][0, :4].tolist() == [1.0] * 4


def tensor(name: str, shape: list[int], datatype: str = "FP32") -> dict[str, object]:
    return {"name": name, "datatype": datatype, "shape": shape}


def test_clients_see_the_chunk_a_prepended_context_leaves_room_for() -> None:
    silero = section(ContextSpec("input", "input", 1, "FP32", (64,)))
    model = [tensor("input", [-1, 576]), tensor("sr", [], "INT64")]
    assert inputs_as_sent(silero, None, model, LABEL) == [
        tensor("input", [-1, 512]), tensor("sr", [], "INT64"),
    ]  # fmt: skip
    dynamic = [tensor("input", [-1, -1])]
    assert inputs_as_sent(silero, None, dynamic, LABEL) == dynamic
    own = section(ContextSpec("past", "input", 1, "FP32", (64,)))
    assert inputs_as_sent(own, None, model, LABEL) == model
    time_major = section(ContextSpec("audio", "audio", 0, "FP32", (16, 2)))
    batching = BatchingSection(inputs={"audio": InputBatching(axis=1)})
    shown = inputs_as_sent(time_major, batching, [tensor("audio", [48, -1, 2])], LABEL)
    assert shown == [tensor("audio", [32, -1, 2])]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (tensor("input", [-1, 64]), "the model takes 64 there, leaving no room"),
        (tensor("input", [-1, 1, 576]), r"of 1 dimensions and a batch axis; .* \[-1, 1, 576\]"),
        (tensor("input", [-1, 576], "FP16"), "of FP32; the model takes FP16"),
    ],
)
def test_a_model_that_cannot_take_its_declared_context_fails_to_load(
    model: dict[str, object], message: str
) -> None:
    silero = section(ContextSpec("input", "input", 1, "FP32", (64,)))
    with pytest.raises(PluginLoadError, match=message):
        inputs_as_sent(silero, None, [model], LABEL)


async def test_a_chunk_joined_with_its_context_keeps_the_tensor_bound() -> None:
    """The server's max_tensor_elements holds the tensor it builds, the chunk and its
    context joined: a chunk at the bound is refused (400) and the sequence keeps its state;
    a large chunk is joined off the event loop and answered as a small one is."""
    sequences, runner = Sequences(section(PREPENDED), LABEL), Recorder()
    sequences.bounds = TensorBounds(max_elements=100_000)
    await run(sequences, runner, {"input": np.ones((1, 8), np.float32)}, sequence_start=True)
    with pytest.raises(InvalidInput, match="max_tensor_elements"):
        await run(sequences, runner, {"input": np.ones((1, 99_998), np.float32)})
    big = np.arange(99_996, dtype=np.float32).reshape(1, -1)  # 390 KiB: joined on a thread
    await run(sequences, runner, {"input": big})
    assert (
        runner.fed[-1]["input"].tobytes()
        == np.concatenate([np.ones((1, 4), np.float32), big], axis=1).tobytes()
    )
