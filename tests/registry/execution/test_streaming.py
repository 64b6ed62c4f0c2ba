"""The stream scheduler on its own: admission, order, continuous batching, failures, closing."""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from plugserve.registry.errors import (
    InvalidInput,
    PluginError,
    PlugserveError,
    TooManyRequests,
    Unavailable,
)
from plugserve.registry.execution import streaming
from plugserve.registry.execution.batching import BatchPolicy
from plugserve.registry.execution.breaker import CircuitBreaker
from plugserve.registry.execution.streaming import READ_AHEAD, Stream, StreamScheduler, stream_kind


class Counter:
    """A step runner: each stream counts to its ``n``; records every step's streams."""

    def __init__(self) -> None:
        self.steps: list[list[str]] = []
        self.stopped: list[str] = []
        self.fail_step = False

    def start(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        if int(inputs["n"][0]) < 0:
            raise InvalidInput("n must not be negative")
        return {"name": str(inputs["name"][0]), "left": int(inputs["n"][0])}

    def step(self, states: list[dict[str, Any]]) -> list[Any]:
        self.steps.append([s["name"] for s in states])
        if self.fail_step:
            raise RuntimeError("the model broke")
        out: list[Any] = []
        for state in states:
            state["left"] -= 1
            out.append(None if state["left"] < 0 else {"left": np.array([state["left"]])})
        return out

    def stop(self, state: dict[str, Any]) -> None:
        self.stopped.append(state["name"])


def fault(exc: BaseException) -> PlugserveError:
    if isinstance(exc, PlugserveError):
        return exc
    return PluginError("runner/counter@1", exc)


def scheduler(
    component: Any, max_streams: int = 8, batch: int = 8, **policy: Any
) -> StreamScheduler:
    return StreamScheduler(
        component,
        "steps",
        BatchPolicy(max_batch_size=batch, **policy),
        max_streams,
        "runner/counter@1",
        ThreadPoolExecutor(1),
        CircuitBreaker("runner/counter@1", failures=2),
        fault,
    )


def inputs(name: str, n: int) -> dict[str, np.ndarray]:
    return {"name": np.array([name], object), "n": np.array([n])}


async def stopped(runner: Counter, count: int) -> list[str]:
    """The states ``runner`` stopped, once ``count`` were (between steps, on its thread)."""
    for _ in range(200):
        if len(runner.stopped) >= count:
            break
        await asyncio.sleep(0.01)
    return runner.stopped


async def drain(stream: Stream) -> list[int]:
    return [int(r["left"][0]) async for r in stream]


def test_stream_kinds() -> None:
    class Gen:
        def infer(self, inputs: Any) -> Any:
            yield inputs

    class Once:
        def infer(self, inputs: Any) -> Any:
            return inputs

    assert stream_kind(Counter()) == "steps"
    assert stream_kind(Gen()) == "generator"
    assert stream_kind(Once()) is None


async def test_streams_join_and_leave_between_steps() -> None:
    runner = Counter()
    streams = scheduler(runner)
    a = streams.open(inputs("a", 3), None)
    first = await anext(a)
    b = streams.open(inputs("b", 1), None)  # arrives while a is in progress
    assert int(first["left"][0]) == 2
    assert await drain(a) == [1, 0] and await drain(b) == [0]
    assert runner.steps[0] == ["a"] and ["a", "b"] in runner.steps  # b joined a's steps
    assert sorted(await stopped(runner, 2)) == ["a", "b"] and streams.running == 0


async def test_a_step_takes_at_most_max_batch_size_streams_round_robin() -> None:
    runner = Counter()
    streams = scheduler(runner, batch=2)
    opened = [streams.open(inputs(name, 2), None) for name in "abc"]
    results = await asyncio.gather(*(drain(s) for s in opened))
    assert results == [[1, 0]] * 3
    assert all(len(step) <= 2 for step in runner.steps)
    assert runner.steps[:3] == [["a", "b"], ["c", "a"], ["b", "c"]]


async def test_waiting_streams_start_by_priority_then_arrival_and_the_queue_is_bounded() -> None:
    runner = Counter()
    streams = scheduler(runner, max_streams=1, priority_levels=2, max_queue_size=2)
    first = streams.open(inputs("first", 1), 2)
    low = streams.open(inputs("low", 1), 2)
    high = streams.open(inputs("high", 1), 1)
    with pytest.raises(TooManyRequests):
        streams.open(inputs("over", 1), 1)
    with pytest.raises(InvalidInput):  # a priority outside the levels
        streams.open(inputs("bad", 1), 3)
    await asyncio.gather(drain(first), drain(low), drain(high))
    assert [step[0] for step in runner.steps][::2] == ["first", "high", "low"]


async def test_a_closed_stream_runs_no_more_steps_and_frees_its_place() -> None:
    runner = Counter()
    streams = scheduler(runner, max_streams=1)
    long = streams.open(inputs("long", 1000), None)
    waiting = streams.open(inputs("waiting", 1), None)
    await anext(long)
    long.close()
    assert await drain(waiting) == [0]
    assert [s for s in runner.steps if "long" in s] == [["long"]] * len(
        [s for s in runner.steps if "long" in s]
    )
    assert len([s for s in runner.steps if "long" in s]) <= 2  # the one sent, one in flight
    assert await stopped(runner, 2) == ["long", "waiting"]
    gone = streams.open(inputs("gone", 5), None)
    gone.close()  # closed before it started: it never starts
    await asyncio.sleep(0.05)
    assert "gone" not in runner.stopped and streams.waiting == 0 and streams.running == 0


async def test_failures_reach_the_streams_of_their_step_and_count_against_the_runner() -> None:
    runner = Counter()
    streams = scheduler(runner)
    refused = streams.open(inputs("neg", -1), None)
    with pytest.raises(InvalidInput):
        await drain(refused)
    assert streams.breaker.failures == 0  # the client's fault, not the runner's
    runner.fail_step = True
    a, b = streams.open(inputs("a", 3), None), streams.open(inputs("b", 3), None)
    for stream in (a, b):
        with pytest.raises(PluginError, match="the model broke"):
            await drain(stream)
    assert streams.breaker.failures >= 1 and streams.running == 0


async def test_closing_the_runner_ends_every_stream_with_503() -> None:
    runner = Counter()
    streams = scheduler(runner, max_streams=1)
    running = streams.open(inputs("a", 10_000), None)
    queued = streams.open(inputs("b", 1), None)
    await anext(running)
    streams.close()
    for stream in (running, queued):
        with pytest.raises(PlugserveError) as ended:
            await drain(stream)
        assert ended.value.status == 503


async def test_a_generator_runner_streams_and_is_closed_when_its_client_leaves() -> None:
    closed: list[int] = []

    class Gen:
        def infer(self, inputs: Any) -> Any:
            try:
                for i in range(1000):
                    yield {"i": np.array([i])}
            finally:
                closed.append(1)

    streams = StreamScheduler(
        Gen(), "generator", BatchPolicy(), 4, "runner/gen@1", ThreadPoolExecutor(1),
        CircuitBreaker("runner/gen@1"), fault,
    )  # fmt: skip
    stream = streams.open({"x": np.array([1])}, None)
    assert [int((await anext(stream))["i"][0]) for _ in range(3)] == [0, 1, 2]
    stream.close()
    for _ in range(50):
        if closed:
            break
        await asyncio.sleep(0.01)
    assert closed == [1] and streams.running == 0


async def test_a_stream_whose_consumer_does_not_read_runs_no_further_than_read_ahead() -> None:
    counter = Counter()
    streams = scheduler(counter)
    idle = streams.open(inputs("idle", 1000), None)
    busy = streams.open(inputs("busy", 30), None)
    assert await drain(busy) == list(range(29, -1, -1))  # the other streams step on
    await asyncio.sleep(0.05)
    assert sum("idle" in names for names in counter.steps) == READ_AHEAD
    assert len(await drain(idle)) == 1000  # read, it runs to its end
    parked = streams.open(inputs("parked", 1000), None)
    await asyncio.sleep(0.05)
    parked.close()  # closed while out of the batches: stopped, its place freed
    assert (await stopped(counter, 3))[-1] == "parked" and streams.running == 0

    made: list[int] = []

    class Endless:
        async def infer(self, inputs: Any) -> Any:
            while True:
                made.append(1)
                yield {"i": np.array([len(made)])}

    generators = StreamScheduler(
        Endless(), "generator", BatchPolicy(), 4, "runner/gen@1", None,
        CircuitBreaker("runner/gen@1"), fault,
    )  # fmt: skip
    stream = generators.open({"x": np.array([1])}, None)
    await asyncio.sleep(0.05)
    assert len(made) == READ_AHEAD
    assert [int((await anext(stream))["i"][0]) for _ in range(20)] == list(range(1, 21))
    stream.close()


async def test_a_step_may_refuse_one_stream_and_the_others_go_on() -> None:
    """Issue 29 finding 5, the streaming variant: a step of several streams cannot be run
    again one stream at a time (it may have advanced some states already), so a step runner
    refuses one stream by returning InvalidInput in its state's place: that stream alone
    ends 400, the breaker counts nothing, the others step on."""

    class Picky(Counter):
        def step(self, states: list[dict[str, Any]]) -> list[Any]:
            out = super().step(states)
            return [InvalidInput("bad state") if s["name"] == "bad" else r
                    for s, r in zip(states, out, strict=True)]  # fmt: skip

    runner = Picky()
    streams = scheduler(runner)
    good, bad = streams.open(inputs("good", 3), None), streams.open(inputs("bad", 3), None)
    assert await drain(good) == [2, 1, 0]
    with pytest.raises(InvalidInput, match="bad state"):
        await drain(bad)
    assert runner.steps[0] == ["good", "bad"]  # one step held both
    assert streams.breaker.failures == 0 and streams.running == 0
    assert await stopped(runner, 2) == ["bad", "good"]


async def test_a_stream_whose_client_reads_nothing_gives_its_place_to_a_waiting_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 29 finding 3: a client that read none of its 64 streams' responses held all
    of a route's ``max_streams`` places for ``body_timeout_s``, and other clients' streams
    waited until they gave up. Now a stream that has held READ_AHEAD untaken responses for
    UNREAD_LIMIT_S gives its place to a waiting stream: it ends 503 after what it holds,
    its state is stopped, the breaker counts nothing."""
    monkeypatch.setattr(streaming, "UNREAD_LIMIT_S", 0.1)
    counter = Counter()
    streams = scheduler(counter, max_streams=2)
    started = asyncio.get_running_loop().time()
    idle = [streams.open(inputs(f"idle{i}", 1000), None) for i in range(2)]
    await asyncio.sleep(0.02)  # both hold READ_AHEAD responses, unread
    waiting = streams.open(inputs("reader", 5), None)
    assert streams.waiting == 1
    assert await asyncio.wait_for(drain(waiting), 5) == [4, 3, 2, 1, 0]
    assert asyncio.get_running_loop().time() - started >= 0.1  # not before the limit
    assert (await stopped(counter, 1))[
        0
    ] == "idle0"  # the longest unread went, the other kept its place
    with pytest.raises(Unavailable, match="took none of its last 8 responses") as ended:
        assert len(await drain(idle[0])) == READ_AHEAD  # what it held, then the 503
    assert ended.value.status == 503
    assert streams.breaker.failures == 0 and streams.running == 1
    assert len(await drain(idle[1])) == 1000  # read at last, it runs to its end


async def test_an_unread_generator_stream_gives_its_place_up_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Variant of issue 29 finding 3: a generator runner's stream (its next step waits for
    room) and a waiting stream of higher priority."""
    monkeypatch.setattr(streaming, "UNREAD_LIMIT_S", 0.05)
    closed: list[int] = []

    class Gen:
        def infer(self, inputs: Any) -> Any:
            try:
                for i in range(int(inputs["n"][0])):
                    yield {"left": np.array([i])}
            finally:
                closed.append(int(inputs["n"][0]))

    streams = StreamScheduler(
        Gen(), "generator", BatchPolicy(priority_levels=2), 1, "runner/gen@1",
        ThreadPoolExecutor(1), CircuitBreaker("runner/gen@1"), fault,
    )  # fmt: skip
    idle = streams.open({"n": np.array([1000])}, None)
    await asyncio.sleep(0.02)
    urgent = streams.open({"n": np.array([3])}, 1)
    assert await asyncio.wait_for(drain(urgent), 5) == [0, 1, 2]
    with pytest.raises(Unavailable):
        await drain(idle)
    for _ in range(50):
        if 1000 in closed:
            break
        await asyncio.sleep(0.01)
    assert closed == [3, 1000] or sorted(closed) == [3, 1000]
    assert streams.running == 0 and streams.breaker.failures == 0


async def test_an_unread_stream_keeps_its_place_while_no_one_waits_and_a_slow_reader_always(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Variants: a place is taken only for a waiting stream (a non-reader alone keeps it
    past the limit), and a client that reads slowly, but within the limit, keeps it too."""
    monkeypatch.setattr(streaming, "UNREAD_LIMIT_S", 0.2)
    counter = Counter()
    streams = scheduler(counter, max_streams=1)
    alone = streams.open(inputs("alone", 20), None)
    await asyncio.sleep(0.3)
    assert len(await drain(alone)) == 20

    slow = streams.open(inputs("slow", 20), None)
    await asyncio.sleep(0.02)
    waiting = streams.open(inputs("waiting", 2), None)
    taken = []
    async for response in slow:  # a response every 0.05 s: never 0.2 s without reading
        taken.append(int(response["left"][0]))
        await asyncio.sleep(0.05 if len(taken) < 6 else 0)
    assert taken == list(range(19, -1, -1))
    assert await drain(waiting) == [1, 0]


async def test_a_stop_never_runs_while_a_step_does() -> None:
    """From the review of the eviction: ``stop(state)`` was called on the event loop as
    soon as a stream left, while a step of the others could be running on the runner's
    thread: a runner whose states share memory (a KV cache) freed it under that step.
    A stream that leaves (its client hung up, here) is stopped between steps."""
    import threading
    import time

    class Slow(Counter):
        def __init__(self) -> None:
            super().__init__()
            self.in_step = threading.Event()
            self.overlaps: list[str] = []

        def step(self, states: list[dict[str, Any]]) -> list[Any]:
            self.in_step.set()
            time.sleep(0.05)
            self.in_step.clear()
            return super().step(states)

        def stop(self, state: dict[str, Any]) -> None:
            if self.in_step.is_set():
                self.overlaps.append(state["name"])
            super().stop(state)

    runner = Slow()
    streams = scheduler(runner, max_streams=2, batch=1)
    idle = streams.open(inputs("idle", 1000), None)
    reader = asyncio.create_task(drain(streams.open(inputs("reader", 40), None)))
    for _ in range(500):  # the idle stream holds READ_AHEAD responses: parked
        if idle.parked:
            break
        await asyncio.sleep(0.01)
    assert idle.parked
    for _ in range(5000):
        if runner.in_step.is_set():
            break
        await asyncio.sleep(0.001)
    idle.close()  # its client hangs up while the reader's step runs
    assert await asyncio.wait_for(reader, 10) == list(range(39, -1, -1))
    assert "idle" in await stopped(runner, 2) and runner.overlaps == []


async def test_one_waiting_stream_takes_one_place_however_often_room_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From the review of the eviction: a stream that gave its place up but had not left
    yet (a generator ends after its step) was not counted, so room made again before it
    left (the next timer, another arrival) took a second non-reader's place for the same
    waiting stream."""
    monkeypatch.setattr(streaming, "UNREAD_LIMIT_S", 0.05)

    class Gen:
        def infer(self, inputs: Any) -> Any:
            for i in range(int(inputs["n"][0])):
                yield {"left": np.array([i])}

    streams = StreamScheduler(
        Gen(), "generator", BatchPolicy(), 2, "runner/gen@1",
        ThreadPoolExecutor(2), CircuitBreaker("runner/gen@1"), fault,
    )  # fmt: skip
    idle = [streams.open({"n": np.array([1000])}, None) for _ in range(2)]
    await asyncio.sleep(0.1)  # both unread past the limit
    waiting = streams.open({"n": np.array([2])}, None)  # takes one place: idle[0]'s
    assert [s.evicted is not None for s in idle] == [True, False]
    streams._make_room()  # made again before idle[0] has left
    assert [s.evicted is not None for s in idle] == [True, False]
    assert await asyncio.wait_for(drain(waiting), 5) == [0, 1]
    streams.close()
    assert streams._evictions is None  # closing cancels a pending round of room-making


async def test_an_unread_stream_gives_its_place_only_to_its_priority_or_a_higher_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From the review of the eviction: a waiting stream of a lower priority took the
    place of an urgent stream whose client was slow to read."""
    monkeypatch.setattr(streaming, "UNREAD_LIMIT_S", 0.05)
    counter = Counter()
    streams = scheduler(counter, max_streams=1, priority_levels=2)
    urgent = streams.open(inputs("urgent", 1000), 1)
    await asyncio.sleep(0.1)
    low = streams.open(inputs("low", 2), 2)
    await asyncio.sleep(0.2)
    assert urgent.evicted is None and streams.waiting == 1
    higher = streams.open(inputs("higher", 2), 1)  # its own level: it takes the place
    assert await asyncio.wait_for(drain(higher), 5) == [1, 0]
    assert urgent.evicted is not None
    assert await asyncio.wait_for(drain(low), 5) == [1, 0]


async def test_a_sync_stop_is_called_when_start_and_step_are_async() -> None:
    """From the third review: with async ``start`` and ``step`` the runner has no thread,
    and a sync ``stop`` queued for the step loop failed on the missing executor (logged,
    never called): a runner freeing memory there leaked it for every stream."""

    class AsyncCounter(Counter):
        async def start(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:  # type: ignore[override]
            return Counter.start(self, inputs)

        async def step(self, states: list[dict[str, Any]]) -> list[Any]:  # type: ignore[override]
            return Counter.step(self, states)

    runner = AsyncCounter()
    streams = StreamScheduler(
        runner, "steps", BatchPolicy(max_batch_size=8), 8, "runner/counter@1", None,
        CircuitBreaker("runner/counter@1", failures=2), fault,
    )  # fmt: skip
    assert await drain(streams.open(inputs("a", 3), None)) == [2, 1, 0]
    assert await stopped(runner, 1) == ["a"]
