"""A rollout's gates: from a window's figures, whether its canary holds, moves on, or
goes back.

Every comparison is between the two versions over the same window, and only once each
has ``min_requests`` counted requests in it (``figures.py`` says what counts: never a
4xx). A breach (error rate, p50 or p99 against the stable version's, or, with shadow
traffic, too few agreeing answers once ``min_requests`` copies were compared) rolls
back at once; a step passes once the window has lasted ``min_seconds`` with the
versions compared (and, with shadow traffic, as many compared copies) and no breach.
At 100 % the stable version takes no traffic: passing the last step below 100 %
promotes the canary.

One client never decides: each side's figures leave out the cohort (``COHORTS``) with
the most requests and the cohort that weighs most on the figure judged (the most
errors; the most latencies above the quantile), which is where all of one sticky key's
requests are. A latency quantile is judged once both sides have :data:`TAIL` successful
requests beyond it (p50: 20, p99: 1,000), and breaches only when the canary's lower
99 % confidence bound on it is above the stable version's upper bound times
``max_latency_ratio``, and by more than ``latency_floor_ms``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plugserve.registry.routing.figures import Tally, VariantFigures, WindowFigures
from plugserve.registry.routing.rollout import Rollout

Z_99 = 2.326
"""The one-sided 99 % point of the normal distribution."""
TAIL = 10
"""Successful requests beyond a quantile each side needs before it is judged."""
SHOWN_OUTPUTS = 5
"""Outputs a shadow breach's reason names, those that differ most first."""
QUANTILES = (("p50", 0.5), ("p99", 0.99))


@dataclass(frozen=True)
class Decision:
    decision: str
    """``advance``, ``promote`` or ``roll_back``."""
    reason: str
    figures: dict[str, Any]


def summary(rollout: Rollout, figures: WindowFigures) -> dict[str, Any]:
    """The window's figures as a decision records them (every cohort's)."""
    out = {
        "canary": figures.variants.get(str(rollout.canary), VariantFigures()).summary(),
        "stable": figures.variants.get(str(rollout.stable), VariantFigures()).summary(),
    }
    if rollout.shadow > 0:
        out["shadow"] = figures.shadow.summary()
    return out


def decide(rollout: Rollout, figures: WindowFigures, now: float) -> Decision | None:
    """What the window's figures say for a running rollout; ``None``: hold."""
    shown = summary(rollout, figures)
    weight = rollout.weight
    if weight == 100:  # a status set there by hand: the steps below it passed
        return Decision("promote", f"at 100 %: {rollout.canary} is the stable version", shown)
    canary = figures.variants.get(str(rollout.canary), VariantFigures())
    stable = figures.variants.get(str(rollout.stable), VariantFigures())
    enough = rollout.min_requests
    compared = weight == 0
    breach = None
    if weight > 0:
        ours, theirs = trimmed(canary, _errors), trimmed(stable, _errors)
        compared = ours.requests >= enough and theirs.requests >= enough
        if compared:
            breach = _error_breach(rollout, ours, theirs) or _latency_breach(
                rollout, canary, stable
            )
    shadow = figures.shadow
    if breach is None and rollout.shadow > 0 and shadow.compared >= enough:
        breach = _shadow_breach(rollout, figures)
    if breach is not None:
        return Decision("roll_back", breach, shown)
    if rollout.shadow > 0:
        compared = compared and shadow.compared >= enough
    if not compared or now - rollout.status.since < rollout.min_seconds:
        return None
    if rollout.last_step:
        reason = f"every step passed: {rollout.canary} is the stable version"
        return Decision("promote", reason, shown)
    nxt = rollout.steps[rollout.status.step + 1]
    done = rollout.status.step + 1
    reason = f"step {done} of {len(rollout.steps)} passed at {weight}%: to {nxt}%"
    return Decision("advance", reason, shown)


def tail_samples(q: float) -> int:
    """Successful requests a side needs before its ``q`` quantile is judged: :data:`TAIL`
    beyond it (20 for p50, 1,000 for p99), so a few slow requests never read as a slow
    version."""
    return math.ceil(TAIL / (1 - q) - 1e-9)


