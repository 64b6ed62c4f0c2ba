"""Process supervision (registry/execution/isolation/supervision.py): the restart backoff, the loop
that keeps a process running, the stall watchdog and the parent-death signal. The
workers and runner processes that use them are tested end to end in
tests/server/processes/test_supervisor.py and test_isolation.py."""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field

import pytest

from plugserve.registry.execution.isolation.supervision import (
    Restarts,
    keep_running,
    watch_stalls,
)


def test_the_backoff_doubles_to_its_most() -> None:
    restarts = Restarts()
    delays = [restarts.next_delay(1.0) for _ in range(9)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_a_stable_run_resets_the_backoff() -> None:
    restarts = Restarts(first=1.0, most=8.0, stable_after=10.0)
    assert [restarts.next_delay(0.0) for _ in range(3)] == [1.0, 2.0, 4.0]
    assert restarts.next_delay(10.0) == 8.0  # not longer than stable_after: no reset
    assert restarts.next_delay(10.5) == 1.0
    assert restarts.next_delay(0.0) == 2.0


@dataclass
class Fake:
    """A process that ends when its test says so."""

    number: int
    ended: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass
class Keeper:
    """keep_running's callbacks, recording what they were told."""

    stop: asyncio.Event = field(default_factory=asyncio.Event)
    started: list[Fake] = field(default_factory=list)
    exits: list[tuple[int, int, float]] = field(default_factory=list)
    failures: list[tuple[str, int, float]] = field(default_factory=list)
    fail_starts: int = 0
    give_up_after: int = 100
    new: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> Fake:
        if self.fail_starts:
            self.fail_starts -= 1
            raise OSError("no start")
        fake = Fake(len(self.started))
        self.started.append(fake)
        self.new.set()
        return fake

    async def wait_for_exit(self, fake: Fake) -> int:
        return await fake.ended

    def on_exit(self, fake: Fake, code: int, delay: float) -> None:
        self.exits.append((fake.number, code, delay))

    def on_start_failure(self, error: BaseException, failures: int, delay: float) -> bool:
        self.failures.append((str(error), failures, delay))
        return failures < self.give_up_after

    def run(self, restarts: Restarts, woken: bool = True) -> asyncio.Task[None]:
        return asyncio.create_task(
            keep_running(
                start=self.start,
                wait_for_exit=self.wait_for_exit,
                stopping=self.stop.is_set,
                on_exit=self.on_exit,
                on_start_failure=self.on_start_failure,
                start_errors=(OSError,),
                restarts=restarts,
                woken_by=self.stop if woken else None,
            )
        )

    async def next_start(self) -> Fake:
        await asyncio.wait_for(self.new.wait(), 2)
        self.new.clear()
        return self.started[-1]


async def test_a_process_that_ends_is_started_again_with_backoff() -> None:
    keeper = Keeper()
    task = keeper.run(Restarts(first=0.01, most=0.04))
    for number in range(4):
        fake = await keeper.next_start()
        assert fake.number == number
        fake.ended.set_result(-9)
    await keeper.next_start()
    assert keeper.exits == [(0, -9, 0.01), (1, -9, 0.02), (2, -9, 0.04), (3, -9, 0.04)]
    keeper.stop.set()
    keeper.started[-1].ended.set_result(0)
    await asyncio.wait_for(task, 2)


async def test_once_stopping_a_process_that_ends_is_not_started_again() -> None:
    keeper = Keeper()
    task = keeper.run(Restarts(first=0.01))
    fake = await keeper.next_start()
    keeper.stop.set()
    fake.ended.set_result(0)
    await asyncio.wait_for(task, 2)
    assert len(keeper.started) == 1
    assert keeper.exits == []


async def test_a_stop_during_the_pause_starts_nothing() -> None:
    """Woken by the stop, the pause ends at once; not woken, it runs out, and the stop is
    still seen before the start."""
    for woken in (True, False):
        keeper = Keeper()
        task = keeper.run(Restarts(first=0.5 if woken else 0.2), woken=woken)
        (await keeper.next_start()).ended.set_result(1)
        await asyncio.sleep(0.05)  # in the pause
        began = time.monotonic()
        keeper.stop.set()
        await asyncio.wait_for(task, 2)
        took = time.monotonic() - began
        assert took < 0.1 if woken else 0.1 < took < 0.5
        assert len(keeper.started) == 1
        assert [e[:2] for e in keeper.exits] == [(0, 1)]


async def test_failed_starts_back_off_and_may_give_up() -> None:
    keeper = Keeper(fail_starts=5, give_up_after=3)
    task = keeper.run(Restarts(first=0.01))
    await asyncio.wait_for(task, 2)
    assert keeper.failures == [("no start", 1, 0.01), ("no start", 2, 0.02), ("no start", 3, 0.04)]
    assert keeper.started == []


async def test_a_start_after_failures_counts_them_afresh() -> None:
    keeper = Keeper(fail_starts=2, give_up_after=3)
    task = keeper.run(Restarts(first=0.01))
    (await keeper.next_start()).ended.set_result(1)
    keeper.fail_starts = 2
    await keeper.next_start()
    assert [f[1] for f in keeper.failures] == [1, 2, 1, 2]  # never 3: never given up
    # The backoff goes on through exits and failed starts alike.
    assert [f[2] for f in keeper.failures] == [0.01, 0.02, 0.08, 0.16]
    assert keeper.exits == [(0, 1, 0.04)]
    keeper.stop.set()
    keeper.started[-1].ended.set_result(0)
    await asyncio.wait_for(task, 2)


async def test_a_process_running_already_is_watched_first() -> None:
    keeper = Keeper()
    first = Fake(99)
    task = asyncio.create_task(
        keep_running(
            start=keeper.start,
            wait_for_exit=keeper.wait_for_exit,
            stopping=keeper.stop.is_set,
            on_exit=keeper.on_exit,
            on_start_failure=keeper.on_start_failure,
            start_errors=(OSError,),
            restarts=Restarts(first=0.01, stable_after=60),
            running=first,
            running_since=time.monotonic() - 61,  # up long enough: the first delay
        )
    )
    await asyncio.sleep(0.02)
    assert keeper.started == []
    first.ended.set_result(3)
    await keeper.next_start()
    assert keeper.exits == [(99, 3, 0.01)]
    keeper.stop.set()
    keeper.started[-1].ended.set_result(0)
    await asyncio.wait_for(task, 2)


class Watched:
    """A target that answers after ``answer_s`` (never, when ``None``)."""

    def __init__(self, answer_s: float | None) -> None:
        self.answer_s = answer_s
        self.asked: list[float] = []

    async def ask(self) -> None:
        self.asked.append(time.monotonic())
        if self.answer_s is None:
            await asyncio.Event().wait()
        else:
            await asyncio.sleep(self.answer_s)


async def _watch(targets: list[Watched], seconds: float, stopping: asyncio.Event | None = None,
                 stall_timeout_s: float = 0.3) -> tuple[list[tuple[Watched, float]], list[Watched]]:  # fmt: skip
    """Watch ``targets`` for ``seconds``: the stalls (with when) and the failed asks."""
    stop = stopping or asyncio.Event()
    stalls: list[tuple[Watched, float]] = []
    unasked: list[Watched] = []

    async def ask(target: Watched) -> None:
        await target.ask()

    task = asyncio.create_task(
        watch_stalls(
            targets=lambda: targets,
            ask=ask,
            stall_timeout_s=stall_timeout_s,
            on_stall=lambda t: stalls.append((t, time.monotonic())),
            stopping=stop.is_set,
            on_unasked=lambda t, exc: unasked.append(t),
            every=0.05,
        )
    )
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait_for(task, 2)
    return stalls, unasked


async def test_a_target_that_answers_within_the_timeout_never_stalls() -> None:
    slow = Watched(0.2)  # well within 0.3 s
    stalls, _ = await _watch([slow], 1.2)
    assert stalls == []
    assert len(slow.asked) >= 3


async def test_a_silent_target_stalls_after_the_timeout_and_not_before() -> None:
    silent, answering = Watched(None), Watched(0.0)
    stalls, _ = await _watch([silent, answering], 0.6)
    assert [t for t, _ in stalls] == [silent]
    (_, at), first_ask = stalls[0], silent.asked[0]
    assert 0.3 <= at - first_ask < 0.45


async def test_a_stall_found_while_stopping_is_not_handed_on() -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.2, stop.set)  # during the first ask
    stalls, _ = await _watch([Watched(None)], 0.5, stop)
    assert stalls == []


