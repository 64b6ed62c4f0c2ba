"""The rollout controller: every ``rollout_interval_s`` it reads each running rollout's
window figures, asks its gates (``registry/routing/gates.py``) and writes the step they
decide to the route store with a compare-and-swap on the entry's revision, so a change
made meanwhile (an operator's pause, another decider) wins and is read again.

One controller decides for the whole server: the process itself, or with workers the
supervisor (which merges every worker's figures). In fleet mode every replica runs one,
publishes its own figures to etcd, and only the one holding the decider lease
(``EtcdRouteStore.lead``) decides, from every replica's figures; when it stops, another
takes the lease and goes on from the step the store holds.

A window is decided only on figures counted from its start by the processes deciding it:
one that began before this controller started (a restart, a replica taking the lease
after its own restart) lost what was counted before, so its figures and its clock start
again together, in a new window at the same step (``restart``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog
from aiohttp import web

from plugserve.registry.errors import Conflict, InvalidInput, NotFound, PlugserveError
from plugserve.registry.fleet.etcd_store import EtcdRouteStore
from plugserve.registry.fleet.route_store import RouteStore
from plugserve.registry.routing.figures import WindowFigures
from plugserve.registry.routing.gates import decide
from plugserve.registry.routing.rollout import Rollout
from plugserve.registry.routing.route_specs import RouteSpec, with_rollout

log = structlog.get_logger("plugserve.rollouts")

Figures = Callable[[], Awaitable[dict[str, tuple[str, WindowFigures]]]]
"""This server's figures (every worker's, merged): each route's window key and figures."""


class DecisionCounter(Protocol):
    def __call__(self, route: str, decision: str) -> None: ...


class RolloutController:
    """Decides the steps of every running rollout in ``store``'s runtime routes."""

    def __init__(
        self,
        store: RouteStore,
        figures: Figures,
        interval_s: float = 1.0,
        counted: DecisionCounter | None = None,
    ) -> None:
        self.store = store
        self.figures = figures
        self.interval_s = interval_s
        self.counted = counted
        self.last: dict[str, tuple[str, WindowFigures]] = {}
        """The figures each rollout was last decided on (key, figures), for the admin API."""
        self.deciding = False
        self.started = time.time()
        """When this controller (and the figures it is handed) began counting."""
        self._task: asyncio.Task[None] | None = None

    @property
    def by(self) -> str:
        return self.store.replica.id

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="plugserve-rollouts")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception:  # a bug in one tick must not end rollouts
                log.exception("rollout_tick_failed")

    def rollouts(self) -> dict[str, RouteSpec]:
        return {
            name: spec
            for name, spec in self.store.registry.runtime_routes.items()
            if spec.rollout is not None and spec.rollout.active
        }

    async def tick(self) -> None:
        """One look at every running rollout; a step decided is written at once."""
        store = self.store
        fleet = store if isinstance(store, EtcdRouteStore) else None
        running = {
            name: spec
            for name, spec in self.rollouts().items()
            if spec.rollout is not None and spec.rollout.running
        }
        own = await self.figures() if running else {}
        if fleet is not None and (running or fleet.publishing):
            await fleet.publish_figures(own)
        if not running:
            self.deciding = False
            return
        self.deciding = True if fleet is None else await fleet.lead()
        if not self.deciding:
            return
        keys = {n: s.rollout.key for n, s in running.items() if s.rollout is not None}
        merged: dict[str, WindowFigures] = {}
        for name, (key, figures) in own.items():
            if keys.get(name) == key:  # a copy: the figures held go on counting
                merged[name] = WindowFigures()
                merged[name].add(figures)
        if fleet is not None:
            merged = await fleet.fleet_figures(keys, merged)
        now = time.time()
        for name, spec in running.items():
            try:
                await self._judge(spec, merged.get(name, WindowFigures()), now)
            except Exception:  # one rollout's fault must not stop the others
                log.exception("rollout_judge_failed", route=name)

    async def _judge(self, spec: RouteSpec, figures: WindowFigures, now: float) -> None:
        rollout = spec.rollout
        assert rollout is not None
        self.last[spec.name] = (rollout.key, figures)
        if rollout.status.since < self.started:
            why = "the window began before this server counted it: its figures begin again"
            await self._write(spec, rollout.decided("restart", why, None, self.by), "restart")
            return
        decision = decide(rollout, figures, now)
        if decision is None:
            return
        moved = rollout.decided(decision.decision, decision.reason, decision.figures, self.by)
        await self._write(spec, moved, decision.decision)

    async def _write(self, spec: RouteSpec, rollout: Rollout, decision: str) -> bool:
        try:
            await self.store.put(with_rollout(spec, rollout), spec.revision, as_decider=True)
        except Conflict:
            log.info("rollout_step_conflict", route=spec.name, decision=decision)
            return False
        except PlugserveError as exc:  # the store cannot be written now: next tick again
            log.warning("rollout_step_not_written", route=spec.name, decision=decision,
                        error=exc.message)  # fmt: skip
            return False
        status = rollout.status
        log.info(
            f"rollout_{decision}",
            route=spec.name,
            canary=str(rollout.canary),
            stable=str(rollout.stable),
            step=status.step,
            weight=rollout.weight,
            state=status.state,
            reason=status.reason or rollout.status.history[-1]["reason"],
            by=self.by,
        )
        if self.counted is not None:
            self.counted(spec.name, decision)
        return True

    def describe(self, name: str, rollout: Rollout | None) -> dict[str, Any] | None:
        """The figures of ``rollout``'s current window as last decided on (with
        ``deciding``: whether this server decides)."""
        if rollout is None:
            return None
        held = self.last.get(name)
        figures = held[1] if held is not None and held[0] == rollout.key else None
        return {
            "decided_here": self.deciding,
            "window": None if figures is None else figures.summary(),
        }