def trimmed(figures: VariantFigures, weighs: Callable[[Tally], float]) -> Tally:
    """``figures`` less two cohorts: the one with the most requests, and the one that
    weighs most by ``weighs`` (one cohort when both are the same)."""
    cohorts = sorted(figures.cohorts.items())
    if not cohorts:
        return Tally()
    heaviest = max(cohorts, key=lambda item: item[1].requests)[0]
    worst = max(cohorts, key=lambda item: (weighs(item[1]), item[1].requests))[0]
    out = Tally()
    for index, tally in cohorts:
        if index not in (heaviest, worst):
            out.add(tally)
    return out


def _shadow_breach(rollout: Rollout, figures: WindowFigures) -> str | None:
    shadow = figures.shadow
    agreement = shadow.agreement or 0.0
    if agreement >= rollout.min_agreement:
        return None
    worst = sorted(shadow.largest.items(), key=lambda item: (-item[1], item[0]))
    largest = ", ".join(
        f"{name[:64]} {'shape, type or NaN' if diff == float('inf') else f'{diff:.3g}'}"
        for name, diff in worst[:SHOWN_OUTPUTS]
    ) + (f" and {len(worst) - SHOWN_OUTPUTS} more" if len(worst) > SHOWN_OUTPUTS else "")
    return (
        f"shadow traffic: {shadow.agreed} of {shadow.compared} answers agreed "
        f"({agreement:.1%}, at least {rollout.min_agreement:.1%} needed; "
        f"{shadow.failed} failed); largest difference: {largest or 'none'}"
    )


def _errors(tally: Tally) -> float:
    return tally.errors


def _more_errors(canary: Tally, stable: Tally, margin: float) -> bool:
    """Whether the canary's error rate is above the stable version's by more than
    ``margin``, and by more than chance would make it: a one-sided two-proportion z-test
    at 99 % (a few dozen canary requests vary by far more than a 1 % margin)."""
    excess = canary.error_rate - stable.error_rate - margin
    if excess <= 0:
        return False
    n, m = canary.requests, stable.requests
    pooled = (canary.errors + stable.errors) / (n + m)
    spread = math.sqrt(pooled * (1 - pooled) * (1 / n + 1 / m))
    return excess > Z_99 * spread


def _error_breach(rollout: Rollout, canary: Tally, stable: Tally) -> str | None:
    if not _more_errors(canary, stable, rollout.max_error_rate):
        return None
    return (
        f"error rate {canary.error_rate:.2%} ({canary.errors} of {canary.requests}) against "
        f"the stable version's {stable.error_rate:.2%} ({stable.errors} of {stable.requests}): "
        f"more than {rollout.max_error_rate:.2%} above"
    )


def _latency_breach(
    rollout: Rollout, canary_figures: VariantFigures, stable_figures: VariantFigures
) -> str | None:
    for name, q in QUANTILES:
        canary = _trimmed_at(canary_figures, q)
        stable = _trimmed_at(stable_figures, q)
        judged = tail_samples(q)
        if canary.samples < judged or stable.samples < judged:
            continue
        low = canary.at_rank(_rank(canary.samples, q, -1))
        high = stable.at_rank(_rank(stable.samples, q, +1))
        ours, theirs = canary.quantile(q), stable.quantile(q)
        if low is None or high is None or ours is None or theirs is None:
            continue
        low_ms, high_ms = low * 1000, high * 1000
        if (
            low_ms > high_ms * rollout.max_latency_ratio
            and low_ms - high_ms > rollout.latency_floor_ms
        ):
            return (
                f"{name} latency {ours * 1000:.3g} ms against the stable version's "
                f"{theirs * 1000:.3g} ms (at least {low_ms:.3g} against at most {high_ms:.3g} "
                f"at 99 % confidence): more than {rollout.max_latency_ratio:g}x"
            )
    return None


def _trimmed_at(figures: VariantFigures, q: float) -> Tally:
    """``figures`` less its heaviest cohort and the one with the most latencies above
    their ``q`` quantile."""
    edge = figures.total().quantile(q)
    if edge is None:
        return Tally()
    return trimmed(figures, lambda tally: tally.above(edge))


def _rank(samples: int, q: float, side: int) -> int:
    """The rank of the lower (``side`` -1) or upper (+1) one-sided 99 % confidence bound
    on the ``q`` quantile of ``samples`` latencies (the binomial's normal approximation)."""
    spread = Z_99 * math.sqrt(samples * q * (1 - q))
    if side < 0:
        return max(1, math.floor(samples * q - spread))
    return min(samples, math.ceil(samples * q + spread) + 1)
