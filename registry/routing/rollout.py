"""A canary that moves itself: a route's rollout, its policy and where it stands.

A weighted route (``routes.py``) may carry a ``rollout``: a canary version of the
route's runner and the steps of weight it climbs (``[5, 25, 50, 100]`` percent). Each
step holds for ``min_requests`` requests of each version and ``min_seconds``, gated by
the canary's error rate and latency against the stable version's over the same window
(``gates.py``); a breach rolls the weight back to 0 at once, the last step below 100 %
passed makes the canary the stable version (at 100 % the stable version takes no
traffic: there is nothing left to compare with). With ``shadow``, a share of the stable
version's requests is also run on the canary, after the answer, and the outputs compared.

The rollout is part of the route's runtime entry, its ``status`` too, so it lives where
runtime routes live (the runtime routes file, or etcd in fleet mode) and a restart
resumes it at its step, in a new window (``restart``): a window's figures and its clock
always begin together. The route's weights follow from the status: the entry's
``runner`` table is written from it, never the other way round.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from hashlib import blake2b
from itertools import pairwise
from typing import Any, Literal

from plugserve.registry.refs import Ref

State = Literal["running", "paused", "promoted", "rolled_back", "aborted"]
STATES: tuple[State, ...] = ("running", "paused", "promoted", "rolled_back", "aborted")
ENDED: frozenset[str] = frozenset({"promoted", "rolled_back", "aborted"})
MAX_STEPS = 20
MAX_HISTORY = 32
"""Decisions kept in the status (the oldest go first)."""
MAX_TEXT = 1000
"""The longest reason kept (a longer one is cut)."""


@dataclass(frozen=True)
class Bound:
    """A policy number's default and bounds."""

    default: float
    low: float
    high: float
    integer: bool = False
    why: str | None = None
    """Why ``low`` is the least: said to whoever asks for less."""


MIN_REQUESTS = 50
MIN_SECONDS = 5.0
BOUNDS: dict[str, Bound] = {
    "min_requests": Bound(
        100, MIN_REQUESTS, 10_000_000, True,
        "fewer tell a failing version from chance only when it fails most requests",
    ),
    "min_seconds": Bound(
        30.0, MIN_SECONDS, 7 * 86400.0,
        why="a shorter step spans too few of each replica's figures, or one burst of requests",
    ),
    "max_error_rate": Bound(0.01, 0.0, 1.0),
    "max_latency_ratio": Bound(1.5, 1.1, 1000.0, why="a smaller margin is a busy CPU's noise"),
    "latency_floor_ms": Bound(5.0, 1.0, 3_600_000.0, why="a smaller one is a busy CPU's noise"),
    "shadow": Bound(0.0, 0.0, 1.0),
    "min_agreement": Bound(0.99, 0.0, 1.0),
    "atol": Bound(1e-5, 0.0, 1e30),
    "rtol": Bound(1e-4, 0.0, 1e30),
}  # fmt: skip
"""Every number of a rollout's policy: its default and the bounds a ``PUT`` is held to."""
_POLICY_KEYS = {
    "canary", "stable", "steps", "min_requests", "min_seconds", "max_error_rate",
    "max_latency_ratio", "latency_floor_ms", "shadow", "min_agreement", "atol", "rtol",
    "status",
}  # fmt: skip
_STATUS_KEYS = {"id", "state", "step", "window", "since", "reason", "history"}


class RolloutError(ValueError):
    """A rollout entry that is not valid; the message starts at the field (``.steps: ...``)."""


@dataclass(frozen=True)
class Status:
    """Where a rollout stands: written by the deciding server (and the operator's pause,
    resume or abort), read by every server that serves the route."""

    id: str
    """Names this rollout: a new ``PUT`` starts another, with figures of its own."""
    state: State = "running"
    step: int = 0
    """The index of the step whose weight the canary has."""
    window: int = 1
    """The figures window: a new one at every step, resume and restart (figures start
    again)."""
    since: float = 0.0
    """When the window began (Unix time: every replica reads the same)."""
    reason: str | None = None
    """Why it was paused or ended."""
    history: tuple[dict[str, Any], ...] = ()
    """Every decision (the last :data:`MAX_HISTORY`): when, what, why, and the figures."""

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "state": self.state,
            "step": self.step,
            "window": self.window,
            "since": self.since,
            "reason": self.reason,
            "history": list(self.history),
        }


