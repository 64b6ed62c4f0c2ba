"""What a batch merges its requests into keeps the bounds of one request's tensor, and a
padded input's ``lengths`` give each row's size on every ragged axis it declares."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

from plugserve.registry.errors import InvalidInput, ManifestError
from plugserve.registry.execution.batching import BatchPolicy, Scheduler
from plugserve.registry.execution.components.batched import BatchedRunner
from plugserve.registry.execution.layout import (
    PAD_FLOOR,
    BatchLayout,
    TensorBounds,
    footprint,
    why_apart,
)
from plugserve.registry.lifecycle.loader import Loader
from plugserve.registry.manifest import BatchingSection, InputBatching, load_manifest
from plugserve.registry.plugins.hooks import PluginHooks
from plugserve.registry.types import RequestContext
from tests.helpers import write_plugin

Arrays = Mapping[str, np.ndarray]

# The attack, scaled down: each request holds 300 elements, their padded batch 2 x 300 x 300.
WIDE = 300
BOUND = TensorBounds(max_elements=1000, max_bytes_elements=10)


def layout(**inputs: InputBatching) -> BatchLayout:
    return BatchLayout(BatchingSection(MappingProxyType(inputs), MappingProxyType({})))


PADDED = layout(x=InputBatching(ragged="pad", ragged_axes=(1, 2)))


class Held:
    """A runner that records each execution's inputs, holds it until released (so that a
    queue forms behind it) and answers each row's sum (padding adds nothing to it)."""

    def __init__(self, answer: Any = None) -> None:
        self.batches: list[dict[str, np.ndarray]] = []
        self.gate: asyncio.Future[None] | None = None
        self.answer = answer or (
            lambda inputs: {"y": inputs["x"].reshape(len(inputs["x"]), -1).sum(1)}
        )

    async def execute(self, inputs: Arrays) -> dict[str, np.ndarray]:
        self.batches.append(dict(inputs))
        self.gate = asyncio.get_running_loop().create_future()
        await self.gate
        return dict(self.answer(inputs))

    async def release(self) -> None:
        for _ in range(10):
            if self.gate is not None and not self.gate.done():
                self.gate.set_result(None)
            await asyncio.sleep(0)


async def queued_behind_one(
    scheduler: Scheduler, runner: Held, requests: list[dict[str, np.ndarray]]
) -> list[Any]:
    """``requests`` queued while a first request runs, then every answer (the first's
    last)."""
    first = asyncio.ensure_future(scheduler.submit(requests[0]))
    await asyncio.sleep(0)
    rest = [asyncio.ensure_future(scheduler.submit(r)) for r in requests[1:]]
    await asyncio.sleep(0)
    for _ in range(len(requests)):
        await runner.release()
    return list(await asyncio.gather(*rest, first))


def x(shape: tuple[int, ...], value: float = 1.0) -> dict[str, np.ndarray]:
    return {"x": np.full(shape, value, np.float32)}


async def test_requests_wide_on_different_axes_never_pad_past_the_tensor_bound() -> None:
    runner = Held()
    scheduler = Scheduler(runner.execute, BatchPolicy(max_batch_size=8), "runner/pad@1.0.0")
    scheduler.declare(PADDED)
    scheduler.bounds = BOUND
    tall, flat = x((1, WIDE, 1), 2.0), x((1, 1, WIDE), 3.0)
    answers = await queued_behind_one(scheduler, runner, [x((1, 1, 1)), tall, flat])
    assert all(b["x"].size <= BOUND.max_elements for b in runner.batches)
    assert [b["x"].shape for b in runner.batches] == [(1, 1, 1), (1, WIDE, 1), (1, 1, WIDE)]
    assert [a["y"].tolist() for a in answers] == [[2.0 * WIDE], [3.0 * WIDE], [1.0]]


async def test_a_request_past_the_bound_closes_the_batch_and_opens_the_next() -> None:
    runner = Held()
    scheduler = Scheduler(runner.execute, BatchPolicy(max_batch_size=8), "runner/pad@1.0.0")
    scheduler.declare(PADDED)
    scheduler.bounds = BOUND
    same = [x((1, 1, WIDE), float(i)) for i in (1, 2, 3)]  # 3 x 300: within the bound
    tall = x((1, WIDE, 1), 5.0)  # with them: 4 x 300 x 300
    answers = await queued_behind_one(scheduler, runner, [x((1, 1, 1)), *same, tall])
    assert [b["x"].shape for b in runner.batches] == [(1, 1, 1), (3, 1, WIDE), (1, WIDE, 1)]
    assert [a["y"].tolist() for a in answers[:-1]] == [[1.0 * WIDE], [2.0 * WIDE],
                                                       [3.0 * WIDE], [5.0 * WIDE]]  # fmt: skip


