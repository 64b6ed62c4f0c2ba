"""Cutting a batch from the queued requests (sizes, the delay, requests that cannot join,
preferred sizes), and joining a batch's inputs and splitting its outputs."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from plugserve.registry.errors import PluginError
from plugserve.registry.execution.layout import TensorBounds
from plugserve.registry.execution.scheduling.batch_cutting import cut, merge, signature, split
from plugserve.registry.execution.scheduling.policy import BatchPolicy
from plugserve.registry.execution.scheduling.request_queue import Pending


def pending(rows: int, width: int = 2, arrival: float = 0.0, value: float = 0.0) -> Pending:
    inputs = {"x": np.full((rows, width), value, np.float32)}
    n, sig = signature(inputs)
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    return Pending(inputs, n, sig, arrival, None, 1, 0.0, 0, future)


def test_a_signature_is_the_rows_and_what_must_agree_to_batch() -> None:
    assert signature({"x": np.zeros((3, 2), np.float32)}) == (3, (("x", "<f4", (2,)),))
    assert signature({"x": np.float32(1.0) * np.ones(())}) == (1, None)
    assert signature({"a": np.zeros((2, 1)), "b": np.zeros((3, 1))})[1] is None


async def test_a_batch_takes_requests_up_to_the_max_batch_size() -> None:
    ordered = [pending(2), pending(3), pending(2), pending(1)]
    batch, due, apart = cut(ordered, BatchPolicy(max_batch_size=6), None, TensorBounds(), True, 0)
    assert batch == [ordered[0], ordered[1], ordered[3]] and due is None and apart is None


async def test_a_busy_runner_waits_for_the_oldest_requests_delay() -> None:
    ordered = [pending(1, arrival=1.0), pending(1, arrival=2.0)]
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=0.5)
    assert cut(ordered, policy, None, TensorBounds(), False, 1.2) == (None, 1.5, None)
    batch, _, _ = cut(ordered, policy, None, TensorBounds(), False, 1.5)
    assert batch == ordered


async def test_a_request_that_cannot_join_is_said_apart() -> None:
    ordered = [pending(1), pending(1, width=3)]
    batch, _, apart = cut(ordered, BatchPolicy(max_batch_size=4), None, TensorBounds(), True, 0)
    assert batch == ordered[:1] and apart is ordered[1]


async def test_a_batch_is_cut_to_the_largest_preferred_size_it_fills() -> None:
    ordered = [pending(1) for _ in range(5)]
    policy = BatchPolicy(max_batch_size=8, preferred_batch_sizes=(2, 4))
    batch, _, _ = cut(ordered, policy, None, TensorBounds(), True, 0)
    assert batch == ordered[:4]


async def test_a_request_past_the_tensor_bound_closes_the_batch() -> None:
    ordered = [pending(2, width=10), pending(2, width=10)]
    bounds = TensorBounds(max_elements=30)
    batch, _, apart = cut(ordered, BatchPolicy(max_batch_size=8), None, bounds, False, 0)
    assert batch == ordered[:1] and apart is None  # closed: sent now, though the runner is busy


async def test_outputs_are_split_into_each_requests_rows() -> None:
    batch = [pending(1, value=1.0), pending(2, value=2.0)]
    merged = merge(None, batch)
    assert merged["x"].shape == (3, 2)
    split(None, "runner/t@1", batch, 3, {"y": merged["x"] * 2})
    assert [r.future.result()["y"][:, 0].tolist() for r in batch] == [[2.0], [4.0, 4.0]]


async def test_outputs_without_a_row_per_input_row_cannot_be_split() -> None:
    batch = [pending(1), pending(1)]
    with pytest.raises(PluginError, match="a batch of 2 rows needs 2 first"):
        split(None, "runner/t@1", batch, 2, {"y": np.zeros((1, 2), np.float32)})
