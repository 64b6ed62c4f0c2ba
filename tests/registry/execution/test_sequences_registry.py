"""Sequences of a real runner (``registry/execution/sequences.py``) in a real registry:
what a running sequence holds of its runner's queue, and that an ended one holds nothing
of a reloaded version."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plugserve.registry.errors import TooManyRequests
from plugserve.registry.execution.chain import Chain
from plugserve.registry.execution.sequences import Sequences
from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.types import RequestContext
from plugserve.server.dataplane.pins import SequencePins
from tests.helpers import write_sequence_runner


@pytest.fixture
async def registry(plugins_dir: Path, models_dir: Path) -> AsyncIterator[Registry]:
    reg = Registry(plugins_dir, models_dir, drain_timeout=2)
    yield reg
    await reg.close()


def ctx(parameters: dict[str, Any]) -> RequestContext:
    return RequestContext("r", "acc", parameters, {}, "application/json")


async def send(chain: Chain, parameters: dict[str, Any], x: float = 1.0) -> float:
    chain.enter()
    try:
        out = await chain.run({"x": np.full((1, 4), x, np.float32)}, ctx(parameters))
    finally:
        chain.leave()
    return float(out["y"][0, 0])


async def test_requests_waiting_for_their_turn_count_against_max_queue_size(
    plugins_dir: Path, registry: Registry
) -> None:
    """60 requests of one sequence at once: the runner holds 4 (its max_queue_size) and
    refuses the rest 429, as it refuses independent requests past its queue."""
    write_sequence_runner(plugins_dir, "acc", runner="max_queue_size = 4")
    await registry.start()
    chain = registry.routes.resolve("acc")
    assert await send(chain, {"sequence_id": 1, "sequence_start": True}) == 1.0
    steps = [send(chain, {"sequence_id": 1}) for _ in range(60)]
    answers = await asyncio.gather(*steps, return_exceptions=True)
    refused = [a for a in answers if isinstance(a, TooManyRequests)]
    served = sorted(a for a in answers if isinstance(a, float))
    assert len(refused) + len(served) == 60, answers
    assert refused and len(served) <= 4 + 1, (len(served), len(refused))
    assert served == [2.0 + n for n in range(len(served))]  # in order, each once
    assert "max_queue_size" in str(refused[0])
    sequences = chain.runner.live_sequences()
    assert isinstance(sequences, Sequences) and sequences.waiting == 0
    await send(chain, {"sequence_id": 1, "sequence_end": True})


async def test_a_reloaded_version_is_collected_once_its_sequence_ends(
    plugins_dir: Path, registry: Registry
) -> None:
    """A sequence keeps the version it started on past a reload; once it ends, nothing
    holds that version: no pin, no sequence (the instance is collected)."""
    folder = write_sequence_runner(plugins_dir, "acc", sequence="idle_timeout_s = 30")
    await registry.start()
    pins = SequencePins()

    async def step(parameters: dict[str, Any]) -> float:
        chain = pins.chain("acc", parameters, lambda key: registry.routes.resolve("acc", key=key))
        try:
            return await send(chain, parameters)
        finally:
            pins.settle("acc", parameters)

    assert await step({"sequence_id": "a", "sequence_start": True}) == 1.0
    old = weakref.ref(registry.routes.resolve("acc").runner)
    reload = asyncio.create_task(registry.load(folder, force=True))
    for _ in range(300):  # the new instance takes the route; the old one drains
        if registry.routes.resolve("acc").runner is not old():
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("never reloaded")
    assert await step({"sequence_id": "a"}) == 2.0  # on the instance it started on
    assert await step({"sequence_id": "a", "sequence_end": True}) == 3.0
    assert await asyncio.wait_for(reload, 30) == "reloaded"
    for _ in range(20):
        gc.collect()
        if old() is None:
            break
        await asyncio.sleep(0.05)
    assert old() is None, [type(r).__name__ for r in gc.get_referrers(old())]
    assert len(pins) == 0
    assert await step({"sequence_id": "a", "sequence_start": True, "sequence_end": True}) == 1.0
