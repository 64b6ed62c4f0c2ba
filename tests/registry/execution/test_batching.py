"""The dynamic batcher's policy, on a fake clock with a runner the test releases by hand."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugserve.registry.errors import (
    DeadlineExceeded,
    InvalidInput,
    PluginError,
    TooManyRequests,
    Unavailable,
)
from plugserve.registry.execution import batching
from plugserve.registry.execution.batching import BatchPolicy, Scheduler


class FakeTime:
    """A clock that moves only when told, and the timers that fire when it does."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[FakeTimer] = []

    def clock(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> FakeTimer:
        timer = FakeTimer(self.now + delay, callback)
        self.timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for timer in sorted(self.timers, key=lambda t: t.when):
            if timer.when <= self.now and not timer.cancelled and not timer.fired:
                timer.fired = True
                timer.callback()


class FakeTimer:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when, self.callback = when, callback
        self.cancelled = self.fired = False

    def cancel(self) -> None:
        self.cancelled = True


class HeldRunner:
    """Records each batch and holds it until the test releases it; answers x * 2."""

    def __init__(self) -> None:
        self.batches: list[dict[str, np.ndarray]] = []
        self.gates: list[asyncio.Future[None]] = []
        self.fail: Exception | None = None
        self.bad_rows = False

    async def execute(self, inputs: Any) -> dict[str, np.ndarray]:
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.batches.append(dict(inputs))
        self.gates.append(gate)
        await gate
        if self.fail is not None:
            raise self.fail
        y = inputs["x"] * 2
        return {"y": y[:-1] if self.bad_rows else y}

    def release(self) -> None:
        for gate in self.gates:
            if not gate.done():
                gate.set_result(None)

    def sizes(self) -> list[int]:
        return [b["x"].shape[0] for b in self.batches]


_RUNNERS: list[HeldRunner] = []


@pytest.fixture(autouse=True)
async def _release_everything() -> Any:
    """Let every held execution finish, so no task outlives its test."""
    yield
    for _ in range(5):
        for runner in _RUNNERS:
            runner.release()
        await settle()
    _RUNNERS.clear()


def make(policy: BatchPolicy) -> tuple[Scheduler, HeldRunner, FakeTime]:
    runner, fake = HeldRunner(), FakeTime()
    _RUNNERS.append(runner)
    scheduler = Scheduler(runner.execute, policy, "runner/t@1.0.0", fake.clock, fake.call_later)
    return scheduler, runner, fake


def rows(n: int, value: float = 1.0, width: int = 3) -> dict[str, np.ndarray]:
    return {"x": np.full((n, width), value, np.float32)}


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_lone_request_on_an_idle_runner_runs_at_once() -> None:
    scheduler, runner, _fake = make(BatchPolicy(max_batch_size=8, max_queue_delay_s=1.0))
    future = scheduler.enqueue(rows(1))
    await settle()
    assert runner.sizes() == [1]  # no time passed: no idle wait
    runner.release()
    assert (await future)["y"].tolist() == [[2, 2, 2]]


async def test_requests_batch_while_the_runner_is_busy() -> None:
    scheduler, runner, _fake = make(BatchPolicy(max_batch_size=8, max_queue_delay_s=1.0))
    first = scheduler.enqueue(rows(1))
    await settle()
    rest = [scheduler.enqueue(rows(1, float(i))) for i in range(3)]
    await settle()
    assert runner.sizes() == [1]
    runner.release()
    await settle()
    assert runner.sizes() == [1, 3]  # the runner was free again: the three went together
    runner.release()
    assert [(await f)["y"][0, 0] for f in rest] == [0, 2, 4]
    assert (await first)["y"].shape == (1, 3)


async def test_delay_counts_from_the_oldest_request_arrival() -> None:
    scheduler, runner, fake = make(
        BatchPolicy(max_batch_size=8, max_queue_delay_s=0.010, instances=2)
    )
    scheduler.enqueue(rows(1))
    await settle()
    assert runner.sizes() == [1]  # idle: at once
    fake.advance(0.004)
    scheduler.enqueue(rows(1))  # a slot is free but the runner is busy: wait for company
    fake.advance(0.004)
    scheduler.enqueue(rows(1))
    await settle()
    assert runner.sizes() == [1]
    fake.advance(0.0059)  # t = 0.0139: 9.9 ms after the oldest queued one arrived
    await settle()
    assert runner.sizes() == [1]
    fake.advance(0.0002)  # t = 0.0141: 10 ms after the oldest (0.004), not the newest (0.008)
    await settle()
    assert runner.sizes() == [1, 2]


async def test_a_full_batch_goes_without_waiting() -> None:
    scheduler, runner, _fake = make(BatchPolicy(max_batch_size=4, max_queue_delay_s=5, instances=2))
    scheduler.enqueue(rows(1))
    await settle()
    for _ in range(3):
        scheduler.enqueue(rows(1))
    await settle()
    assert runner.sizes() == [1]
    scheduler.enqueue(rows(1))
    await settle()
    assert runner.sizes() == [1, 4]


async def test_preferred_batch_sizes_cut_batches() -> None:
    scheduler, runner, fake = make(
        BatchPolicy(
            max_batch_size=8, max_queue_delay_s=0.01, preferred_batch_sizes=(2, 4), instances=2
        )
    )
    scheduler.enqueue(rows(1))
    await settle()
    for _ in range(5):
        scheduler.enqueue(rows(1))
    fake.advance(0.011)
    await settle()
    assert runner.sizes() == [1, 4]
    runner.release()
    await settle()
    assert runner.sizes() == [1, 4, 1]


async def test_a_request_larger_than_the_batch_limit_runs_alone() -> None:
    scheduler, runner, _fake = make(BatchPolicy(max_batch_size=4, max_queue_delay_s=0))
    scheduler.enqueue(rows(1))
    await settle()
    big = scheduler.enqueue(rows(10))
    small = scheduler.enqueue(rows(1))
    runner.release()
    await settle()
    runner.release()
    await settle()
    runner.release()
    assert runner.sizes() == [1, 10, 1]
    assert (await big)["y"].shape == (10, 3)
    assert (await small)["y"].shape == (1, 3)


async def test_incompatible_requests_never_share_a_batch() -> None:
    scheduler, runner, _fake = make(BatchPolicy(max_batch_size=16))
    scheduler.enqueue(rows(1))
    await settle()
    wide = scheduler.enqueue(rows(1, width=5))
    narrow = [scheduler.enqueue(rows(1)) for _ in range(2)]
    other_dtype = scheduler.enqueue({"x": np.ones((1, 3), np.float64)})
    for _ in range(4):
        runner.release()
        await settle()
    assert sorted(runner.sizes()) == [1, 1, 1, 2]
    for batch in runner.batches:
        assert len({(a.dtype.str, a.shape[1:]) for a in batch.values()}) == 1
    assert (await wide)["y"].shape == (1, 5)
    assert (await other_dtype)["y"].dtype == np.float64
    for future in narrow:
        assert (await future)["y"].shape == (1, 3)


async def test_a_full_queue_answers_429() -> None:
    scheduler, _runner, _fake = make(BatchPolicy(max_batch_size=0, max_queue_size=2))
    scheduler.enqueue(rows(1))
    await settle()
    scheduler.enqueue(rows(1))
    scheduler.enqueue(rows(1))
    with pytest.raises(TooManyRequests, match="2 requests queued") as info:
        scheduler.enqueue(rows(1))
    assert info.value.headers() == {"Retry-After": "1"}
    assert scheduler.queued == 2


async def test_an_expired_request_gets_504_without_running() -> None:
    scheduler, runner, fake = make(BatchPolicy(max_batch_size=8))
    scheduler.enqueue(rows(1))
    await settle()
    late = scheduler.enqueue(rows(1, 7.0), deadline=fake.now + 0.005)
    on_time = scheduler.enqueue(rows(1, 3.0), deadline=fake.now + 1.0)
    fake.advance(0.01)
    runner.release()
    await settle()
    with pytest.raises(DeadlineExceeded, match="deadline passed while queued"):
        await late
    assert runner.sizes() == [1, 1]
    assert runner.batches[1]["x"][0, 0] == 3.0  # only the one on time ran
    runner.release()
    assert (await on_time)["y"][0, 0] == 6.0


async def test_a_cancelled_request_is_dropped_before_execution() -> None:
    scheduler, runner, _fake = make(BatchPolicy(max_batch_size=8))
    scheduler.enqueue(rows(1))
    await settle()
    gone = scheduler.enqueue(rows(1, 9.0))
    kept = scheduler.enqueue(rows(1, 1.0))
    gone.cancel()  # its client went away, or its deadline cancelled the handler
    runner.release()
    await settle()
    assert runner.sizes() == [1, 1]
    assert runner.batches[1]["x"][0, 0] == 1.0
    runner.release()
    await kept


async def test_higher_priority_runs_first() -> None:
    scheduler, runner, _fake = make(BatchPolicy(max_batch_size=0, priority_levels=3))
    scheduler.enqueue(rows(1, 0.0))
    await settle()
    scheduler.enqueue(rows(1, 3.0))  # default level: the lowest (3)
    scheduler.enqueue(rows(1, 2.0), priority=2)
    scheduler.enqueue(rows(1, 1.0), priority=1)
    scheduler.enqueue(rows(1, 3.5), priority=3)
    for _ in range(5):
        runner.release()
        await settle()
    assert [b["x"][0, 0] for b in runner.batches] == [0.0, 1.0, 2.0, 3.0, 3.5]
    with pytest.raises(Exception, match=r"priority 4 is outside 1\.\.3"):
        scheduler.enqueue(rows(1), priority=4)


async def test_one_tenants_burst_does_not_starve_another() -> None:
    scheduler, runner, _fake = make(BatchPolicy(max_batch_size=0))
    scheduler.enqueue(rows(1, -1.0), tenant="a")
    await settle()
    for i in range(10):
        scheduler.enqueue(rows(1, float(i)), tenant="a")
    scheduler.enqueue(rows(1, 100.0), tenant="b")
    scheduler.enqueue(rows(1, 101.0), tenant="b")
    for _ in range(13):
        runner.release()
        await settle()
    order = [b["x"][0, 0] for b in runner.batches]
    assert order.index(100.0) <= 3
    assert order.index(101.0) <= 5
    assert [v for v in order if v < 100] == [-1.0, *map(float, range(10))]  # a's own order kept


async def test_tenant_weights_share_in_proportion() -> None:
    scheduler, runner, _fake = make(BatchPolicy(max_batch_size=0, tenant_weights={"gold": 3.0}))
    scheduler.enqueue(rows(1, -1.0))
    await settle()
    for _ in range(12):
        scheduler.enqueue(rows(1, 1.0), tenant="gold")
        scheduler.enqueue(rows(1, 2.0), tenant="free")
    for _ in range(25):
        runner.release()
        await settle()
    first_eight = [b["x"][0, 0] for b in runner.batches[1:9]]
    assert first_eight.count(1.0) == 6  # 3 : 1
    assert first_eight.count(2.0) == 2


async def test_tenants_that_left_the_queue_are_forgotten() -> None:
    """Attack round after issue 12: every X-Tenant-ID that queued kept an entry for good when
    each request named a new tenant (the virtual clock never moved past their tags), so a
    client growing tenant names grew the server without bound, and each dispatch walked them."""
    scheduler, runner, _fake = make(BatchPolicy(max_batch_size=0))
    scheduler.enqueue(rows(1))
    await settle()
    for wave in range(5):
        futures = [scheduler.enqueue(rows(1), tenant=f"t{wave}-{i}") for i in range(1000)]
        while not all(f.done() for f in futures):
            runner.release()
            await settle()
    assert len(scheduler._queue._tenant_finish) <= 1024  # MAX_TENANTS_KEPT
    runner.release()


async def test_a_failed_batch_runs_again_one_by_one_and_only_single_failures_are_reported() -> None:
    """Issue 29 finding 5: any failure of a batch of several is run again one request at a
    time; ``on_failure`` (the circuit breaker's count) hears the executions of one request
    only, never the batch's, whose fault is unknown."""
    scheduler, runner, _fake = make(BatchPolicy(max_batch_size=8))
    reported: list[Exception] = []
    scheduler.on_failure = reported.append
    scheduler.enqueue(rows(1))
    await settle()
    futures = [scheduler.enqueue(rows(1)) for _ in range(3)]
    runner.fail = PluginError("runner/t@1.0.0", ValueError("boom"))
    for _ in range(5):
        runner.release()
        await settle()
    errors = []
    for future in futures:
        with pytest.raises(PluginError, match="boom") as info:
            await future
        errors.append(info.value)
    assert runner.sizes() == [1, 3, 1, 1, 1]
    assert len(reported) == 4  # the first request, then each of the three alone


async def test_outputs_of_the_wrong_length_fail_the_batch_clearly() -> None:
    scheduler, runner, _fake = make(BatchPolicy(max_batch_size=8))
    scheduler.enqueue(rows(1))
    await settle()
    futures = [scheduler.enqueue(rows(1)) for _ in range(2)]
    runner.release()
    await settle()
    runner.bad_rows = True
    runner.release()
    for future in futures:
        with pytest.raises(PluginError, match="a batch of 2 rows needs 2 first"):
            await future


async def test_closing_fails_queued_requests_and_refuses_new_ones() -> None:
    scheduler, _runner, _fake = make(BatchPolicy(max_batch_size=8))
    scheduler.enqueue(rows(1))
    await settle()
    queued = scheduler.enqueue(rows(1))
    scheduler.close()
    with pytest.raises(Unavailable, match="unloaded"):
        await queued
    with pytest.raises(Unavailable, match="shutting down"):
        scheduler.enqueue(rows(1))


requests = st.lists(
    st.tuples(
        st.integers(1, 6), st.sampled_from([(3,), (2, 2), ()]), st.sampled_from(["<f4", "<i8"])
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(requests, st.integers(1, 16))
def test_every_response_is_exactly_its_own_slice(
    specs: list[tuple[int, tuple[int, ...], str]], limit: int
) -> None:
    async def scenario() -> None:
        scheduler, runner, _fake = make(BatchPolicy(max_batch_size=limit))
        blocker = scheduler.enqueue(rows(1))
        await settle()
        sent = []
        for i, (n, trailing, dtype) in enumerate(specs):
            x = (
                np.arange(n * int(np.prod(trailing)), dtype=dtype).reshape((n, *trailing))
                + 1000 * i
            ).astype(dtype)
            sent.append((x, scheduler.enqueue({"x": x})))
        while not all(f.done() for _, f in sent):
            runner.release()
            await settle()
        await blocker
        for x, future in sent:
            y = future.result()["y"]
            assert y.dtype == x.dtype
            np.testing.assert_array_equal(y, x * 2)
        for batch in runner.batches:
            assert batch["x"].shape[0] <= max(limit, max(n for n, _, _ in specs))

    asyncio.run(scenario())


async def test_submit_runs_a_lone_request_in_its_own_task_and_batches_the_rest() -> None:
    scheduler, runner, fake = make(BatchPolicy(max_batch_size=8))
    lone = asyncio.ensure_future(scheduler.submit(rows(1, 1.0)))
    await settle()
    assert runner.sizes() == [1]
    assert scheduler.queued == 0  # it never queued
    later = [asyncio.ensure_future(scheduler.submit(rows(1, 2.0))) for _ in range(3)]
    await settle()
    assert scheduler.queued == 3
    runner.release()
    await settle()
    assert runner.sizes() == [1, 3]
    runner.release()
    assert (await lone)["y"][0, 0] == 2.0
    assert [(await f)["y"][0, 0] for f in later] == [4.0, 4.0, 4.0]
    assert (scheduler.executions, scheduler.rows) == (2, 4)
    with pytest.raises(DeadlineExceeded):
        await scheduler.submit(rows(1), deadline=fake.now - 1)


async def test_a_cancelled_submit_leaves_the_queue_at_once_and_never_runs() -> None:
    """issue 12, finding 13: a queued request whose caller is cancelled (its client hung up)
    frees its place in the queue at once and is never executed; a batch already running
    finishes for its other members."""
    scheduler, runner, _fake = make(BatchPolicy(max_batch_size=4, max_queue_size=2))
    running = asyncio.ensure_future(scheduler.submit(rows(1, 1.0)))
    kept = asyncio.ensure_future(scheduler.submit(rows(1, 2.0)))
    await settle()
    abandoned = asyncio.ensure_future(scheduler.submit(rows(1, 9.0)))
    await settle()
    assert scheduler.queued == 2 and runner.sizes() == [1]  # the queue is full
    abandoned.cancel()
    await settle()
    assert scheduler.queued == 1  # before any batch ran: the place is free now
    fresh = asyncio.ensure_future(scheduler.submit(rows(1, 3.0)))  # not 429
    await settle()
    runner.release()
    await settle()
    assert runner.sizes() == [1, 2]  # the abandoned request is in no batch
    assert [b["x"][:, 0].tolist() for b in runner.batches][1] == [2.0, 3.0]
    runner.release()
    assert (await kept)["y"][0, 0] == 4 and (await fresh)["y"][0, 0] == 6
    assert (await running)["y"][0, 0] == 2
    assert abandoned.cancelled()


async def test_a_request_cancelled_mid_batch_leaves_the_others_their_answers() -> None:
    """issue 12, finding 13: cancelling one member of a running batch fails no other."""
    scheduler, runner, _fake = make(BatchPolicy(max_batch_size=4))
    first = asyncio.ensure_future(scheduler.submit(rows(1, 1.0)))
    await settle()
    members = [asyncio.ensure_future(scheduler.submit(rows(1, float(v)))) for v in (2, 3)]
    await settle()
    runner.release()
    await settle()
    assert runner.sizes() == [1, 2]
    members[0].cancel()
    runner.release()
    assert (await members[1])["y"][0, 0] == 6
    assert (await first)["y"][0, 0] == 2
    assert members[0].cancelled()


# -- inline batches (a runner process's sync runner) ------------------------------------


class InlineRunner:
    """A sync runner: records each batch and answers x * 2; a row of -1 is refused."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.fail: BaseException | None = None

    def execute(self, inputs: Any) -> dict[str, np.ndarray]:
        self.batches.append(inputs["x"].shape[0])
        if self.fail is not None:
            raise self.fail
        if (inputs["x"] == -1).any():
            raise InvalidInput("a row of -1")
        return {"y": inputs["x"] * 2}

    async def execute_async(self, inputs: Any) -> dict[str, np.ndarray]:
        return self.execute(inputs)


def make_inline(policy: BatchPolicy) -> tuple[Scheduler, InlineRunner, FakeTime]:
    runner, fake = InlineRunner(), FakeTime()
    scheduler = Scheduler(
        runner.execute_async, policy, "runner/t@1.0.0", fake.clock, fake.call_later
    )
    scheduler.inline = runner.execute
    return scheduler, runner, fake


async def test_an_inline_batch_is_answered_before_pump_returns() -> None:
    """No task and no turn of the loop: what pump cut is answered when it returns."""
    scheduler, runner, _fake = make_inline(BatchPolicy(max_batch_size=4, max_queue_delay_s=1.0))
    futures = [scheduler.enqueue(rows(1, float(i)), pump=False) for i in range(6)]
    assert runner.batches == []
    scheduler.pump()
    assert runner.batches == [4, 2]  # the first batch ran, then the pump cut the next
    assert all(f.done() for f in futures)
    assert [f.result()["y"][0, 0] for f in futures] == [0, 2, 4, 6, 8, 10]
    assert scheduler.executions == 2 and scheduler.rows == 6 and scheduler._running == 0


async def test_a_backlog_of_slow_inline_batches_lets_the_loop_turn_between_them() -> None:
    """Review of the runner processes' stall check: pump ran a whole backlog in one step,
    so 2,000 queued requests of 1 s batches held the loop for a minute (no answer sent,
    no deadline seen) and read as a stall. Past INLINE_HOLD_S it goes on in a later step,
    and each later step is bounded the same way."""
    scheduler, runner, fake = make_inline(BatchPolicy(max_batch_size=1, max_queue_delay_s=1.0))
    slow = runner.execute

    def execute(inputs: Any) -> dict[str, np.ndarray]:
        fake.advance(batching.INLINE_HOLD_S * 0.6)  # each batch takes 60 % of the hold
        return slow(inputs)

    scheduler.inline = execute
    futures = [scheduler.enqueue(rows(1, float(i)), pump=False) for i in range(7)]
    steps: list[int] = []
    resume = scheduler._resume

    def counted() -> None:
        before = len(runner.batches)
        resume()
        steps.append(len(runner.batches) - before)

    scheduler._resume = counted  # type: ignore[method-assign]
    scheduler.pump()
    assert len(runner.batches) == 2  # the second batch passed the hold: the loop turns
    assert [f.done() for f in futures] == [True] * 2 + [False] * 5
    await asyncio.wait_for(asyncio.gather(*futures), 5)
    assert steps == [2, 2, 1]  # each later step ran two batches at most
    assert runner.batches == [1] * 7
    assert [f.result()["y"][0, 0] for f in futures] == [0, 2, 4, 6, 8, 10, 12]


async def test_a_closed_scheduler_does_not_resume_its_backlog() -> None:
    scheduler, runner, fake = make_inline(BatchPolicy(max_batch_size=1, max_queue_delay_s=1.0))
    slow = runner.execute
    scheduler.inline = lambda inputs: (fake.advance(batching.INLINE_HOLD_S), slow(inputs))[1]
    futures = [scheduler.enqueue(rows(1, float(i)), pump=False) for i in range(4)]
    scheduler.pump()
    scheduler.close()
    await asyncio.sleep(0.01)
    assert len(runner.batches) == 1  # one batch took the whole hold; nothing ran after
    assert all(f.done() for f in futures)  # the rest were refused (503), none left waiting
    assert [f.exception() is None for f in futures] == [True, False, False, False]


async def test_an_inline_batch_that_fails_fails_each_request_and_frees_the_runner() -> None:
    """A runner process's batch that fails is run again one by one (in a task): each
    request fails alone, with its own error, and the runner takes the next batch."""
    scheduler, runner, _fake = make_inline(BatchPolicy(max_batch_size=4, max_queue_delay_s=1.0))
    runner.fail = PluginError("runner/t@1.0.0", RuntimeError("boom"))
    futures = [scheduler.enqueue(rows(1), pump=False) for _ in range(3)]
    scheduler.pump()
    await asyncio.wait_for(asyncio.wait(futures), 5)
    errors = [f.exception() for f in futures]
    assert all(isinstance(e, PluginError) for e in errors)
    assert len({id(e) for e in errors}) == 3  # each its own
    assert runner.batches == [3, 1, 1, 1]
    runner.fail = None
    assert scheduler.enqueue(rows(1)).result()["y"].shape == (1, 3)  # the runner is free


async def test_a_refused_inline_batch_is_retried_one_by_one() -> None:
    """Only the bad request fails; the others are answered, in a task of their own."""
    scheduler, runner, _fake = make_inline(BatchPolicy(max_batch_size=4, max_queue_delay_s=1.0))
    good, bad, other = (scheduler.enqueue(rows(1, v), pump=False) for v in (1.0, -1.0, 3.0))
    scheduler.pump()
    assert runner.batches == [3]
    assert not good.done()  # retried alone, after this step
    assert (await good)["y"][0, 0] == 2 and (await other)["y"][0, 0] == 6
    with pytest.raises(InvalidInput):
        await bad
    assert runner.batches == [3, 1, 1, 1]
    await settle()
    assert scheduler._running == 0


async def test_an_inline_batch_cancelled_inside_the_runner_frees_it() -> None:
    """Not an Exception (a plugin's own CancelledError): the batch's requests are cancelled,
    and the runner takes the next batch."""
    scheduler, runner, _fake = make_inline(BatchPolicy(max_batch_size=4, max_queue_delay_s=1.0))
    runner.fail = asyncio.CancelledError()
    future = scheduler.enqueue(rows(1), pump=False)
    with pytest.raises(asyncio.CancelledError):
        scheduler.pump()
    assert future.cancelled()
    runner.fail = None
    assert scheduler.enqueue(rows(1)).result()["y"].shape == (1, 3)

    # What was queued behind the cancelled batch runs in a later step, unasked.
    runner.fail = asyncio.CancelledError()
    first = scheduler.enqueue(rows(4), pump=False)
    behind = scheduler.enqueue(rows(2, 5.0), pump=False)
    with pytest.raises(asyncio.CancelledError):
        scheduler.pump()
    runner.fail = None
    assert first.cancelled()
    assert (await asyncio.wait_for(behind, 1))["y"][0, 0] == 10.0


def make_gathering(policy: BatchPolicy) -> tuple[Scheduler, InlineRunner]:
    """A scheduler whose runner answers in the step that called it (a runner run on the
    event loop, ``inline_runners``): no batch forms while it runs."""
    runner = InlineRunner()
    scheduler = Scheduler(runner.execute_async, policy, "runner/t@1.0.0")
    scheduler.gather = True
    return scheduler, runner


async def test_a_gathering_scheduler_batches_the_requests_of_one_turn_once_they_come_together() -> (
    None
):
    """A worker whose runner runs on its loop: the first request of a turn runs at once;
    a second in the same turn is company, and from then on the requests of a turn go as one
    batch cut at its end, until a cut gathers a single request."""
    scheduler, runner = make_gathering(BatchPolicy(max_batch_size=8))

    async def turn(count: int, value: float = 1.0) -> list[Any]:
        calls = [asyncio.ensure_future(scheduler.submit(rows(1, value))) for _ in range(count)]
        return [(await c)["y"][0, 0] for c in calls]

    assert await turn(1) == [2.0]
    await settle()
    assert await turn(1) == [2.0]
    await settle()
    assert runner.batches == [1, 1]  # alone, turn after turn: at once, no turn waited
    assert await turn(4, 3.0) == [6.0] * 4
    assert runner.batches == [1, 1, 1, 3]  # the first at once, then company: the rest as one
    await settle()
    assert await turn(5, 2.0) == [4.0] * 5
    assert runner.batches[4:] == [5]  # in company: all of the turn's requests together
    await settle()
    assert await turn(1) == [2.0]
    assert runner.batches[5:] == [1]  # a cut of one: company ends
    await settle()
    lone = asyncio.ensure_future(scheduler.submit(rows(1, 1.0)))
    await asyncio.sleep(0)
    assert lone.done()  # alone again: answered in its own first step, no turn waited
    assert (scheduler.executions, scheduler.rows) == (7, 13)


async def test_a_lone_request_on_a_gathering_scheduler_waits_for_no_turn() -> None:
    scheduler, runner = make_gathering(BatchPolicy(max_batch_size=8))
    call = asyncio.ensure_future(scheduler.submit(rows(1, 1.0)))
    await asyncio.sleep(0)
    assert call.done() and runner.batches == [1]  # answered in its own first step
    assert (await call)["y"][0, 0] == 2.0


async def test_a_gathering_scheduler_closed_in_the_turn_runs_nothing_more() -> None:
    scheduler, runner = make_gathering(BatchPolicy(max_batch_size=8))
    calls = [asyncio.ensure_future(scheduler.submit(rows(1))) for _ in range(3)]
    await asyncio.sleep(0)
    assert runner.batches == [1]  # the first ran; the others wait for the end of the turn
    scheduler.close()
    assert (await calls[0])["y"].shape == (1, 3)
    for call in calls[1:]:
        with pytest.raises(Unavailable):
            await call
    await settle()
    assert runner.batches == [1]


async def test_retries_of_a_failed_batch_skip_requests_past_their_deadline_or_the_open_circuit() -> (
    None
):
    """A failed batch's retries cost runner time only while they can help: a request whose
    deadline passed gets 504 without running again, and once the runner's circuit opened
    (``stop``), the rest get its 503 without running."""
    scheduler, runner, fake = make_inline(BatchPolicy(max_batch_size=4, max_queue_delay_s=1.0))
    runner.fail = PluginError("runner/t@1.0.0", RuntimeError("boom"))
    opened: list[Exception] = []
    scheduler.on_failure = opened.append  # the first failure alone "opens the circuit"
    scheduler.stop = lambda: Unavailable("circuit open", circuit="open") if opened else None
    failing = runner.execute

    def slow(inputs: Any) -> dict[str, np.ndarray]:
        fake.advance(0.6)  # the late request's deadline passes while its batch runs
        return failing(inputs)

    scheduler.inline = slow
    late = scheduler.enqueue(rows(1, 1.0), deadline=0.5, pump=False)
    first, second, third = (scheduler.enqueue(rows(1, v), pump=False) for v in (2.0, 3.0, 4.0))
    scheduler.pump()
    await asyncio.wait_for(asyncio.wait([late, first, second, third]), 5)
    assert isinstance(late.exception(), DeadlineExceeded)
    assert isinstance(first.exception(), PluginError)  # retried alone: the runner's fault
    assert [f.exception().status for f in (second, third)] == [503, 503]  # type: ignore[union-attr]
    assert runner.batches == [4, 1]  # the batch, then the first retry only
    assert len(opened) == 1


async def test_a_batch_the_runner_answers_503_is_not_run_again() -> None:
    """A runner's own "not now" (503, 504) says nothing about any request: its batch fails
    whole, unreported, and costs no retries."""
    scheduler, runner, _fake = make_inline(BatchPolicy(max_batch_size=4, max_queue_delay_s=1.0))
    reported: list[Exception] = []
    scheduler.on_failure = reported.append
    runner.fail = Unavailable("the model is warming up")
    futures = [scheduler.enqueue(rows(1), pump=False) for _ in range(3)]
    scheduler.pump()
    assert [f.exception().status for f in futures] == [503] * 3  # type: ignore[union-attr]
    assert runner.batches == [3] and reported == []
