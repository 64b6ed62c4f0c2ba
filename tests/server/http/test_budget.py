"""The process's byte budget for requests (server/http/budget.py)."""

from __future__ import annotations

import threading

from plugserve.server.http.budget import ByteBudget


def test_each_protocol_holds_at_most_its_share_and_both_the_whole() -> None:
    budget = ByteBudget(1000)
    assert budget.take("grpc", 700)
    assert not budget.take("grpc", 51)  # three quarters at most: HTTP keeps room
    assert budget.take("http", 300)
    assert not budget.take("http", 1)  # the whole is held
    assert budget.refused == {"http": 1, "grpc": 1}
    budget.give("grpc", 700)
    assert budget.take("http", 450)
    assert budget.held == {"http": 750, "grpc": 0}
    assert "request_bytes_budget = 1000" in budget.refusal()


def test_threads_taking_and_giving_leave_it_balanced() -> None:
    budget = ByteBudget(1 << 30)

    def churn() -> None:
        for _ in range(20_000):
            if budget.take("grpc", 3):
                budget.give("grpc", 3)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert budget.held == {"http": 0, "grpc": 0}


def test_an_http_refusal_is_503_with_retry_after() -> None:
    error = ByteBudget(10).unavailable()
    assert error.status == 503 and error.headers() == {"Retry-After": "1"}
