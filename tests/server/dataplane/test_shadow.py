"""How two answers are compared: within tolerance per output, and anything else different
(shape, type, a missing output) as different as can be; when copies may run beside the
live requests of the process; how sequences are copied whole or not at all, and never
kept past their end, nor counted failed where the canary could not run them."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from plugserve.registry.errors import InvalidInput, TooManyRequests
from plugserve.registry.execution.chain import Chain
from plugserve.registry.execution.sequences import Sequences
from plugserve.registry.manifest import SequenceSection
from plugserve.registry.routing.figures import ShadowFigures, Windows
from plugserve.registry.routing.rollout import parse_rollout
from plugserve.registry.routing.routes import RouteTable
from plugserve.registry.types import RequestContext
from plugserve.server.dataplane import shadow
from plugserve.server.dataplane.shadow import (
    BUSY_TIME_SHARE,
    CHARGE_CAP_S,
    QUEUE_BYTES,
    ShadowCopy,
    ShadowTraffic,
    _copied,
    compare,
)
from plugserve.server.runtime.shutdown import Drain


def test_numbers_agree_within_tolerance_and_the_largest_difference_is_kept() -> None:
    live = {"y": np.array([1.0, 2.0, 3.0], np.float32), "label": np.array(["cat"], object)}
    near = {"y": np.array([1.0, 2.0, 3.00001], np.float32), "label": np.array(["cat"], object)}
    agreed, diffs = compare(live, near, atol=1e-4, rtol=0.0)
    assert agreed and diffs["label"] == 0.0 and 0 < diffs["y"] < 1e-4
    far = {**near, "y": np.array([1.0, 2.5, 3.0], np.float32)}
    agreed, diffs = compare(live, far, atol=1e-4, rtol=0.0)
    assert not agreed and diffs["y"] == 0.5


def test_shapes_types_and_outputs_that_differ_never_agree() -> None:
    live = {"y": np.zeros((2, 2))}
    for other in ({"y": np.zeros(4)}, {"y": np.array(["a"], object)}, {"z": np.zeros((2, 2))}):
        agreed, diffs = compare(live, other, 1e-5, 1e-4)
        assert not agreed and math.inf in diffs.values()
    assert compare({"text": "same"}, {"text": "same"}, 0, 0) == (True, {"text": 0.0})
    assert compare(b"raw", b"other", 0, 0)[0] is False


def test_nan_agrees_only_with_nan() -> None:
    assert compare({"y": np.array([np.nan])}, {"y": np.array([np.nan])}, 0, 0)[0]
    agreed, diffs = compare({"y": np.array([np.nan])}, {"y": np.array([1.0])}, 0, 0)
    assert not agreed and diffs["y"] == math.inf


def test_a_copy_keeps_the_inputs_as_they_came() -> None:
    data = {"x": np.ones(3)}
    copy = _copied(data)
    data["x"] += 1  # a stage writing into its input
    assert copy["x"].tolist() == [1.0, 1.0, 1.0]


def _traffic(drain: Drain) -> ShadowTraffic:
    return ShadowTraffic(RouteTable, Windows(), live=drain)


async def test_a_copy_starts_at_once_while_no_live_request_is_in_flight() -> None:
    drain = Drain(timeout_s=5)
    traffic = _traffic(drain)
    traffic._spent(60.0)  # a long copy just ran: beside live requests, the next would wait
    await asyncio.wait_for(traffic._turn(), 0.5)


async def test_a_copy_waits_for_the_process_to_fall_idle() -> None:
    drain = Drain(timeout_s=5)
    traffic = _traffic(drain)
    traffic._spent(60.0)
    drain.enter()  # a live request in flight
    turn = asyncio.create_task(traffic._turn())
    await asyncio.sleep(0.2)
    assert not turn.done()
    drain.leave()
    await asyncio.wait_for(turn, 0.5)


async def test_beside_live_requests_that_never_stop_copies_take_their_share_of_time() -> None:
    drain = Drain(timeout_s=5)
    traffic = _traffic(drain)
    drain.enter()
    await asyncio.wait_for(traffic._turn(), 0.5)  # nothing ran yet: nothing to wait for
    traffic._spent(0.003)
    started = time.monotonic()
    await asyncio.wait_for(traffic._turn(), 5)
    waited = time.monotonic() - started
    assert 0.8 * 0.003 / BUSY_TIME_SHARE <= waited < 2.0, waited


async def test_a_copy_that_waited_long_holds_the_next_back_by_its_capped_charge_only() -> None:
    drain = Drain(timeout_s=5)
    traffic = _traffic(drain)
    drain.enter()
    traffic._spent(30.0)  # a copy that timed out waiting in the canary's queue
    started = time.monotonic()
    assert traffic._unbusy_at - started <= CHARGE_CAP_S / BUSY_TIME_SHARE + 0.01


async def test_no_copy_is_queued_once_shadow_traffic_is_closed() -> None:
    traffic = _traffic(Drain(timeout_s=5))
    await traffic.close()
    traffic._held = 10  # a copy taken before the close, offered after it
    rollout = parse_rollout({"canary": "m@2.0.0", "steps": [0, 100], "shadow": 0.5}, "m@1.0.0")
    ctx = RequestContext(request_id="r", route="m", parameters={}, headers={}, content_type="")
    copy = ShadowCopy("m", rollout, {}, ctx, 10)
    traffic.offer(copy, {"y": np.zeros(4)})
    assert traffic._held == 0 and traffic._queue.empty() and not traffic._runners


class Kept:
    """The stable runner's live sequences, as ``Sequences.holds`` answers and ``watch``
    tells."""

    def __init__(self, max_sequences: int = 1024) -> None:
        self.section = SequenceSection(max_sequences=max_sequences)
        self.ids: set[object] = set()
        self.watchers: list[Callable[[Any], None]] = []

    @property
    def live(self) -> int:
        return len(self.ids)

    def holds(self, sequence_id: object) -> bool:
        return sequence_id in self.ids

    def watch(self, ended: Callable[[Any], None]) -> None:
        if ended not in self.watchers:
            self.watchers.append(ended)

    def end(self, sequence_id: object) -> None:
        """The sequence ends (its end, its expiry): the watchers hear of it."""
        self.ids.discard(sequence_id)
        for ended in self.watchers:
            ended(sequence_id)


ROLLOUT = parse_rollout({"canary": "m@2.0.0", "steps": [0, 100], "shadow": 0.5}, "m@1.0.0")


class Stable:
    """Requests of sequences on the stable version of ``m``, copied as the data plane
    copies them; the runner's sequences (:class:`Kept`) follow those answered."""

    def __init__(self, traffic: ShadowTraffic, kept: Kept) -> None:
        self.traffic = traffic
        self.kept = kept
        runner = SimpleNamespace(live_sequences=lambda: kept)
        self.chain: Any = SimpleNamespace(variant="m@1.0.0", runner=runner)

    def __call__(self, sequence_id: str, answered: bool = True, **parameters: bool) -> bool:
        """Whether the request is copied; ``answered``: the runner answered it (else it
        refused it before it ran, and the copy is released)."""
        ctx = RequestContext("r", "m", {"sequence_id": sequence_id, **parameters}, {}, "")
        copy = self.traffic.copy("m", self.chain, {"x": np.ones((1, 4))}, ctx)
        if answered and parameters.get("sequence_start"):
            self.kept.ids.add(sequence_id)
        if answered and parameters.get("sequence_end"):
            self.kept.end(sequence_id)
        if copy is not None and answered:
            self.traffic.offer(copy, {"y": np.ones(4)})
        elif copy is not None:
            self.traffic.release(copy)
        return copy is not None


