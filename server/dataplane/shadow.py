"""Shadow traffic: a share of a rollout's stable requests run again on its canary, after
the answer, and the two answers compared; the canary's answer is never returned.

A copy is taken (its inputs copied before the live run, which may change them in place)
as the stable version's request starts, and queued once its answer is made. The copies
run one at a time (``CONCURRENCY``), off the request path, at the canary runner's lowest
priority level (where it has several), each within ``TIMEOUT_S``. They take the time the
process has to spare: a copy starts when no live request is in flight; while live
requests never stop, the copies' own time is held to ``BUSY_TIME_SHARE`` of the
process's time (after a copy that took ``t``, counted up to ``CHARGE_CAP_S``, the next
waits up to ``t / BUSY_TIME_SHARE`` for the process to fall idle, then starts anyway).
Copies wait in a queue of ``QUEUE`` copies and ``QUEUE_BYTES`` of inputs and answers at
most; a request past either is not copied (a copy is dropped whose answer would pass
the bound), and counts as ``skipped``. A saturated server thus compares fewer copies
rather than answer its live requests later for them. A copy the canary refuses for want
of room (429: its queue, its ``max_sequences``) counts as ``skipped`` too. Each
comparison counts in the route's rollout window (``registry/routing/figures.py``): agreed
or not, and the largest difference per output.

A request of a sequence means something only after the requests before it: on a runner
that keeps sequences, whole sequences are copied or none of each. Whether a sequence is
copied is drawn at its ``sequence_start`` (the rollout's ``shadow`` share) and kept to
its end; a sequence already running when shadowing starts is not copied. A copy of a
copied sequence that is skipped, or that the canary fails, ends its sequence's copying:
the copies after it are not run, and count as ``skipped`` (the canary's state would no
longer follow the stable version's). A copy is skipped, never failed, where the canary
cannot run it as the stable version ran its request: its turn would come after the
canary lets the sequence expire (``IDLE_SHARE`` of its ``idle_timeout_s`` after the copy
before it: copies are paced, live requests are not), the canary no longer runs the
sequence, or has no room. A copied start runs only while the canary runs fewer than half
its ``max_sequences``, so that copies leave its live clients room. A route copies at
most its stable runner's ``max_sequences`` sequences at once; a copied sequence is
forgotten when the stable runner ends it (``SequenceHolder.watch``) and when a request
leaves it not running there (a start refused before the runner took it).

A copy runs with ``ctx.shadow`` set: it serves no client, so it counts in neither
version's request statistics (Triton's ``v2`` statistics count what clients were
served); its outcomes have their own counter (``plugserve_shadow_requests_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import structlog

from plugserve.registry.errors import InvalidInput, PlugserveError
from plugserve.registry.execution.chain import Chain
from plugserve.registry.execution.components import batch_policy
from plugserve.registry.execution.graph import derived_context
from plugserve.registry.execution.sequences import SequenceHolder, SequenceId, sequence_of
from plugserve.registry.routing.figures import Windows
from plugserve.registry.routing.rollout import Rollout
from plugserve.registry.routing.routes import RouteTable
from plugserve.registry.types import RequestContext

log = structlog.get_logger("plugserve.shadow")

CONCURRENCY = 1
"""Copies run at once in one process."""
QUEUE = 64
"""Copies waiting, at most; more are dropped."""
TIMEOUT_S = 30.0
"""A copy the canary has not answered within this long counts as failed."""
BUSY_TIME_SHARE = 0.01
"""The share of the process's time copies may run while live requests never stop."""
IDLE_SHARE = 0.9
"""A copy of a sequence runs within this share of the canary's ``idle_timeout_s`` after
the copy before it ended, or is skipped (the canary's clock for it starts a little
earlier, as its runner finishes)."""
CHARGE_CAP_S = 1.0
"""The most of one copy's time counted against ``BUSY_TIME_SHARE``: a copy that waited
long (timed out in a queue, on a hung canary) waited for its answer, not the process."""


INLINE_COMPARE_BYTES = 256 * 2**10
"""Answers larger than this are compared on a thread (smaller: faster than the hop)."""
QUEUE_BYTES = 64 * 2**20
"""Inputs and answers held by waiting copies, at most; a copy past it is dropped."""


