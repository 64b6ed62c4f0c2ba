"""How two answers are compared: within tolerance per output, and anything else different
(shape, type, a missing output) as different as can be; when copies may run beside the
live requests of the process."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from plugserve.registry.routing.figures import Windows
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

    def __init__(self) -> None:
        self.ids: set[object] = set()
        self.watchers: list[Callable[[Any], None]] = []

    def holds(self, sequence_id: object) -> bool:
        return sequence_id in self.ids

    def watch(self, ended: Callable[[Any], None]) -> None:
        if ended not in self.watchers:
            self.watchers.append(ended)


async def test_a_sequence_is_copied_whole_or_not_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawn at its start, kept to its end: a sequence running before shadowing began is
    never copied, and once one of its copies is skipped, none after it is."""
    traffic = _traffic(Drain(timeout_s=5))
    rollout = parse_rollout({"canary": "m@2.0.0", "steps": [0, 100], "shadow": 0.5}, "m@1.0.0")
    traffic._shadowing = {"m": (rollout, "m@1.0.0")}
    kept = Kept()
    chain = SimpleNamespace(variant="m@1.0.0", runner=SimpleNamespace(live_sequences=lambda: kept))
    draws = iter([0.9, 0.1, 0.1, 0.1])  # one a start: "a" is not drawn, the others are
    monkeypatch.setattr(f"{shadow.__name__}.random.random", lambda: next(draws))

    def copied(sequence_id: str, **parameters: bool) -> bool:
        ctx = RequestContext("r", "m", {"sequence_id": sequence_id, **parameters}, {}, "")
        # A stand-in chain: the variant and the runner's sequences are what copy() reads.
        copy = traffic.copy("m", chain, {"x": np.ones(4)}, ctx)  # type: ignore[arg-type]
        if copy is not None:
            traffic.release(copy)
        return copy is not None

    def whole(sequence_id: str) -> list[bool]:
        return [copied(sequence_id, sequence_start=True), copied(sequence_id),
                copied(sequence_id, sequence_end=True)]  # fmt: skip

    assert not copied("running before", sequence_end=True)
    assert whole("a") == [False, False, False]
    assert whole("b") == [True, True, True]
    assert not copied("b") and traffic.copied_sequences == 0  # ended: nothing kept
    assert copied("c", sequence_start=True)
    traffic._held = QUEUE_BYTES  # no room: the next copy is skipped
    assert not copied("c")
    traffic._held = 0
    assert not copied("c") and not copied("c", sequence_end=True)
    assert copied("d", sequence_start=True) and traffic.copied_sequences == 1
    for ended in kept.watchers:  # "d" expired on the stable version
        ended("d")
    assert traffic.copied_sequences == 0 and not copied("d")
