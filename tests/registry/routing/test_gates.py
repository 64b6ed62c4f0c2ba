"""The gates on made-up windows: each breach found once both versions have enough
requests in the same window, a step passed only with enough requests and time, client
errors never counted, one sticky key never deciding, and latency judged only on enough
samples with a margin beyond chance."""

from __future__ import annotations

from typing import Any

import pytest

from plugserve.registry.routing.figures import COHORTS, WindowFigures
from plugserve.registry.routing.gates import decide, tail_samples
from plugserve.registry.routing.route_specs import parse_route

STABLE, CANARY = "m@1.0.0", "m@2.0.0"


def rollout(**policy: Any) -> Any:
    base = {"canary": CANARY, "steps": [10, 50, 100], "min_requests": 100, "min_seconds": 10}
    entry = {"runner": STABLE, "rollout": {**base, **policy}}
    made = parse_route("m", entry, "admin").rollout
    assert made is not None
    return made


def window(stable: tuple[int, int, float], canary: tuple[int, int, float]) -> WindowFigures:
    """(requests, of them failing with a 500, seconds each) for each side, each request from
    a client of its own."""
    figures = WindowFigures()
    for label, (requests, errors, seconds) in ((STABLE, stable), (CANARY, canary)):
        for i in range(requests):
            figures.variant(label).record(500 if i < errors else 200, seconds, f"u{i}".encode())
    return figures


def test_a_step_passes_with_enough_requests_of_both_versions_and_time_only() -> None:
    r = rollout()
    since = r.status.since
    good = window((900, 0, 0.010), (130, 0, 0.010))
    assert decide(r, good, since + 5) is None  # too early
    assert decide(r, window((900, 0, 0.01), (60, 0, 0.01)), since + 11) is None  # too few
    # A stable version with too few requests to compare with: no step (it is not ready, say).
    assert decide(r, window((60, 0, 0.01), (900, 0, 0.01)), since + 11) is None
    decision = decide(r, good, since + 11)
    assert decision is not None and decision.decision == "advance"


def test_the_last_step_below_100_percent_promotes() -> None:
    """At 100 % the stable version takes no traffic: nothing is left to compare with."""
    r = rollout()
    at_50 = r.decided("advance", "", None, "t")
    assert at_50.weight == 50 and at_50.last_step
    decision = decide(at_50, window((500, 0, 0.01), (500, 0, 0.01)), at_50.status.since + 11)
    assert decision is not None and decision.decision == "promote"
    promoted = at_50.decided(decision.decision, decision.reason, None, "t")
    assert promoted.status.state == "promoted" and promoted.weight == 100
    # A window at 100 % holding only the canary's requests never rolls it back.
    at_100 = at_50.decided("advance", "", None, "t")
    slow_alone = window((0, 0, 0.0), (2000, 0, 0.030))
    assert decide(at_100, slow_alone, at_100.status.since).decision == "promote"  # type: ignore[union-attr]


def test_errors_roll_back_at_once_past_min_requests_whatever_the_time() -> None:
    r = rollout()
    bad = decide(r, window((900, 0, 0.01), (130, 13, 0.01)), r.status.since)
    assert bad is not None and bad.decision == "roll_back" and "error rate" in bad.reason
    # The stable version failing as much is no reason to blame the canary.
    assert decide(r, window((900, 90, 0.01), (130, 13, 0.01)), r.status.since) is None


def test_an_error_excess_within_chance_is_no_breach() -> None:
    r = rollout(min_requests=50)
    noisy = window((300, 40, 0.01), (70, 13, 0.01))
    assert decide(r, noisy, r.status.since) is None
    worse = window((300, 40, 0.01), (130, 50, 0.01))
    decision = decide(r, worse, r.status.since)
    assert decision is not None and decision.decision == "roll_back"


def test_client_errors_count_against_neither_version() -> None:
    """4xx are the request's fault: a client sending bad input to the canary does not roll
    it back, nor does bad input sent to the stable version pass a failing canary."""
    r = rollout()
    good = window((900, 0, 0.01), (130, 0, 0.01))
    for _ in range(5000):
        good.variant(CANARY).record(400, 0.001, b"attacker")
    assert decide(r, good, r.status.since) is None
    assert good.variants[CANARY].summary()["refused"] == 5000
    failing = window((900, 0, 0.01), (150, 30, 0.01))  # the canary fails 20 %
    for _ in range(5000):
        failing.variant(STABLE).record(400, 0.001, b"mirror")
    decision = decide(r, failing, r.status.since)
    assert decision is not None and decision.decision == "roll_back", decision


