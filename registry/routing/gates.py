"""A rollout's gates: from a window's figures, whether its canary holds, moves on, or
goes back.

A breach (error rate, p50 or p99 against the stable version's over the same window,
or, with shadow traffic, too few agreeing answers) rolls back as soon as the canary has
``min_requests`` in the window (compared copies for the shadow gate), so a breach is
found within the step's window. A latency quantile is judged only once both sides have
five requests beyond it (p50: 10, p99: 500; :func:`tail_samples`): below that it is one
request's latency, not the version's. A step passes once the window has lasted ``min_seconds``
with ``min_requests`` canary requests (and, while the stable version takes traffic and
shadow traffic is on, as many compared copies). Where the stable version took fewer
than ``min_requests`` in the window (the canary at 100 %), the canary is held to the
stable version's figures of the last window that had them (``Status.baseline``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from plugserve.registry.routing.figures import VariantFigures, WindowFigures
from plugserve.registry.routing.rollout import Rollout

Z_99 = 2.326
"""The one-sided 99 % point of the normal distribution."""
SHOWN_OUTPUTS = 5
"""Outputs a shadow breach's reason names, those that differ most first."""


@dataclass(frozen=True)
class Decision:
    decision: str
    """``advance``, ``promote`` or ``roll_back``."""
    reason: str
    figures: dict[str, Any]
    baseline: dict[str, Any] | None = None
    """The stable version's figures of this window, when it had enough requests."""


def summary(rollout: Rollout, figures: WindowFigures) -> dict[str, Any]:
    """The window's figures as a decision records them."""
    out = {
        "canary": figures.variants.get(str(rollout.canary), VariantFigures()).summary(),
        "stable": figures.variants.get(str(rollout.stable), VariantFigures()).summary(),
    }
    if rollout.shadow > 0:
        out["shadow"] = figures.shadow.summary()
    return out


def decide(rollout: Rollout, figures: WindowFigures, now: float) -> Decision | None:
    """What the window's figures say for a running rollout; ``None``: hold."""
    canary = figures.variants.get(str(rollout.canary), VariantFigures())
    stable = figures.variants.get(str(rollout.stable), VariantFigures())
    enough = rollout.min_requests
    reference = _reference(rollout, stable)
    shown = summary(rollout, figures)
    breach = _breach(rollout, canary, reference) if canary.requests >= enough else None
    shadow = figures.shadow
    if breach is None and rollout.shadow > 0 and shadow.compared >= enough:
        agreement = shadow.agreement or 0.0
        if agreement < rollout.min_agreement:
            worst = sorted(shadow.largest.items(), key=lambda item: (-item[1], item[0]))
            largest = ", ".join(
                f"{name[:64]} {'shape, type or NaN' if diff == float('inf') else f'{diff:.3g}'}"
                for name, diff in worst[:SHOWN_OUTPUTS]
            ) + (f" and {len(worst) - SHOWN_OUTPUTS} more" if len(worst) > SHOWN_OUTPUTS else "")
            breach = (
                f"shadow traffic: {shadow.agreed} of {shadow.compared} answers agreed "
                f"({agreement:.1%}, at least {rollout.min_agreement:.1%} needed; "
                f"{shadow.failed} failed); largest difference: {largest or 'none'}"
            )
    if breach is not None:
        return Decision("roll_back", breach, shown)
    weight = rollout.weight
    passed = canary.requests >= enough or weight == 0
    if rollout.shadow > 0 and weight < 100:
        passed = passed and shadow.compared >= enough
    if not passed or now - rollout.status.since < rollout.min_seconds:
        return None
    baseline = stable.summary() if stable.requests >= enough else None
    last = rollout.status.step == len(rollout.steps) - 1
    what = "promote" if last else "advance"
    if last:
        reason = f"every step passed: {rollout.canary} is the stable version"
    else:
        nxt = rollout.steps[rollout.status.step + 1]
        done = rollout.status.step + 1
        reason = f"step {done} of {len(rollout.steps)} passed at {weight}%: to {nxt}%"
    return Decision(what, reason, shown, baseline)


def tail_samples(q: float) -> int:
    """Requests a side needs before its ``q`` quantile is judged: five beyond it (10 for
    p50, 500 for p99), so one slow request never reads as a slow version."""
    return math.ceil(5 / (1 - q) - 1e-9)


def _reference(rollout: Rollout, stable: VariantFigures) -> dict[str, Any] | None:
    """The stable version's error rate and latency (ms) the canary is held to."""
    if stable.requests >= rollout.min_requests:
        return stable.summary()
    return rollout.status.baseline


def _more_errors(
    canary: VariantFigures, stable_rate: float, stable_requests: float, margin: float
) -> bool:
    """Whether the canary's error rate is above the stable version's by more than
    ``margin``, and by more than chance would make it: a one-sided two-proportion z-test
    at 99 % (a few dozen canary requests vary by far more than a 1 % margin)."""
    excess = canary.error_rate - stable_rate - margin
    if excess <= 0:
        return False
    n = canary.requests
    pooled = (canary.errors + stable_rate * stable_requests) / (n + stable_requests)
    spread = math.sqrt(pooled * (1 - pooled) * (1 / n + 1 / stable_requests))
    return excess > Z_99 * spread


def _breach(
    rollout: Rollout, canary: VariantFigures, reference: dict[str, Any] | None
) -> str | None:
    stable_rate = float(reference.get("error_rate", 0.0)) if reference else 0.0
    # Without the stable version's count (none this window, no baseline), as many as the
    # canary's: the test then asks as much of the canary as of an equal sample.
    stable_requests = float((reference or {}).get("requests") or canary.requests)
    if _more_errors(canary, stable_rate, stable_requests, rollout.max_error_rate):
        return (
            f"error rate {canary.error_rate:.2%} ({canary.errors} of {canary.requests}) against "
            f"the stable version's {stable_rate:.2%}: more than {rollout.max_error_rate:.2%} above"
        )
    if reference is None:
        return None
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        theirs = reference.get(f"{name}_ms")
        ours = canary.quantile(q)
        judged = tail_samples(q)
        if theirs is None or ours is None or canary.requests < judged:
            continue
        if reference.get("requests", judged) < judged:
            continue
        ours_ms = ours * 1000
        slower = ours_ms > theirs * rollout.max_latency_ratio
        if slower and ours_ms - theirs > rollout.latency_floor_ms:
            return (
                f"{name} latency {ours_ms:.3g} ms against the stable version's {theirs:.3g} ms: "
                f"more than {rollout.max_latency_ratio:g}x"
            )
    return None