@dataclass(frozen=True)
class Rollout:
    """A canary's rollout on one route: its policy (set by the operator) and its status."""

    canary: Ref
    stable: Ref
    steps: tuple[int, ...]
    min_requests: int = 100
    """Requests of each version a step's window needs before it compares them (at least
    :data:`MIN_REQUESTS`)."""
    min_seconds: float = 30.0
    """How long a step's window lasts at least (at least :data:`MIN_SECONDS`)."""
    max_error_rate: float = 0.01
    """A breach when the canary's error rate is above the stable version's by more."""
    max_latency_ratio: float = 1.5
    """A breach when the canary's p50 or p99 is above the stable version's times this."""
    latency_floor_ms: float = 5.0
    """Latency differences below this never breach (a busy CPU's noise on fast models)."""
    shadow: float = 0.0
    """The share of the stable version's requests also run on the canary and compared."""
    min_agreement: float = 0.99
    """A breach when fewer of the compared answers agree (once ``min_requests`` compared)."""
    atol: float = 1e-5
    rtol: float = 1e-4
    """Two numeric outputs agree when every element is within ``atol + rtol * |stable|``."""
    status: Status = field(default_factory=lambda: Status(secrets.token_hex(6)))

    @cached_property
    def key(self) -> str:
        """The figures window's key: this rollout's id and window (read on every request of
        its route: made once per rollout, which a change replaces whole)."""
        return f"{self.status.id}/{self.status.window}"

    @property
    def active(self) -> bool:
        return self.status.state not in ENDED

    @property
    def running(self) -> bool:
        return self.status.state == "running"

    @property
    def shadowing(self) -> bool:
        """Whether stable requests are copied to the canary now (not while paused)."""
        return self.shadow > 0 and self.running

    @property
    def weight(self) -> int:
        """The canary's percent of the route's traffic now."""
        state = self.status.state
        if state == "promoted":
            return 100
        if state in ENDED:
            return 0
        return self.steps[self.status.step]

    def weights(self) -> dict[str, int]:
        """The route's runner table: stable and canary by their percent."""
        canary = self.weight
        return {str(self.stable): 100 - canary, str(self.canary): canary}

    def as_json(self) -> dict[str, Any]:
        return {
            "canary": str(self.canary),
            "stable": str(self.stable),
            "steps": list(self.steps),
            "min_requests": self.min_requests,
            "min_seconds": self.min_seconds,
            "max_error_rate": self.max_error_rate,
            "max_latency_ratio": self.max_latency_ratio,
            "latency_floor_ms": self.latency_floor_ms,
            "shadow": self.shadow,
            "min_agreement": self.min_agreement,
            "atol": self.atol,
            "rtol": self.rtol,
            "status": self.status.as_json(),
        }

    # -- moves: each a new rollout, with a new window where the weights change -----------

    @property
    def last_step(self) -> bool:
        """Whether passing this step promotes the canary: it is the last, or the next is
        100 % (where the stable version takes no traffic to compare with)."""
        step = self.status.step
        return step == len(self.steps) - 1 or self.steps[step + 1] == 100

    def decided(
        self, decision: str, reason: str, figures: dict[str, Any] | None, by: str
    ) -> Rollout:
        """The rollout after ``decision`` (``advance``, ``promote``, ``roll_back``,
        ``restart``: the same step in a new window, and the operator's ``pause``,
        ``resume``, ``abort``), recorded in its history."""
        status = self.status
        now = time.time()
        reason = _clipped(reason)
        entry = {
            "at": round(now, 3),
            "decision": decision,
            "step": status.step,
            "weight": self.weight,
            "reason": reason,
            "by": by[:MAX_TEXT],
        }
        if figures is not None:
            entry["figures"] = figures
        history = (*status.history, entry)[-MAX_HISTORY:]
        step, window, since = status.step, status.window + 1, now
        state: State
        if decision == "advance":
            state, step, why = "running", step + 1, None
        elif decision == "promote":
            state, why = "promoted", reason
        elif decision in ("roll_back", "abort"):
            state, why = ("rolled_back" if decision == "roll_back" else "aborted"), reason
        elif decision == "pause":
            state, why, window, since = "paused", reason, status.window, status.since
        elif decision in ("resume", "restart"):
            state, why = "running", None
        else:
            raise ValueError(f"unknown decision {decision!r}")
        moved = replace(status, state=state, step=step, window=window, since=since, reason=why)
        return replace(self, status=replace(moved, history=history))


def parse_rollout(raw: Any, runner: Any, source: str = "admin") -> Rollout:
    """The ``rollout`` table of a route entry whose ``runner`` is ``runner`` (the stable
    version, ``name@version``, or a table of the stable and canary versions' weights).

    Raises :class:`RolloutError` naming the field.
    """
    if not isinstance(raw, dict):
        raise RolloutError(": must be a table")
    unknown = sorted(set(raw) - _POLICY_KEYS)
    if unknown:
        raise RolloutError(f": unknown key(s) {unknown}; known: {sorted(_POLICY_KEYS)}")
    canary = _pinned(raw.get("canary"), ".canary")
    stable = _stable(raw.get("stable"), runner, canary)
    if stable.name != canary.name:
        raise RolloutError(f".canary: {canary} is not a version of the runner {stable.name}")
    if stable.version == canary.version:
        raise RolloutError(".canary: is the stable version itself")
    shadow = _bounded(raw, "shadow")
    steps = _steps(raw.get("steps"), shadow > 0)
    rollout = Rollout(
        canary,
        stable,
        steps,
        min_requests=int(_bounded(raw, "min_requests")),
        min_seconds=_bounded(raw, "min_seconds"),
        max_error_rate=_bounded(raw, "max_error_rate"),
        max_latency_ratio=_bounded(raw, "max_latency_ratio"),
        latency_floor_ms=_bounded(raw, "latency_floor_ms"),
        shadow=shadow,
        min_agreement=_bounded(raw, "min_agreement"),
        atol=_bounded(raw, "atol"),
        rtol=_bounded(raw, "rtol"),
    )
    if "status" in raw:
        return replace(rollout, status=_status(raw["status"], len(steps)))
    if source != "etcd":  # a new rollout, its status written with it wherever it is stored
        return replace(rollout, status=replace(rollout.status, since=time.time()))
    # Written to etcd by hand without a status: every replica reads it alike, so its id
    # comes from what it is, and their requests count in the same window until the decider
    # writes the status.
    policy = json.dumps({"runner": runner, "rollout": raw}, sort_keys=True, default=str)
    ident = blake2b(policy.encode(), digest_size=6).hexdigest()
    return replace(rollout, status=Status(ident, since=time.time()))