def _shadowing(traffic: ShadowTraffic, share: float = 0.5) -> None:
    rollout = dataclasses.replace(ROLLOUT, shadow=share)
    traffic._shadowing = {"m": (rollout, "m@1.0.0")}


async def test_a_sequence_is_copied_whole_or_not_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawn at its start, kept to its end: a sequence running before shadowing began is
    never copied, and once one of its copies is skipped, none after it is (each counted
    skipped)."""
    traffic = _traffic(Drain(timeout_s=5))
    _shadowing(traffic)
    stable = Stable(traffic, Kept())
    draws = iter([0.9, 0.1, 0.1, 0.1])  # one a start: "a" is not drawn, the others are

    def whole(sequence_id: str) -> list[bool]:
        return [stable(sequence_id, sequence_start=True), stable(sequence_id),
                stable(sequence_id, sequence_end=True)]  # fmt: skip

    monkeypatch.setattr(f"{shadow.__name__}.random.random", lambda: next(draws))
    assert not stable("running before", sequence_end=True)
    assert whole("a") == [False, False, False]
    assert whole("b") == [True, True, True]
    assert not stable("b") and traffic.copied_sequences == 0  # ended: nothing kept
    assert stable("c", sequence_start=True)
    held, traffic._held = traffic._held, QUEUE_BYTES  # no room: the next copy is skipped
    assert not stable("c")
    traffic._held = held
    assert not stable("c") and not stable("c", sequence_end=True)
    skipped = traffic.windows.window("m", ROLLOUT.key).shadow.skipped
    assert skipped == 3 and traffic.copied_sequences == 0
    assert stable("d", sequence_start=True) and traffic.copied_sequences == 1
    stable.kept.end("d")  # "d" expired on the stable version
    assert traffic.copied_sequences == 0 and not stable("d")
    await traffic.close()


async def test_starts_the_stable_runner_refuses_leave_no_copied_sequence() -> None:
    """A start refused before its runner took it (two rows, its ``max_sequences``, a
    stage's 400) starts nothing: its sequence is not kept as copied, however many come."""
    traffic = _traffic(Drain(timeout_s=5))
    _shadowing(traffic, share=1.0)
    stable = Stable(traffic, Kept())
    for i in range(10_000):
        assert stable(f"s{i}", answered=False, sequence_start=True)
    assert traffic.copied_sequences == 0 and traffic._held == 0
    assert stable("s1", sequence_start=True) and traffic.copied_sequences == 1
    # Started again and refused: "s1" goes on as it was, its copies' sequence ended.
    assert stable("s1", answered=False, sequence_start=True)
    assert traffic.copied_sequences == 0 and not stable("s1")
    await traffic.close()


async def test_a_route_copies_no_more_sequences_than_its_stable_runner_runs() -> None:
    """At most the stable runner's ``max_sequences`` at once, starts in flight included;
    one more start is skipped, unless a copied sequence no longer runs there."""
    traffic = _traffic(Drain(timeout_s=5))
    _shadowing(traffic, share=1.0)
    kept = Kept(max_sequences=8)
    stable = Stable(traffic, kept)
    for i in range(20):  # starts not answered yet: each a copy taken
        ctx = RequestContext("r", "m", {"sequence_id": f"p{i}", "sequence_start": True}, {}, "")
        traffic.copy("m", stable.chain, {"x": np.ones(4)}, ctx)
    assert traffic.copied_sequences == 8
    assert traffic.windows.window("m", ROLLOUT.key).shadow.skipped == 12
    traffic = _traffic(Drain(timeout_s=5))
    _shadowing(traffic, share=1.0)
    stable = Stable(traffic, kept)
    assert all(stable(f"s{i}", sequence_start=True) for i in range(8))
    assert not stable("one more", sequence_start=True) and traffic.copied_sequences == 8
    kept.ids.clear()  # gone from the runner without a word
    assert stable("one more", sequence_start=True) and traffic.copied_sequences == 1
    await traffic.close()


class Canary:
    """The canary of ``m``: a chain whose runner keeps real :class:`Sequences`, on the
    route table shadow traffic reads; ``refuse`` makes its next run raise, ``skew_s``
    moves its runner's clock on."""

    def __init__(self, idle_timeout_s: float = 30.0, max_sequences: int = 64) -> None:
        section = SequenceSection(idle_timeout_s=idle_timeout_s, max_sequences=max_sequences)
        self.skew_s = 0.0
        self.sequences = Sequences(section, "m@2.0.0", clock=lambda: time.monotonic() + self.skew_s)
        self.refuse: Exception | None = None
        manifest = SimpleNamespace(name="m", runner=None)
        runner = SimpleNamespace(manifest=manifest, version="2.0.0", enter=lambda: None,
                                 leave=lambda: None, live_sequences=lambda: self.sequences)  # fmt: skip
        chain = Chain("m", (), runner, ())  # type: ignore[arg-type]
        object.__setattr__(chain, "run", self.run)
        spec = SimpleNamespace(rollout=ROLLOUT)
        self.table: Any = SimpleNamespace(
            entries={"m": SimpleNamespace(spec=spec, by_version={"2.0.0": chain})}
        )

    async def run(self, data: Any, ctx: RequestContext) -> Any:
        refuse, self.refuse = self.refuse, None
        if refuse is not None:
            raise refuse
        return await self.sequences.run(data, ctx.parameters, self._execute)

    @staticmethod
    async def _execute(inputs: Any) -> dict[str, np.ndarray]:
        return {"y": np.ones(4)}


def _canaried(canary: Canary, drain: Drain) -> tuple[ShadowTraffic, Stable, ShadowFigures]:
    traffic = ShadowTraffic(lambda: canary.table, Windows(), live=drain)
    _shadowing(traffic, share=1.0)
    return traffic, Stable(traffic, Kept()), traffic.windows.window("m", ROLLOUT.key).shadow


async def _drained(traffic: ShadowTraffic) -> None:
    """Until every copy offered has run or been skipped."""
    async with asyncio.timeout(5):
        while traffic._held:  # noqa: ASYNC110 - no event tells of it: a test's poll
            await asyncio.sleep(0.01)


async def test_copies_the_canary_would_find_expired_are_skipped_not_failed() -> None:
    """Copies are paced, live requests are not: a copy whose turn would come after the
    canary has let its sequence expire is skipped then, with the rest of its sequence,
    never run to fail there as not running; the skips leave the pacing as it was."""
    canary = Canary(idle_timeout_s=0.3)
    drain = Drain(timeout_s=5)
    traffic, stable, figures = _canaried(canary, drain)
    assert stable("s", sequence_start=True)
    await _drained(traffic)
    assert figures.agreed == 1
    drain.enter()  # live requests in flight: the next copy's turn is past the idle timeout
    paced = traffic._unbusy_at = time.monotonic() + 30
    assert stable("s") and stable("s", sequence_end=True)
    await _drained(traffic)  # within 5 s: the skips did not wait for their turn
    drain.leave()
    assert (figures.compared, figures.failed, figures.skipped) == (1, 0, 2), figures
    assert traffic._unbusy_at == paced


async def test_copies_the_canary_cannot_run_are_skipped_not_failed() -> None:
    """No room on the canary (its queue, its ``max_sequences``: 429), or a sequence it no
    longer runs (seen before the copy runs, or told by its 400): the copy is skipped, and
    its sequence's copies after it; a copied start leaves half the canary's
    ``max_sequences`` to its live clients. A copy the canary refuses otherwise (its own
    400) is its failure."""
    canary = Canary(max_sequences=4)
    traffic, stable, figures = _canaried(canary, Drain(timeout_s=5))
    canary.refuse = TooManyRequests("no room", retry_after_s=1)
    assert stable("full", sequence_start=True) and stable("full")
    await _drained(traffic)
    assert (figures.compared, figures.failed, figures.skipped) == (0, 0, 2), figures
    assert stable("a", sequence_start=True) and stable("b", sequence_start=True)
    assert stable("c", sequence_start=True)  # the canary runs 2 of its 4: no room for "c"
    await _drained(traffic)
    assert (figures.agreed, figures.skipped) == (2, 3), figures
    canary.skew_s = 60.0  # "a" and "b" expire on the canary, not swept yet
    assert stable("b")  # run: the canary's 400 (not running) tells of it
    await _drained(traffic)
    canary.sequences.sweep()  # "a" is gone before its copy runs
    assert stable("a") and stable("a")
    await _drained(traffic)
    assert (figures.compared, figures.failed, figures.skipped) == (2, 0, 6), figures
    assert stable("d", sequence_start=True) and stable("d")
    await _drained(traffic)
    canary.refuse = InvalidInput("the canary's own 400")
    assert stable("d")
    await _drained(traffic)
    assert (figures.compared, figures.failed, figures.skipped) == (5, 1, 6), figures
    paced = traffic._unbusy_at = time.monotonic() + 30
    moved = dataclasses.replace(ROLLOUT.status, window=ROLLOUT.status.window + 1)
    canary.table.entries["m"].spec.rollout = dataclasses.replace(ROLLOUT, status=moved)
    assert stable("e", sequence_start=True)  # its window moved on meanwhile: not run
    await _drained(traffic)
    assert traffic._unbusy_at == paced  # a copy not run leaves the pacing as it was
    await traffic.close()