def check_status(current: RouteSpec | None, new: RouteSpec) -> None:
    """A ``PUT`` carrying the status of the rollout the route has (the same id) keeps it
    where it stands, so the status must be the stored one (read again if the rollout moved
    on since), and the canary and stable versions the same (others are a new rollout: a
    ``PUT`` without a status). Raises :class:`Conflict`."""
    ours = None if current is None else current.rollout
    theirs = new.rollout
    if ours is None or theirs is None or ours.status.id != theirs.status.id:
        return
    revision = 0 if current is None or current.revision is None else current.revision
    if (ours.canary, ours.stable) != (theirs.canary, theirs.stable):
        raise Conflict(
            f"route {new.name!r}: a rollout of another canary or stable version is a new "
            "rollout: PUT it without a status",
            revision=revision,
        )
    moved = (ours.status.window, ours.status.step, ours.status.state)
    if (theirs.status.window, theirs.status.step, theirs.status.state) != moved:
        raise Conflict(
            f"route {new.name!r}: its rollout moved on since this status was read "
            f"(now step {ours.status.step}, {ours.status.state}): read it again",
            revision=revision,
        )


ACTIONS = {
    "pause": ("running",),
    "resume": ("paused",),
    "abort": ("running", "paused"),
}


async def operate(
    store: RouteStore,
    name: str,
    action: str,
    reason: str | None,
    if_revision: int | None,
    counted: DecisionCounter | None = None,
) -> RouteSpec:
    """An operator's ``pause``, ``resume`` or ``abort`` of ``name``'s rollout."""
    spec = store.registry.runtime_routes.get(name)
    if spec is None or spec.rollout is None:
        raise NotFound(f"route {name!r} has no rollout")
    rollout = spec.rollout
    if rollout.status.state not in ACTIONS[action]:
        raise Conflict(
            f"route {name!r}'s rollout is {rollout.status.state}: {action} needs it "
            f"{' or '.join(ACTIONS[action])}",
            revision=spec.revision or 0,
        )
    if if_revision is not None and if_revision != spec.revision:
        raise Conflict(
            f"route {name!r} is at revision {spec.revision}, not {if_revision}: read it and retry",
            revision=spec.revision or 0,
        )
    why = reason or f"{action} by the operator"
    if len(why) > 1000:
        raise InvalidInput("reason: at most 1000 characters")
    moved = rollout.decided(action, why, None, "operator")
    stored = await store.put(with_rollout(spec, moved), spec.revision)
    log.info(f"rollout_{action}", route=name, step=moved.status.step, weight=moved.weight,
             reason=why)  # fmt: skip
    if counted is not None:
        counted(name, action)
    return stored


ROLLOUTS = web.AppKey("rollouts", RolloutController)
"""The server's rollout controller (none in a worker: its supervisor has it)."""
