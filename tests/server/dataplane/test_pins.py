"""Sequence pins (``server/dataplane/pins.py``): what they keep, and what they never keep."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np

from plugserve.registry.execution.sequences import Sequences
from plugserve.registry.manifest import SequenceSection, StateSpec
from plugserve.server.dataplane.pins import SequencePins, sequence_key


class Kept:
    """A runner's live sequences, as ``Sequences.holds`` answers and ``watch`` tells."""

    def __init__(self) -> None:
        self.ids: set[object] = set()
        self.watchers: list[Callable[[Any], None]] = []

    def holds(self, sequence_id: object) -> bool:
        return sequence_id in self.ids

    def watch(self, ended: Callable[[Any], None]) -> None:
        if ended not in self.watchers:
            self.watchers.append(ended)


def chain_keeping(kept: Kept) -> Any:
    return SimpleNamespace(runner=SimpleNamespace(live_sequences=lambda: kept))


def test_a_started_sequence_keeps_its_chain_while_it_runs() -> None:
    table, kept_old, kept_new = SequencePins(), Kept(), Kept()
    old, new = chain_keeping(kept_old), chain_keeping(kept_new)
    keys = []

    def resolve_to(chain: Any) -> Any:
        return lambda key: keys.append(key) or chain

    assert table.chain("r", {"sequence_id": "a", "sequence_start": True}, resolve_to(old)) is old
    kept_old.ids.add("a")
    assert table.chain("r", {"sequence_id": "a"}, resolve_to(new)) is old  # the route moved
    assert keys == [sequence_key("a")]  # placed by its id; the pin answered the second
    kept_old.ids.clear()  # ended: the next start takes what the route gives
    assert table.chain("r", {"sequence_id": "a", "sequence_start": True}, resolve_to(new)) is new


def test_refused_ids_and_sequences_that_run_nowhere_keep_no_pin() -> None:
    table, kept = SequencePins(), Kept()
    chain = chain_keeping(kept)
    for sequence_id in ("x" * 257, 2**64, -1, 0, "", True, 1.5):
        table.chain("r", {"sequence_id": sequence_id, "sequence_start": True}, lambda _: chain)
    for n in range(100):  # not started, not running: the runner answers 400
        table.chain("r", {"sequence_id": f"s{n}"}, lambda _: chain)
    assert len(table) == 0
    table.chain("r", {"sequence_id": "x" * 256, "sequence_start": True}, lambda _: chain)
    assert len(table) == 1


SECTION = SequenceSection(
    idle_timeout_s=0.2, max_sequences=8, states=(StateSpec("s_in", "s_out", "FP32", (1,)),)
)
X = {"x": np.ones((1, 1), np.float32)}


async def execute(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    total = inputs["s_in"] + inputs["x"]
    return {"y": total, "s_out": total}


async def test_a_pin_goes_when_its_sequence_ends_expires_or_never_starts() -> None:
    """An ended sequence holds no chain: the pin goes with its end request, its expiry
    and its runner's release, not once pins pile up to a cap."""
    table, sequences = SequencePins(), Sequences(SECTION, "runner/acc@1.0.0")
    chain: Any = SimpleNamespace(runner=SimpleNamespace(live_sequences=lambda: sequences))

    async def send(**parameters: Any) -> None:
        parameters = {"sequence_id": parameters.pop("id"), **parameters}
        assert table.chain("r", parameters, lambda _: chain) is chain
        try:
            await sequences.run(X, parameters, execute)
        finally:
            table.settle("r", parameters)

    await send(id="ends", sequence_start=True)
    await send(id="ends")
    assert len(table) == 1
    await send(id="ends", sequence_end=True)
    assert len(table) == 0  # at its end
    for n in range(3):
        await send(id=f"idle{n}", sequence_start=True)
    assert len(table) == 3
    await asyncio.sleep(0.5)  # idle past idle_timeout_s: swept by the runner's timer
    assert len(table) == 0
    await send(id="released", sequence_start=True)
    sequences.clear()  # the runner is released
    assert len(table) == 0
    try:  # a start the runner refuses before it starts anything (two rows)
        parameters = {"sequence_id": "refused", "sequence_start": True}
        table.chain("r", parameters, lambda _: chain)
        await sequences.run({"x": np.ones((2, 1), np.float32)}, parameters, execute)
    except Exception:
        table.settle("r", parameters)
    assert len(table) == 0


def test_a_pin_to_a_runner_that_still_runs_the_sequence_stays() -> None:
    """A sequence started again on a new version: the old version's end of it leaves the
    new pin in place."""
    table, kept_old, kept_new = SequencePins(), Kept(), Kept()
    old, new = chain_keeping(kept_old), chain_keeping(kept_new)
    start = {"sequence_id": "a", "sequence_start": True}
    table.chain("r", start, lambda _: old)
    kept_old.ids.add("a")
    assert table.chain("r", start, lambda _: new) is new
    kept_new.ids.add("a")
    kept_old.ids.clear()
    for ended in kept_old.watchers:
        ended("a")
    assert table.chain("r", {"sequence_id": "a"}, lambda _: old) is new
    assert len(table) == 1
