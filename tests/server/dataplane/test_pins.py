"""Sequence pins (``server/dataplane/pins.py``): what they keep, and what they never keep."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from plugserve.server.dataplane import pins
from plugserve.server.dataplane.pins import SequencePins, sequence_key


class Kept:
    """A runner's live sequences, as ``Sequences.holds`` answers."""

    def __init__(self) -> None:
        self.ids: set[object] = set()

    def holds(self, sequence_id: object) -> bool:
        return sequence_id in self.ids


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


def test_a_purge_that_frees_nothing_waits_for_the_pins_to_double(monkeypatch: Any) -> None:
    monkeypatch.setattr(pins, "MAX_PINS", 10)
    table, kept = SequencePins(), Kept()
    chain = chain_keeping(kept)
    scans = 0
    original = kept.holds

    def counted(sequence_id: object) -> bool:
        nonlocal scans
        scans += 1
        return original(sequence_id)

    kept.holds = counted  # type: ignore[method-assign]
    for n in range(1, 41):
        kept.ids.add(n)
        table.chain("r", {"sequence_id": n, "sequence_start": True}, lambda _: chain)
    assert len(table) == 40
    assert scans < 3 * 40  # purges at 11, 22 and 44 pins, not at every start past 10
