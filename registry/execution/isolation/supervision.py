"""Process supervision: what keeps a child process running, shared by the supervisor's
workers (``server/processes/supervisor.py``) and the runner host's processes
(:mod:`plugserve.registry.execution.isolation.host`).

- :class:`Restarts`: the restart backoff, 0.5 s doubling to 30 s, back to the first
  delay once a process has run a minute;
- :func:`keep_running`: start a process, wait for it to end, start it again after the
  backoff, until told to stop (or a start fails for good);
- :func:`watch_stalls`: ask processes for a sign of life, and hand on one that leaves an
  ask unanswered for the stall timeout;
- :func:`die_with_parent`: a child's own end when the process that started it ends.

Each user keeps its bookkeeping and log events in the callbacks it passes; this module
logs nothing itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

P = TypeVar("P")
"""A supervised process, as its starter returns it."""
T = TypeVar("T")
"""What a stall check asks: a process, as its user knows it."""

RESTART_FIRST_S = 0.5
RESTART_MAX_S = 30.0
STABLE_AFTER_S = 60.0
"""A process that ran this long before it ended is started again after the first delay."""
STALL_CHECK_S = 2.0
"""How often a process is asked for a sign of life (at most: never less often than the
stall timeout itself)."""
PR_SET_PDEATHSIG = 1
"""Linux's ``prctl`` option: the signal a process gets when its parent ends."""


@dataclass
class Restarts:
    """The delays before a process is started again: ``first``, doubled at each restart up
    to ``most``; back to ``first`` after a run longer than ``stable_after`` seconds."""

    first: float = RESTART_FIRST_S
    most: float = RESTART_MAX_S
    stable_after: float = STABLE_AFTER_S
    _next: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._next = self.first

    def next_delay(self, ran_for: float) -> float:
        """The delay before the next start of a process that ran ``ran_for`` seconds (0 for
        a start that failed); the one after it doubles."""
        if ran_for > self.stable_after:
            self._next = self.first
        delay = self._next
        self._next = min(delay * 2, self.most)
        return delay


async def keep_running(
    *,
    start: Callable[[], Awaitable[P]],
    wait_for_exit: Callable[[P], Awaitable[int]],
    stopping: Callable[[], bool],
    on_exit: Callable[[P, int, float], None],
    on_start_failure: Callable[[BaseException, int, float], bool],
    start_errors: tuple[type[BaseException], ...],
    restarts: Restarts | None = None,
    woken_by: asyncio.Event | None = None,
    running: P | None = None,
    running_since: float | None = None,
) -> None:
    """Keep one process running until ``stopping()``.

    Each turn starts a process (``start()``, unless ``running`` is one already started, up
    since ``running_since`` by :func:`time.monotonic`, default now) and waits for it to
    end (``wait_for_exit``, its exit code). A process that ends while ``stopping()`` is
    left ended. Otherwise ``on_exit(process, code, delay)`` is told, and the next start
    comes after ``delay`` (from ``restarts``, by how long the process ran since
    ``start()`` returned).

    A start that raises one of ``start_errors`` is handed to ``on_start_failure(error,
    failures, delay)``, ``failures`` counting the failed starts in a row: it returns
    whether to try again, after ``delay``; any other error ends the loop with it.

    A pause before a start ends early when ``woken_by`` is set; a start is never made
    once ``stopping()``.
    """
    restarts = restarts or Restarts()
    process = running
    up_since = time.monotonic() if running_since is None else running_since
    failures = 0
    while not stopping():
        if process is None:
            try:
                process = await start()
            except start_errors as exc:
                failures += 1
                delay = restarts.next_delay(0.0)
                if not on_start_failure(exc, failures, delay):
                    return
                await _pause(delay, woken_by)
                continue
            up_since = time.monotonic()
            failures = 0
        code = await wait_for_exit(process)
        if stopping():
            return
        delay = restarts.next_delay(time.monotonic() - up_since)
        on_exit(process, code, delay)
        process = None
        await _pause(delay, woken_by)


async def _pause(delay: float, woken_by: asyncio.Event | None) -> None:
    if woken_by is None:
        await asyncio.sleep(delay)
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(woken_by.wait(), delay)


async def watch_stalls(
    *,
    targets: Callable[[], Iterable[T]],
    ask: Callable[[T], Awaitable[object]],
    stall_timeout_s: float,
    on_stall: Callable[[T], None],
    stopping: Callable[[], bool],
    on_unasked: Callable[[T, Exception], None] | None = None,
    every: float = STALL_CHECK_S,
) -> None:
    """Every ``min(every, stall_timeout_s)`` seconds until ``stopping()``, ask each of
    ``targets()`` for a sign of life (all at once; the next round once every ask ended).

    Each ask waits ``stall_timeout_s`` for its answer, so one ask that times out is a whole
    timeout of silence: that target goes to ``on_stall``, unless ``stopping()`` by then.
    Silence is counted per ask, not from a target's last answer: counted so, a target
    stopped just before a round would be a hair under the timeout when that round's ask
    timed out, and could answer again before the next round. An ask that fails otherwise
    (the target ended, or cannot be asked) says nothing of its event loop: it goes to
    ``on_unasked``, if given, and is not counted. A ``stall_timeout_s`` of 0 or less
    watches nothing.
    """
    if stall_timeout_s <= 0:
        return

    async def check(target: T) -> None:
        try:
            await asyncio.wait_for(ask(target), stall_timeout_s)
        except TimeoutError:
            if not stopping():
                on_stall(target)
        except Exception as exc:
            if on_unasked is not None:
                on_unasked(target, exc)

    while not stopping():
        await asyncio.sleep(min(every, stall_timeout_s))
        await asyncio.gather(*(check(target) for target in list(targets())))


def die_with_parent(sig: signal.Signals, parent: int) -> None:
    """Have this process get ``sig`` when the process that started it ends (Linux's
    ``PR_SET_PDEATHSIG``; elsewhere nothing is asked), and exit with 1 at once when
    ``parent`` is no longer its parent: that one ended before the signal was asked for."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform == "linux" else None
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent:
        sys.exit(1)