@dataclass(slots=True)
class CopiedSequence:
    """A sequence whose requests are copied, from its start to its end."""

    sequence_id: SequenceId
    route: str
    rollout: str
    """The key of the rollout it is copied for."""
    holder: SequenceHolder
    """The stable runner's sequences, where it runs."""
    broken: bool = False
    """A copy of it was not run: those after it are not run either."""
    started: bool = False
    """The stable version answered a request of it (until then its start may be refused
    before the runner holds it)."""
    due: float | None = None
    """``time.monotonic()`` by which its next copy runs on the canary, or is skipped
    (``None``: none has run there yet)."""


@dataclass(slots=True)
class ShadowCopy:
    route: str
    rollout: Rollout
    data: Any
    ctx: RequestContext
    size: int
    """What it holds: its inputs, then the live answer kept with it too."""
    sequence: CopiedSequence | None = None
    """The copied sequence it is a request of."""


class Live(Protocol):
    """The live requests in flight in the process (``server/runtime/shutdown.py``'s
    ``Drain``)."""

    @property
    def active(self) -> int: ...

    def idle(self) -> Awaitable[None]:
        """Done once no live request is in flight."""
        ...


class ShadowTraffic:
    """The shadow copies of one process's requests."""

    def __init__(
        self,
        table: Callable[[], RouteTable],
        windows: Windows,
        live: Live,
        counted: Callable[[str, str], None] | None = None,
    ) -> None:
        self._table = table
        self.windows = windows
        self.counted = counted
        self.live = live
        self._unbusy_at = 0.0
        """``time.monotonic()`` from when the next copy starts even with live requests in
        flight (``BUSY_TIME_SHARE``)."""
        self._shadowing: dict[str, tuple[Rollout, str]] = {}
        """Route -> its rollout copying requests, and its stable version's variant."""
        self._closed = False
        self._held = 0
        """The bytes copies hold (:attr:`ShadowCopy.size`), from their copy to their end."""
        self._queue: asyncio.Queue[tuple[ShadowCopy, Any]] = asyncio.Queue(QUEUE)
        self._runners: list[asyncio.Task[None]] = []
        self._sequences: dict[SequenceId, dict[str, CopiedSequence]] = {}
        """Sequence id -> route -> the copied sequence running under that id."""
        self._copying: dict[str, int] = {}
        """Route -> its copied sequences (at most its stable runner's ``max_sequences``)."""

    def routes_changed(self) -> None:
        """Find again the routes whose rollouts copy requests (on every change of routes)."""
        self._shadowing = {
            name: (rollout, str(rollout.stable))
            for name, entry in self._table().entries.items()
            if (rollout := entry.spec.rollout) is not None and rollout.shadowing
        }

    def copy(self, route: str, chain: Chain, data: Any, ctx: RequestContext) -> ShadowCopy | None:
        """A copy of this request for its route's canary, if it is one of the share copied."""
        shadowing = self._shadowing.get(route)
        if shadowing is None:
            return None
        rollout, stable = shadowing
        if chain.variant != stable:
            return None
        holder = chain.runner.live_sequences()
        sequence = None
        if holder is not None:  # a request of a sequence: copied with its whole sequence
            sequence = self._copied_sequence(route, rollout, holder, ctx.parameters)
            if sequence is None:
                return None
            if sequence.broken:  # its copying ended: the rest of it is not run
                self._skip(route, rollout.key)
                return None
        elif random.random() >= rollout.shadow:
            return None
        size = _nbytes(data) or ctx.body_bytes or 0  # what the copy holds: arrays as decoded
        if self._queue.full() or self._held + size > QUEUE_BYTES:
            self._skip(route, rollout.key)
            if sequence is not None:
                sequence.broken = True
                if not sequence.started:  # not copied after all: nothing to keep of it
                    self._forget(sequence)
            return None
        copied = _copied(data)
        self._held += size
        return ShadowCopy(route, rollout, copied, ctx, size, sequence)

    def _copied_sequence(
        self, route: str, rollout: Rollout, holder: SequenceHolder, parameters: Mapping[str, Any]
    ) -> CopiedSequence | None:
        """The copied sequence a request on ``route`` belongs to, if its sequence is one
        (broken, if its copying ended): drawn at its start, kept to its end (``None`` for
        a request the runner refuses)."""
        try:
            sequence_id, start, end = sequence_of(parameters)
        except InvalidInput:
            return None
        if sequence_id is None:
            return None
        if start:
            if (earlier := self._sequences.get(sequence_id, {}).get(route)) is not None:
                self._forget(earlier)
            if random.random() < rollout.shadow:
                self._begin(route, rollout, holder, sequence_id)
        sequence = self._sequences.get(sequence_id, {}).get(route)
        if sequence is None:
            return None
        if end or sequence.rollout != rollout.key:  # its last request, or no longer copied
            self._forget(sequence)
        return sequence if sequence.rollout == rollout.key else None

    def _begin(
        self, route: str, rollout: Rollout, holder: SequenceHolder, sequence_id: SequenceId
    ) -> None:
        """Copy the sequence ``sequence_id`` starts, if ``route`` copies fewer than its
        stable runner's ``max_sequences`` (else its start counts as skipped)."""
        bound = holder.section.max_sequences
        if self._copying.get(route, 0) >= bound:
            self._sweep(route)
        if self._copying.get(route, 0) >= bound:
            self._skip(route, rollout.key)
            return
        sequence = CopiedSequence(sequence_id, route, rollout.key, holder)
        self._sequences.setdefault(sequence_id, {})[route] = sequence
        self._copying[route] = self._copying.get(route, 0) + 1
        holder.watch(self._sequence_ended)

    def _forget(self, sequence: CopiedSequence) -> None:
        """``sequence`` is no longer copied (copies of it already queued still run)."""
        routes = self._sequences.get(sequence.sequence_id)
        if routes is None or routes.get(sequence.route) is not sequence:
            return
        del routes[sequence.route]
        if not routes:
            del self._sequences[sequence.sequence_id]
        left = self._copying[sequence.route] - 1
        if left:
            self._copying[sequence.route] = left
        else:
            del self._copying[sequence.route]

    def _sweep(self, route: str) -> None:
        """Forget the sequences of ``route`` that have started and that their stable
        runner no longer runs (each is forgotten as it ends: this is the bound's guard)."""
        ours = [routes[route] for routes in self._sequences.values() if route in routes]
        for sequence in ours:
            if sequence.started and not sequence.holder.holds(sequence.sequence_id):
                self._forget(sequence)

    def _sequence_ended(self, sequence_id: SequenceId) -> None:
        """A runner no longer runs ``sequence_id``: its copying ends where it ran."""
        for sequence in list(self._sequences.get(sequence_id, {}).values()):
            if not sequence.holder.holds(sequence_id):
                self._forget(sequence)

    @property
    def copied_sequences(self) -> int:
        """Sequences whose requests are being copied."""
        return sum(map(len, self._sequences.values()))

    def release(self, copy: ShadowCopy) -> None:
        """A copy that will not be offered (its live request failed). Its sequence is no
        longer copied if the stable runner does not run it (a start refused before the
        runner took it: too many rows, ``max_sequences``, a stage's 400), or if its start
        has not been answered (the start failed; a request queued behind it fails too)."""
        self._held -= copy.size
        sequence = copy.sequence
        if sequence is not None and (
            not sequence.started or not sequence.holder.holds(sequence.sequence_id)
        ):
            self._forget(sequence)

    def offer(self, copy: ShadowCopy, answer: Any) -> None:
        """Queue ``copy`` to run with the live ``answer`` to compare; dropped when full."""
        extra = _nbytes(answer)
        try:
            if self._closed or self._held + extra > QUEUE_BYTES:
                raise asyncio.QueueFull
            self._queue.put_nowait((copy, answer))
            copy.size += extra
            self._held += extra
        except asyncio.QueueFull:
            self._held -= copy.size
            if copy.sequence is not None:
                copy.sequence.started = True
                copy.sequence.broken = True
            self._skip(copy.route, copy.rollout.key, moved=True)
            return
        if copy.sequence is not None:
            copy.sequence.started = True
        if not self._runners:
            self._runners = [
                asyncio.create_task(self._run(), name=f"plugserve-shadow-{i}")
                for i in range(CONCURRENCY)
            ]

    async def close(self) -> None:
        self._closed = True
        for task in self._runners:
            task.cancel()
        for task in self._runners:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._runners = []

    async def _run(self) -> None:
        while True:
            copy, answer = await self._queue.get()
            try:
                sequence = copy.sequence
                if not await self._turn(None if sequence is None else sequence.due):
                    assert sequence is not None  # only a copy of a sequence waits until `due`
                    sequence.broken = True  # the canary would let its sequence expire first
                    self._skip(copy.route, copy.rollout.key, moved=True)
                    continue
                started = time.monotonic()
                queued = await self._compare(copy, answer)
                if queued is not None:
                    self._spent(time.monotonic() - started - queued)
            except Exception:  # a bug here must not stop shadow traffic
                log.exception("shadow_failed", route=copy.route)
            finally:
                self._held -= copy.size
                del copy, answer

    async def _turn(self, by: float | None = None) -> bool:
        """Until the process is idle, or the copies' share of its busy time allows one:
        whether that came before ``by`` (a ``time.monotonic()``), if given."""
        wait = self._unbusy_at - time.monotonic()
        if not self.live.active or wait <= 0:
            return True
        until = self._unbusy_at if by is None else min(by, self._unbusy_at)
        try:
            async with asyncio.timeout(max(until - time.monotonic(), 0.0)):
                await self.live.idle()
        except TimeoutError:
            return until == self._unbusy_at
        return True

    def _spent(self, seconds: float) -> None:
        """A copy took ``seconds`` (its run and comparison, less its wait in a batcher's
        queue; ``CHARGE_CAP_S`` at most): the next starts beside live requests only
        ``seconds / BUSY_TIME_SHARE`` from now."""
        charged = min(max(seconds, 0.0), CHARGE_CAP_S)
        self._unbusy_at = time.monotonic() + charged / BUSY_TIME_SHARE

    async def _compare(self, copy: ShadowCopy, live: Any) -> float | None:
        """Run ``copy`` on the canary and count how its answer compares with ``live``;
        the seconds it waited in the canary's batcher queue (``None``: it did not run)."""
        rollout, sequence = copy.rollout, copy.sequence
        entry = self._table().entries.get(copy.route)
        now = None if entry is None else entry.spec.rollout
        if now is None or now.key != rollout.key:
            self._count(copy.route, "skipped")  # the window moved on: nothing to count in
            return None
        figures = self.windows.window(copy.route, rollout.key).shadow
        target = entry.by_version.get(str(rollout.canary.version)) if entry else None
        canary = target.runner.live_sequences() if isinstance(target, Chain) else None
        if not isinstance(target, Chain) or (
            sequence is not None and not _runnable(sequence, copy.ctx.parameters, canary)
        ):
            figures.skipped += 1  # not ready here, or its sequence's copying ended
            self._count(copy.route, "skipped")
            if sequence is not None:
                sequence.broken = True
            return None
        ctx = _shadow_context(copy.ctx, target)
        target.enter()
        try:
            async with asyncio.timeout(TIMEOUT_S):
                answer = await target.run(copy.data, ctx)
        except Exception as exc:
            if sequence is not None:
                sequence.broken = True
            if _refused(exc, sequence, copy.ctx.parameters, canary):
                figures.skipped += 1  # the canary had no room, or no longer ran the sequence
                self._count(copy.route, "skipped")
                return ctx.timings.get("queue", 0.0)
            figures.record(False, {}, failed=True)
            self._count(copy.route, "failed")
            error = f"no answer within {TIMEOUT_S:g} s" if isinstance(exc, TimeoutError) else exc
            log.info("shadow_canary_failed", route=copy.route, canary=str(rollout.canary),
                     error=str(error)[:300])  # fmt: skip
            return ctx.timings.get("queue", 0.0)
        finally:
            target.leave()
        if sequence is not None and canary is not None:
            sequence.due = time.monotonic() + IDLE_SHARE * canary.section.idle_timeout_s
        if _nbytes(live) > INLINE_COMPARE_BYTES:  # a long compare: off the event loop
            agreed, differences = await asyncio.to_thread(
                compare, live, answer, rollout.atol, rollout.rtol
            )
        else:
            agreed, differences = compare(live, answer, rollout.atol, rollout.rtol)
        figures.record(agreed, differences)
        self._count(copy.route, "agreed" if agreed else "differed")
        return ctx.timings.get("queue", 0.0)

    def _skip(self, route: str, rollout: str, moved: bool = False) -> None:
        """A copy for ``rollout`` not run, counted ``skipped``; ``moved``: its window may
        have moved on meanwhile (then it counts in no window)."""
        window = self.windows.get(route, rollout) if moved else self.windows.window(route, rollout)
        if window is not None:
            window.shadow.skipped += 1
        self._count(route, "skipped")

    def _count(self, route: str, outcome: str) -> None:
        if self.counted is not None:
            self.counted(route, outcome)