async def test_an_ask_that_fails_is_not_a_stall() -> None:
    class Gone(Watched):
        async def ask(self) -> None:
            raise ConnectionError("gone")

    gone = Gone(None)
    stalls, unasked = await _watch([gone], 0.3)
    assert stalls == []
    assert unasked and set(unasked) == {gone}


async def test_a_timeout_of_zero_watches_nothing() -> None:
    target = Watched(None)
    stalls, _ = await _watch([target], 0.2, stall_timeout_s=0)
    assert stalls == []
    assert target.asked == []


CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from plugserve.registry.execution.isolation.supervision import die_with_parent
    die_with_parent(signal.SIGTERM, int(sys.argv[1]))
    print("ready", flush=True)
    time.sleep(30)
    print("outlived its parent", flush=True)
    """
)

PARENT = textwrap.dedent(
    """
    import os, subprocess, sys
    subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())])
    sys.stdin.read()  # until the test closes it
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize(
    ("sig", "ignores_sigterm"),
    [("SIGTERM", False), ("SIGKILL", True)],  # a worker's; a runner process's
)
def test_a_child_gets_its_signal_when_its_parent_ends(sig: str, ignores_sigterm: bool) -> None:
    """The child shares its parent's stdout: the test sees it end when that pipe closes. One
    that ignores SIGTERM still ends on SIGKILL: the signal asked for is the one sent."""
    code = CHILD.replace("SIGTERM", sig)
    if ignores_sigterm:
        code = code.replace(
            "die_with_parent(", "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ndie_with_parent("
        )
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert parent.stdin is not None and parent.stdout is not None
    try:
        assert parent.stdout.readline() == b"ready\n"
        parent.stdin.close()
        assert parent.wait(5) == 0
        ready, _, _ = select.select([parent.stdout], [], [], 5)
        assert ready, "the child is still running"
        assert parent.stdout.read() == b""
    finally:
        parent.kill()


def test_a_child_whose_parent_ended_already_exits_at_once() -> None:
    """The pid given is not its parent's: as if the parent ended before the call."""
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(os.getpid() + 1_000_000)],
        capture_output=True,
        timeout=10,
    )
    assert child.returncode == 1
    assert child.stdout == b""
