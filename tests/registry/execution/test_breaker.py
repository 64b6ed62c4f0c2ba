"""The circuit breaker's state machine, on a fake clock."""

import pytest

from plugserve.registry.errors import Unavailable
from plugserve.registry.execution.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_probes_then_closes() -> None:
    clock = Clock()
    breaker = CircuitBreaker("runner/r@1.0.0", failures=3, reset_s=10, clock=clock)
    for _ in range(2):
        breaker.allow()
        breaker.failure()
    breaker.allow()
    breaker.success()  # a success in between resets the count
    for _ in range(3):
        breaker.allow()
        breaker.failure()
    assert breaker.state == "open"
    assert breaker.trips == 1
    with pytest.raises(Unavailable, match=r"circuit open, next try in 10\.0 s") as info:
        breaker.allow()
    assert info.value.fields["circuit"] == "open"
    clock.now += 9.9
    with pytest.raises(Unavailable):
        breaker.allow()
    clock.now += 0.2
    breaker.allow()  # the probe goes through
    assert breaker.state == "half_open"
    with pytest.raises(Unavailable, match="being probed"):
        breaker.allow()  # one probe at a time
    breaker.success()
    assert breaker.state == "closed"
    breaker.allow()


def test_a_failed_probe_opens_the_circuit_again() -> None:
    clock = Clock()
    breaker = CircuitBreaker("r", failures=1, reset_s=5, clock=clock)
    breaker.allow()
    breaker.failure()
    clock.now += 5
    breaker.allow()
    breaker.failure()
    assert breaker.state == "open"
    assert breaker.opened_at == clock.now
    with pytest.raises(Unavailable):
        breaker.allow()


def test_a_probe_that_ends_without_a_verdict_frees_the_slot() -> None:
    clock = Clock()
    breaker = CircuitBreaker("r", failures=1, reset_s=1, clock=clock)
    breaker.allow()
    breaker.failure()
    clock.now += 1
    breaker.allow()
    breaker.release()  # say the probe was a bad request: nothing learned
    breaker.allow()
    assert breaker.state == "half_open"


def test_zero_failures_disables_it() -> None:
    breaker = CircuitBreaker("r", failures=0)
    for _ in range(100):
        breaker.allow()
        breaker.failure()
    assert breaker.state == "closed"