async def test_concatenated_batches_keep_the_element_bounds_too() -> None:
    """Undeclared batching (rows on axis 0): 4 requests of 400 elements, bound 1000."""
    runner = Held()
    scheduler = Scheduler(runner.execute, BatchPolicy(max_batch_size=8), "runner/flat@1.0.0")
    scheduler.bounds = BOUND
    parts = [x((1, 400), float(i)) for i in range(5)]
    answers = await queued_behind_one(scheduler, runner, parts)
    assert [b["x"].shape[0] for b in runner.batches] == [1, 2, 2]
    assert [a["y"].tolist() for a in answers] == [[400.0 * i] for i in (1, 2, 3, 4, 0)]


def test_the_footprint_counts_padding_concatenation_and_bytes_elements() -> None:
    wide = PADDED.footprint(x((1, 1, WIDE)), BOUND)
    assert wide.admits(x((2, 1, WIDE)))  # 3 x 1 x 300
    assert not wide.admits(x((1, 2, 1)))  # 4 x 2 x 300: past 1000
    assert wide.admits(x((0, 1, 1)))  # the refusal left the batch as it was
    flat = layout(t=InputBatching(ragged="concat", lengths="n"))
    tokens = flat.footprint({"t": np.zeros((1, 600))}, BOUND)
    assert not tokens.admits({"t": np.zeros((1, 401))})
    strings = {"s": np.array([[b"a"] * 6], dtype=object)}
    texts = footprint(None, strings, BOUND)  # BYTES: max_bytes_elements
    assert not texts.admits(strings)
    shared = layout(sr=InputBatching(shared=True))
    assert shared.footprint({"sr": np.zeros(800)}, BOUND).admits({"sr": np.zeros(800)})


async def test_small_requests_never_pad_into_a_batch_many_times_their_size() -> None:
    """Two requests of 5,000 elements (40 KB together), wide on different axes, within the
    server's default bound padded together (2 x 5000 x 5000, 200 MB): each runs alone."""
    runner = Held()
    scheduler = Scheduler(runner.execute, BatchPolicy(max_batch_size=8), "runner/pad@1.0.0")
    scheduler.declare(PADDED)
    tall, flat = x((1, 5000, 1), 2.0), x((1, 1, 5000), 3.0)
    assert scheduler.bounds.max_elements >= 2 * 5000 * 5000
    answers = await queued_behind_one(scheduler, runner, [x((1, 1, 1)), tall, flat])
    assert [b["x"].shape for b in runner.batches] == [(1, 1, 1), (1, 5000, 1), (1, 1, 5000)]
    assert [a["y"].tolist() for a in answers] == [[2.0 * 5000], [3.0 * 5000], [1.0]]


def test_a_padded_batch_holds_at_most_pad_waste_times_what_its_requests_sent() -> None:
    """PAD_WASTE is 4: the padded tensor holds at most 4 times the elements sent."""
    wide = PAD_FLOOR  # one request of PAD_FLOOR elements, 1 row
    kept = PADDED.footprint(x((1, 1, wide)), TensorBounds())
    assert kept.admits(x((1, 2, 1)))  # 2 x 2 x wide: within 4 x (wide + 2) sent
    assert not kept.admits(x((1, 4, 1)))  # 3 x 4 x wide: past 4 x (wide + 6)
    assert kept.admits(x((1, 1, wide)))  # the refusal left the batch as it was
    small = PADDED.footprint(x((1, 100, 1)), TensorBounds())  # below PAD_FLOOR: padded
    assert small.admits(x((1, 1, 100)))  # 2 x 100 x 100 for 200 sent


FRAMES = layout(x=InputBatching(ragged="pad", ragged_axes=(1,), lengths="frames"))
IMAGES = layout(x=InputBatching(ragged="pad", ragged_axes=(2, 3), lengths="size"))


def masked_mean(inputs: Arrays) -> dict[str, np.ndarray]:
    """A masked model: each row's mean over the valid part of its ragged axes."""
    value, lengths = inputs["x"], inputs.get("frames", inputs.get("size"))
    assert lengths is not None
    means = []
    for row, length in zip(value, lengths, strict=True):
        index = tuple(slice(0, int(n)) for n in np.atleast_1d(length))
        if value.ndim == 3:  # [N, frames, features]
            means.append(row[index].mean())
        else:  # [N, C, H, W]
            means.append(row[(slice(None), *index)].mean())
    return {"y": np.array(means, np.float32)}


@pytest.mark.parametrize(
    ("declared", "short", "long"),
    [
        (FRAMES, (1, 3, 5), (1, 7, 5)),  # [N, frames, features], ragged on frames
        (IMAGES, (1, 3, 2, 6), (1, 3, 5, 4)),  # [N, C, H, W], ragged on H and W
    ],
    ids=["frames", "height-and-width"],
)
async def test_a_masked_mean_is_the_same_alone_and_batched(
    declared: BatchLayout, short: tuple[int, ...], long: tuple[int, ...]
) -> None:
    alone = masked_mean(declared.merge([x(short)]))["y"].tolist()
    assert alone == [1.0]
    runner = Held(masked_mean)
    scheduler = Scheduler(runner.execute, BatchPolicy(max_batch_size=8), "runner/mask@1.0.0")
    scheduler.declare(declared)
    answers = await queued_behind_one(scheduler, runner, [x(long, 4.0), x(short), x(long, 2.0)])
    assert len(runner.batches) == 2 and runner.batches[1]["x"].shape[0] == 2
    assert [a["y"].tolist() for a in answers] == [[1.0], [2.0], [4.0]]


