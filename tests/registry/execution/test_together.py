"""Stages of one request run together: every one stopped when one fails, and the error
they end with ranked as any composition's is."""

from __future__ import annotations

import asyncio

import pytest

from plugserve.registry.errors import DeadlineExceeded, InvalidInput, PluginError
from plugserve.registry.execution.together import together


async def test_results_come_in_the_order_of_the_awaitables() -> None:
    async def after(seconds: float, value: int) -> int:
        await asyncio.sleep(seconds)
        return value

    assert await together([after(0.02, 1), after(0.0, 2), after(0.01, 3)]) == [1, 2, 3]
    assert await together([]) == []


async def test_the_first_to_fail_stops_the_others_before_its_error_is_raised() -> None:
    """A fast 400 beside a choice that would run long: the long one is cancelled, and has
    stopped by the time the 400 reaches the caller."""
    stopped: list[str] = []

    async def refused() -> None:
        await asyncio.sleep(0)
        raise InvalidInput("no")

    async def long() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.01)  # its own cleanup, awaited before the caller goes on
            stopped.append("long")

    with pytest.raises(InvalidInput):
        await asyncio.wait_for(together([long(), refused()]), 5)
    assert stopped == ["long"]


async def test_errors_at_once_rank_a_fault_over_the_clients_error() -> None:
    """A 400 and a plugin's fault in the same step: the fault (500), though the 400 came
    first."""
    go = asyncio.Event()

    async def refused() -> None:
        await go.wait()
        raise InvalidInput("no")

    async def broken() -> None:
        await go.wait()
        raise PluginError("runner/x@1", RuntimeError("broken"))

    async def release() -> None:
        go.set()

    with pytest.raises(PluginError):
        await together([refused(), broken(), release()])


async def test_a_deadline_ranks_over_a_fault() -> None:
    go = asyncio.Event()

    async def fails(error: Exception) -> None:
        await go.wait()
        raise error

    async def release() -> None:
        go.set()

    late = DeadlineExceeded("late")
    with pytest.raises(DeadlineExceeded) as raised:
        await together([fails(RuntimeError("x")), fails(late), release()])
    assert raised.value is late


async def test_the_callers_cancellation_stops_every_one_and_goes_on_as_it_came() -> None:
    stopped: list[int] = []

    async def long(index: int) -> None:
        try:
            await asyncio.sleep(30)
        finally:
            stopped.append(index)

    caller = asyncio.create_task(together([long(0), long(1)]))
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert sorted(stopped) == [0, 1]
    this = asyncio.current_task()
    assert this is not None and this.cancelling() == 0  # not left marked as cancelled