def _pinned(value: Any, where: str) -> Ref:
    if not isinstance(value, str) or len(value) > 256:
        raise RolloutError(f"{where}: is required: a runner version, name@1.2.3")
    try:
        ref = Ref.parse(value)
    except ValueError as exc:
        raise RolloutError(f"{where}: {exc}") from None
    if ref.version is None:
        raise RolloutError(f"{where}: names a version (name@1.2.3)")
    return ref


def _stable(value: Any, runner: Any, canary: Ref) -> Ref:
    """The stable version: ``stable`` if given, else the route's runner (pinned), else the
    version of its weighted table that is not the canary."""
    if value is not None:
        return _pinned(value, ".stable")
    if isinstance(runner, str):
        return _pinned(runner, "(runner)")
    if isinstance(runner, dict):
        others = [k for k in runner if isinstance(k, str) and k != str(canary)]
        if len(others) == 1:
            return _pinned(others[0], "(runner)")
    raise RolloutError(
        ".stable: is required unless the route's runner is one version (name@1.2.3) or a "
        "table of the stable and the canary versions"
    )


def _steps(value: Any, shadowing: bool) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or not 1 <= len(value) <= MAX_STEPS
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise RolloutError(f".steps: must be a list of 1 to {MAX_STEPS} percents: [5, 25, 100]")
    if not all(0 <= v <= 100 for v in value) or any(b <= a for a, b in pairwise(value)):
        raise RolloutError(".steps: percents from 0 to 100, each above the one before")
    if value[0] == 0 and not shadowing:
        raise RolloutError(".steps: a step of 0 % tries the canary on shadow traffic: set shadow")
    if value[0] == 100:
        raise RolloutError(
            ".steps: at 100 % the stable version takes no traffic to compare the canary with: "
            "give a step below it (the last step below 100 % passed promotes the canary)"
        )
    return tuple(value)


def _bounded(raw: dict[str, Any], key: str) -> float:
    """``raw[key]`` within its :data:`BOUNDS` (their default when absent)."""
    bound = BOUNDS[key]
    return _number(raw, key, bound.default, bound.low, bound.high, bound.integer, bound.why)


def _number(
    raw: dict[str, Any],
    key: str,
    default: float,
    low: float,
    high: float,
    integer: bool = False,
    why: str | None = None,
) -> float:
    value = raw.get(key, default)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise RolloutError(f".{key}: must be {'an integer' if integer else 'a number'}")
    if not low <= value <= high:
        because = f" ({why})" if why is not None and value < low else ""
        raise RolloutError(f".{key}: must be from {low:.12g} to {high:.12g}{because}")
    return float(value) if not integer else value


def _status(raw: Any, steps: int) -> Status:
    if not isinstance(raw, dict):
        raise RolloutError(".status: must be a table")
    unknown = sorted(set(raw) - _STATUS_KEYS)
    if unknown:
        raise RolloutError(f".status: unknown key(s) {unknown}")
    ident = raw.get("id")
    if not isinstance(ident, str) or not 1 <= len(ident) <= 64 or not ident.isascii():
        raise RolloutError(".status.id: must be a short ASCII text")
    state = raw.get("state", "running")
    if state not in STATES:
        raise RolloutError(f".status.state: one of {list(STATES)}")
    try:
        step = _number(raw, "step", 0, 0, steps - 1, integer=True)
        window = _number(raw, "window", 1, 1, 2**62, integer=True)
        since = _number(raw, "since", 0.0, 0.0, 1e11)
    except RolloutError as exc:
        raise RolloutError(f".status{exc}") from None
    reason = raw.get("reason")
    if reason is not None and (not isinstance(reason, str) or len(reason) > MAX_TEXT):
        raise RolloutError(f".status.reason: must be a text of at most {MAX_TEXT} characters")
    history = raw.get("history", [])
    if not isinstance(history, list) or len(history) > MAX_HISTORY:
        raise RolloutError(f".status.history: must be a list of at most {MAX_HISTORY} decisions")
    if not all(isinstance(h, dict) for h in history):
        raise RolloutError(".status.history: each decision is a table")
    return Status(ident, state, int(step), int(window), float(since), reason, tuple(history))


def _clipped(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."