def test_one_sticky_key_never_decides_a_window() -> None:
    r = rollout()
    since = r.status.since
    # Its server faults on the canary (inputs that make any version fail, say).
    faults = window((900, 0, 0.01), (150, 0, 0.01))
    for _ in range(100):
        faults.variant(CANARY).record(500, 0.01, b"attacker")
    assert decide(r, faults, since) is None
    # Its slow requests on the canary.
    slow = window((2000, 0, 0.01), (1500, 0, 0.01))
    for _ in range(1000):
        slow.variant(CANARY).record(200, 0.5, b"attacker")
    assert decide(r, slow, since) is None
    # Its fast requests on the canary, hiding a canary failing 20 %, or on the stable
    # version, making a good canary look slow.
    diluted = window((900, 0, 0.01), (150, 30, 0.01))
    for _ in range(20_000):
        diluted.variant(CANARY).record(200, 0.001, b"attacker")
    decision = decide(r, diluted, since)
    assert decision is not None and decision.decision == "roll_back", decision
    fast_stable = window((2000, 0, 0.02), (2000, 0, 0.02))
    for _ in range(20_000):
        fast_stable.variant(STABLE).record(200, 0.0001, b"mirror")
    assert decide(r, fast_stable, since) is None
    # Nor does it pass a step alone: its requests are left out of the count.
    one_key = window((900, 0, 0.01), (0, 0, 0.01))
    for _ in range(1000):
        one_key.variant(CANARY).record(200, 0.01, b"attacker")
    assert decide(r, one_key, since + 11) is None


def test_latency_breaches_need_enough_samples_and_a_margin_beyond_chance() -> None:
    r = rollout()
    slow = decide(r, window((900, 0, 0.010), (130, 0, 0.030)), r.status.since)
    assert slow is not None and "p50 latency" in slow.reason, slow
    # Under the floor: a canary 3x slower by a fraction of a millisecond holds.
    fast = window((900, 0, 0.0001), (130, 0, 0.0003))
    assert decide(r, fast, r.status.since) is None
    # p99 needs 1,000 successful requests a side: 550 with a slow tail are not judged.
    tail = window((2000, 0, 0.010), (550, 0, 0.010))
    for i in range(550):
        tail.variant(CANARY).record(200, 0.5 if i < 8 else 0.010, f"t{i}".encode())
    assert decide(r, tail, r.status.since) is None
    assert tail_samples(0.5) == 20 and tail_samples(0.99) == 1000
    # With enough, a slow tail across clients is a breach.
    for i in range(2000):
        tail.variant(CANARY).record(200, 0.2 if i % 20 == 0 else 0.010, f"s{i}".encode())
    decision = decide(r, tail, r.status.since)
    assert decision is not None and "p99 latency" in decision.reason, decision


def test_a_quantile_apart_by_chance_is_no_breach() -> None:
    """1,000 requests a side, 10 and 15 of them slow: the p99 falls among the slow ones on
    one side only (60 ms against 4 ms), which five requests more make by chance; the
    confidence bounds see it, the quantiles alone would not."""
    r = rollout()
    figures = WindowFigures()
    for label, slow in ((STABLE, 10), (CANARY, 15)):
        for i in range(1000):
            seconds = 0.060 if i < slow else 0.004
            figures.variant(label).record(200, seconds, f"{label}{i}".encode())
    assert figures.variants[CANARY].quantile(0.99) == pytest.approx(0.060, rel=0.1)
    assert figures.variants[STABLE].quantile(0.99) == pytest.approx(0.004, rel=0.1)
    assert decide(r, figures, r.status.since) is None


def test_requests_without_a_key_spread_over_every_cohort() -> None:
    figures = WindowFigures()
    for _ in range(10 * COHORTS):
        figures.variant(CANARY).record(200, 0.01)
    assert len(figures.variants[CANARY].cohorts) == COHORTS


def test_shadow_disagreement_rolls_back_and_shadow_copies_gate_the_step() -> None:
    r = rollout(shadow=0.1, steps=[0, 50], min_requests=50)
    figures = window((500, 0, 0.01), (0, 0, 0.0))
    for _ in range(49):
        figures.shadow.record(True, {"y": 0.0})
    assert decide(r, figures, r.status.since + 11) is None  # 49 compared: not yet
    figures.shadow.record(True, {"y": 1e-7})
    decision = decide(r, figures, r.status.since + 11)
    assert decision is not None and decision.decision == "advance"
    figures.shadow.record(False, {"y": float("inf")})
    figures.shadow.record(False, {}, failed=True)
    decision = decide(r, figures, r.status.since)
    assert decision is not None and decision.decision == "roll_back"
    assert (
        "50 of 52 answers agreed" in decision.reason and "y shape, type or NaN" in decision.reason
    )
