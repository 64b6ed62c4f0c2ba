import pytest

from registry.ratelimit import RateLimit, TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_the_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(RateLimit(rps=2, burst=3), clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.5)
    clock.now += 0.5
    assert bucket.take() == 0.0
    assert bucket.take() == pytest.approx(0.5)
    clock.now += 10
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]  # never more than the burst
    assert bucket.take() > 0


@pytest.mark.parametrize(
    ("raw", "message"),
    [({"rps": 0}, "rps: must be"), ({"rps": 1, "burst": 0}, "burst: must be"), (5, "must be a table"),
     ({"rps": 1, "per": "minute"}, "must be a table")],
)  # fmt: skip
def test_invalid_limits(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RateLimit.parse(raw)


def test_burst_defaults_to_one_second_of_rate() -> None:
    assert RateLimit.parse({"rps": 20}) == RateLimit(20.0, 20)
    assert RateLimit.parse({"rps": 0.5}) == RateLimit(0.5, 1)