def _runnable(
    sequence: CopiedSequence, parameters: Mapping[str, Any], canary: SequenceHolder | None
) -> bool:
    """Whether the canary (its sequences: ``canary``) can run a copy of ``sequence`` with
    ``parameters`` as the stable version ran it: its copying goes on, within its ``due``;
    a start while the canary runs fewer than half its ``max_sequences`` (the rest are its
    live clients'), a later request of a sequence the canary runs."""
    if sequence.broken or (sequence.due is not None and time.monotonic() > sequence.due):
        return False
    if canary is None:  # a canary keeping no sequences: it answers as it does
        return True
    if parameters.get("sequence_start") is True:
        share = canary.section.max_sequences - canary.section.max_sequences // 2
        return canary.live < share
    return canary.holds(sequence.sequence_id)


def _refused(
    exc: Exception,
    sequence: CopiedSequence | None,
    parameters: Mapping[str, Any],
    canary: SequenceHolder | None,
) -> bool:
    """Whether the canary refused a copy for want of room (429: its queue, its
    ``max_sequences``), or a later request of ``sequence`` as not running (a 4xx that
    leaves the canary not running it): a copy it could not run, not its fault."""
    status = exc.status if isinstance(exc, PlugserveError) else 500
    if status == 429:
        return True
    if sequence is None or canary is None or parameters.get("sequence_start") is True:
        return False
    return 400 <= status < 500 and not canary.holds(sequence.sequence_id)


