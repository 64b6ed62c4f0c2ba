"""Compressed request messages inflated within their limit and the byte budget
(handlers.inflate, on the body threads)."""

from __future__ import annotations

import gzip

import grpc
import pytest

from plugserve.server.grpc_api.admission import Ended
from plugserve.server.grpc_api.handlers import INFLATE_STEP, inflate
from plugserve.server.http.budget import ByteBudget

BOMB = gzip.compress(b"\0" * (64 << 20))


def test_a_message_inflates_and_holds_its_bytes_until_given_back() -> None:
    budget = ByteBudget(64 << 20)
    body, held = inflate("gzip", gzip.compress(b"x" * 3_000_000), 4 << 20, budget)
    assert body == b"x" * 3_000_000 and held == 3_000_000
    assert budget.held["grpc"] == 3_000_000


def test_a_bomb_stops_at_the_message_limit_holding_nothing() -> None:
    budget = ByteBudget(1 << 30)
    with pytest.raises(Ended) as ended:
        inflate("gzip", BOMB, 8 << 20, budget)
    assert ended.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert budget.held["grpc"] == 0


def test_a_bomb_stops_where_the_budget_is_full_holding_nothing() -> None:
    budget = ByteBudget(4 * INFLATE_STEP)  # gRPC's share: three steps
    with pytest.raises(Ended) as ended:
        inflate("gzip", BOMB, 64 << 20, budget)
    assert ended.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "request_bytes_budget" in ended.value.message
    assert budget.held["grpc"] == 0


def test_what_does_not_inflate_is_an_internal_error_holding_nothing() -> None:
    budget = ByteBudget(1 << 30)
    for broken in (b"not gzip", gzip.compress(b"abc")[:-4], gzip.compress(b"a") + b"more"):
        with pytest.raises(Ended) as ended:
            inflate("gzip", broken, 1 << 20, budget)
        assert ended.value.code == grpc.StatusCode.INTERNAL
    assert budget.held["grpc"] == 0
