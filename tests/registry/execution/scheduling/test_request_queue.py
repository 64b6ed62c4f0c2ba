"""The request queue's order (priority level, tenants' fair shares, arrival), its deadlines,
and requests leaving it (taken in a batch, given up, the runner closing)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from plugserve.registry.errors import DeadlineExceeded, Unavailable
from plugserve.registry.execution.scheduling.request_queue import RequestQueue

INPUTS = {"x": np.zeros((1, 2), np.float32)}


def add(
    queue: RequestQueue,
    tenant: str | None = None,
    level: int = 1,
    rows: int = 1,
    deadline: float | None = None,
    weights: dict[str, float] | None = None,
    timings: dict[str, float] | None = None,
) -> asyncio.Future[dict[str, np.ndarray]]:
    future: asyncio.Future[dict[str, np.ndarray]] = asyncio.get_running_loop().create_future()
    queue.add(INPUTS, rows, None, 0.0, deadline, level, tenant, weights or {}, future, timings)
    return future


def order(queue: RequestQueue, futures: list[asyncio.Future[dict[str, np.ndarray]]]) -> list[int]:
    return [futures.index(r.future) for r in queue.ordered()]


async def test_a_tenants_burst_shares_the_queue_with_another_tenant() -> None:
    queue = RequestQueue("runner/t@1")
    futures = [add(queue, "a") for _ in range(3)] + [add(queue, "b")]
    assert order(queue, futures) == [0, 3, 1, 2]


async def test_a_heavier_tenant_takes_more_of_the_queue() -> None:
    queue = RequestQueue("runner/t@1")
    weights = {"a": 2.0}
    futures = [add(queue, "a", weights=weights) for _ in range(4)]
    futures += [add(queue, "b", weights=weights) for _ in range(2)]
    assert order(queue, futures) == [0, 4, 1, 2, 5, 3]


async def test_a_higher_priority_level_leaves_first() -> None:
    queue = RequestQueue("runner/t@1")
    futures = [add(queue, level=2), add(queue, level=1)]
    assert order(queue, futures) == [1, 0]


async def test_a_new_tenant_starts_at_the_virtual_time_of_the_latest_batch() -> None:
    queue = RequestQueue("runner/t@1")
    futures = [add(queue, "a") for _ in range(3)]
    queue.take(queue.ordered()[:2], now=1.0)  # the virtual time moves to a's second tag
    futures.append(add(queue, "b"))
    assert len(queue) == 2 and order(queue, futures) == [3, 2]
    assert [r.tag for r in queue.ordered()] == [1.0, 2.0]  # b at the virtual time, not at 0


async def test_a_taken_batch_has_its_queue_wait_timed() -> None:
    queue = RequestQueue("runner/t@1")
    timings: dict[str, float] = {}
    add(queue, timings=timings)
    queue.take(queue.ordered(), now=0.25)
    assert timings == {"queue": 0.25} and len(queue) == 0


async def test_requests_past_their_deadline_or_given_up_leave_the_queue() -> None:
    queue = RequestQueue("runner/t@1")
    late, kept, cancelled, gone = (
        add(queue, deadline=1.0), add(queue, deadline=5.0), add(queue), add(queue)
    )  # fmt: skip
    cancelled.cancel()
    queue.remove(gone)
    queue.drop_finished(now=2.0)
    assert [r.future for r in queue.ordered()] == [kept]
    with pytest.raises(DeadlineExceeded):
        late.result()
    assert not gone.done()  # given up by its caller: it never runs, and nothing answers it


async def test_closing_fails_every_queued_request() -> None:
    queue = RequestQueue("runner/t@1")
    futures = [add(queue), add(queue)]
    queue.close()
    assert len(queue) == 0
    for future in futures:
        with pytest.raises(Unavailable, match="was unloaded"):
            future.result()
