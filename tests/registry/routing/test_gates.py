"""The gates on made-up windows: each breach found once there are enough requests, a step
passed only with enough requests and time, the baseline standing in for a stable version
that takes no traffic."""

from __future__ import annotations

from typing import Any

from plugserve.registry.routing.figures import WindowFigures
from plugserve.registry.routing.gates import decide, tail_samples
from plugserve.registry.routing.routes import parse_route

STABLE, CANARY = "m@1.0.0", "m@2.0.0"


def rollout(**policy: Any) -> Any:
    base = {"canary": CANARY, "steps": [10, 50, 100], "min_requests": 100, "min_seconds": 10}
    entry = {"runner": STABLE, "rollout": {**base, **policy}}
    made = parse_route("m", entry, "admin").rollout
    assert made is not None
    return made


def window(stable: tuple[int, int, float], canary: tuple[int, int, float]) -> WindowFigures:
    """(requests, errors, seconds each) for each side."""
    figures = WindowFigures()
    for label, (requests, errors, seconds) in ((STABLE, stable), (CANARY, canary)):
        for i in range(requests):
            figures.variant(label).record(i < errors, seconds)
    return figures


def test_a_step_passes_with_enough_requests_and_time_only() -> None:
    r = rollout()
    since = r.status.since
    good = window((900, 0, 0.010), (100, 0, 0.010))
    assert decide(r, good, since + 5) is None  # too early
    assert decide(r, window((900, 0, 0.01), (99, 0, 0.01)), since + 11) is None  # too few
    decision = decide(r, good, since + 11)
    assert decision is not None and decision.decision == "advance"
    assert decision.baseline is not None and decision.baseline["requests"] == 900
    last = r.decided("advance", "", None, "t").decided("advance", "", None, "t")
    assert decide(last, good, last.status.since + 11).decision == "promote"  # type: ignore[union-attr]


def test_errors_roll_back_at_once_past_min_requests_whatever_the_time() -> None:
    r = rollout()
    bad = decide(r, window((900, 0, 0.01), (100, 5, 0.01)), r.status.since)
    assert bad is not None and bad.decision == "roll_back" and "error rate 5.00%" in bad.reason
    # The stable version failing as much is no reason to blame the canary.
    assert decide(r, window((900, 45, 0.01), (100, 5, 0.01)), r.status.since) is None


def test_an_error_excess_within_chance_is_no_breach() -> None:
    """Clients sending bad input to both: 7 of 34 against 13 % of 300 is chance."""
    r = rollout(min_requests=30)
    noisy = window((300, 40, 0.01), (34, 7, 0.01))
    assert decide(r, noisy, r.status.since) is None
    worse = window((300, 40, 0.01), (100, 40, 0.01))
    decision = decide(r, worse, r.status.since)
    assert decision is not None and decision.decision == "roll_back"


def test_latency_breaches_are_judged_only_with_enough_samples() -> None:
    r = rollout()
    slow = decide(r, window((900, 0, 0.010), (100, 0, 0.030)), r.status.since)
    assert slow is not None and "p50 latency" in slow.reason
    # Under the floor: a canary 3x slower by a fraction of a millisecond holds.
    fast = window((900, 0, 0.0001), (100, 0, 0.0003))
    assert decide(r, fast, r.status.since) is None
    # p99 needs 500 requests a side: 100 canary requests with a slow tail are not judged.
    tail = WindowFigures()
    for _ in range(900):
        tail.variant(STABLE).record(False, 0.010)
    for i in range(100):
        tail.variant(CANARY).record(False, 0.5 if i < 3 else 0.010)
    assert decide(r, tail, r.status.since) is None
    assert tail_samples(0.5) == 10 and tail_samples(0.99) == 500


def test_the_baseline_stands_in_for_a_stable_version_without_traffic() -> None:
    r = rollout().with_baseline({"requests": 900, "error_rate": 0.0, "p50_ms": 10.0,
                                 "p99_ms": 10.0})  # fmt: skip
    at_100 = window((0, 0, 0.0), (200, 0, 0.030))
    decision = decide(r, at_100, r.status.since)
    assert decision is not None and decision.decision == "roll_back" and "10 ms" in decision.reason


def test_shadow_disagreement_rolls_back_and_shadow_copies_gate_the_step() -> None:
    r = rollout(shadow=0.1, steps=[0, 50], min_requests=20)
    figures = window((500, 0, 0.01), (0, 0, 0.0))
    for _ in range(19):
        figures.shadow.record(True, {"y": 0.0})
    assert decide(r, figures, r.status.since + 11) is None  # 19 compared: not yet
    figures.shadow.record(True, {"y": 1e-7})
    decision = decide(r, figures, r.status.since + 11)
    assert decision is not None and decision.decision == "advance"
    figures.shadow.record(False, {"y": float("inf")})
    figures.shadow.record(False, {}, failed=True)
    decision = decide(r, figures, r.status.since)
    assert decision is not None and decision.decision == "roll_back"
    assert (
        "20 of 22 answers agreed" in decision.reason and "y shape, type or NaN" in decision.reason
    )