def _shadow_context(ctx: RequestContext, chain: Chain) -> RequestContext:
    """The copy's ``ctx``: another run of the request's, marked ``shadow``, at the canary
    runner's lowest priority level, with no deadline."""
    section = chain.runner.manifest.runner
    levels = batch_policy(section).priority_levels if section is not None else 1
    return dataclasses.replace(
        derived_context(ctx, ctx.parameters),
        priority=levels if levels > 1 else None,
        deadline=None,
        shadow=True,
    )


def _copied(data: Any) -> Any:
    """The request's inputs as they came: arrays copied (a stage may write into them)."""
    if isinstance(data, np.ndarray):
        return data.copy()
    if isinstance(data, Mapping):
        return {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in data.items()}
    return data


def _nbytes(data: Any) -> int:
    if isinstance(data, np.ndarray):
        return int(data.nbytes)
    if isinstance(data, Mapping):
        return sum(int(v.nbytes) for v in data.values() if isinstance(v, np.ndarray))
    return len(data) if isinstance(data, bytes | str) else 0


def compare(live: Any, shadow: Any, atol: float, rtol: float) -> tuple[bool, dict[str, float]]:
    """Whether two answers agree, and the largest difference per output (``inf``: they
    differ in shape, type or outputs). Numbers agree within ``atol + rtol * |live|``;
    anything else must be equal."""
    if isinstance(live, Mapping) and isinstance(shadow, Mapping):
        names = sorted({*map(str, live), *map(str, shadow)})
        pairs = {n: _difference(live.get(n, _MISSING), shadow.get(n, _MISSING), atol, rtol)
                 for n in names}  # fmt: skip
    else:
        pairs = {"": _difference(live, shadow, atol, rtol)}
    return all(ok for ok, _ in pairs.values()), {n: d for n, (_, d) in pairs.items()}


_MISSING = object()
_NUMERIC = "biufc"


def _difference(live: Any, shadow: Any, atol: float, rtol: float) -> tuple[bool, float]:
    if live is _MISSING or shadow is _MISSING:
        return False, float("inf")
    try:
        a, b = np.asarray(live), np.asarray(shadow)
    except Exception:
        return (live == shadow) is True, 0.0 if live == shadow else float("inf")
    if a.dtype.kind in _NUMERIC and b.dtype.kind in _NUMERIC:
        if a.shape != b.shape:
            return False, float("inf")
        if not a.size:
            return True, 0.0
        close = np.isclose(b, a, rtol=rtol, atol=atol, equal_nan=True)
        wide = np.complex128 if "c" in (a.dtype.kind, b.dtype.kind) else np.float64
        with np.errstate(invalid="ignore", over="ignore"):
            gaps = np.abs(a.astype(wide) - b.astype(wide))
        gaps = np.where(np.isnan(gaps), np.where(close, 0.0, np.inf), gaps)
        return bool(close.all()), float(gaps.max())
    same = a.shape == b.shape and bool(np.array_equal(a, b))
    return same, 0.0 if same else float("inf")