def test_lengths_give_every_ragged_axis_and_only_those_may_differ() -> None:
    merged = IMAGES.merge([x((1, 3, 2, 6)), x((2, 3, 5, 4))])
    assert merged["x"].shape == (3, 3, 5, 6)
    assert merged["size"].tolist() == [[2, 6], [5, 4], [5, 4]]
    assert FRAMES.merge([x((2, 3, 5))])["frames"].tolist() == [3, 3]
    features = [x((1, 3, 5)), x((1, 3, 6))]  # features are not a ragged axis
    assert FRAMES.signature(features[0])[1] != FRAMES.signature(features[1])[1]
    assert "only its ragged_axes [1] may differ" in why_apart(FRAMES, *features)
    assert FRAMES.signature(x((4,)))[1] is None
    with pytest.raises(InvalidInput, match="ragged axes \\[1\\] need at least 2"):
        FRAMES.merge([x((4,))])


HEAD = "[plugin]\nname='mask'\nversion='1.0.0'\ntype='runner'\n[runner]\nbackend='onnxruntime'\n"


def manifest(plugins_dir: Path, inputs: str) -> Path:
    folder = plugins_dir / "runner" / "mask" / "1.0.0"
    folder.mkdir(parents=True)
    (folder / "plugin.toml").write_text(HEAD + "[runner.batching.inputs]\n" + inputs)
    return folder


def test_a_padded_input_declares_its_ragged_axes(plugins_dir: Path) -> None:
    folder = manifest(plugins_dir, "x = { ragged = 'pad', ragged_axes = [2, 3], lengths = 's' }")
    runner = load_manifest(folder).runner
    assert runner is not None and runner.batching is not None
    assert runner.batching.input("x").ragged_axes == (2, 3)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ("x = { ragged = 'pad', lengths = 'n' }", "names the axes that may differ"),
        ("x = { ragged = 'pad', ragged_axes = [] }", "names the axes that may differ"),
        ("x = { ragged = 'pad', ragged_axes = [0] }", "other than the batch axis 0"),
        ("x = { ragged = 'pad', axis = 1, ragged_axes = [2, 2] }", "must be distinct"),
        ("x = { ragged = 'pad', ragged_axes = [16] }", "ragged_axes"),
        ("x = { ragged = 'concat', lengths = 'n', ragged_axes = [1] }", 'for ragged = "pad"'),
    ],
)
def test_ragged_axes_are_checked(plugins_dir: Path, inputs: str, message: str) -> None:
    with pytest.raises(ManifestError, match=message) as info:
        load_manifest(manifest(plugins_dir, inputs))
    assert info.value.fields["field"] == "runner.batching.inputs.x.ragged_axes"


PADDING_RUNNER = """
    import asyncio

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Sums:
        def __init__(self):
            self.shapes = []
            self.gate = None

        async def infer(self, inputs):
            self.shapes.append(inputs["x"].shape)
            self.gate = self.gate or asyncio.Event()
            await self.gate.wait()
            return {"y": inputs["x"].reshape(len(inputs["x"]), -1).sum(1)}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Sums()
"""


def context() -> RequestContext:
    return RequestContext("id", "pad", {}, {}, "application/json")


async def test_a_loaded_runner_batches_within_the_servers_tensor_bounds(
    plugins_dir: Path, models_dir: Path
) -> None:
    """The loader hands its ``tensor_bounds`` (the server's settings) to each batched
    runner it loads: the attack's two requests, through a runner's declared padding."""
    manifest = (
        "[runner]\nmax_batch_size = 8\n"
        "[runner.batching.inputs]\nx = { ragged = 'pad', ragged_axes = [1, 2] }\n"
    )
    folder = write_plugin(plugins_dir, "runner", "pad", "1.0.0", manifest,
                          {"plugin.py": PADDING_RUNNER})  # fmt: skip
    host = PluginHooks()
    host.load_builtins()
    loader = Loader(host, models_dir)
    loader.tensor_bounds = BOUND
    loaded = await loader.load(folder)
    assert isinstance(loaded, BatchedRunner) and loaded.scheduler.bounds is BOUND
    runner = loaded.component
    try:
        calls = [x((1, 1, 1)), x((1, WIDE, 1), 2.0), x((1, 1, WIDE), 3.0)]
        first = asyncio.ensure_future(loaded.call(calls[0], context()))
        await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(loaded.call(c, context())) for c in calls[1:]]
        await asyncio.sleep(0.01)
        runner.gate.set()
        answers = await asyncio.wait_for(asyncio.gather(first, *rest), 10)
    finally:
        await loader.release(loaded)
    assert runner.shapes == [(1, 1, 1), (1, WIDE, 1), (1, 1, WIDE)]
    assert [a["y"].tolist() for a in answers] == [[1.0], [2.0 * WIDE], [3.0 * WIDE]]
