import subprocess
import sys
from pathlib import Path

import pytest

from plugserve.registry.errors import MAX_RETRY_AFTER_S, TooManyRequests
from plugserve.registry.ratelimit import (
    MIN_RPS,
    RateLimit,
    SharedTokenBucket,
    TokenBucket,
    shared_bucket_path,
)


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


@pytest.mark.parametrize(
    "rps", [1e-300, 0.0009, float("inf"), float("nan"), 1e999, 10**400, 2_000_000, True, "5"]
)
def test_rates_out_of_bounds_are_refused(rps: object) -> None:
    """issue 12, findings 1 and 18: inf (OverflowError before), nan ("cannot convert float
    NaN to integer" before) and absurdly small rates are refused at parse time."""
    with pytest.raises(ValueError, match=r"^rps: must be a finite number >= 0.001 and <= 1e\+06"):
        RateLimit.parse({"rps": rps})


def test_the_smallest_rate_waits_at_most_its_documented_bound() -> None:
    clock = Clock()
    bucket = TokenBucket(RateLimit.parse({"rps": MIN_RPS}), clock)
    assert bucket.take() == 0.0
    assert bucket.take() == pytest.approx(1 / MIN_RPS)


@pytest.mark.parametrize(
    ("seconds", "header"),
    [(10**300, "3600"), (1e300, "3600"), (float("inf"), "3600"), (float("nan"), "1"),
     (0.2, "1"), (-5, "1"), (2.5, "3"), (3600, "3600"), (3601, "3600")],
)  # fmt: skip
def test_retry_after_is_whole_seconds_from_1_to_an_hour(seconds: float, header: str) -> None:
    """issue 12, finding 18: ``rps = 1e-300`` gave a Retry-After of ~300 digits."""
    error = TooManyRequests("over the limit", retry_after_s=seconds)
    assert error.headers() == {"Retry-After": header}
    assert error.to_json()["retry_after_s"] == int(header)
    assert MAX_RETRY_AFTER_S == 3600


def test_a_shared_bucket_is_one_bucket_for_every_process(tmp_path: Path) -> None:
    """Issue 13: with several workers a route's rate limit is the server's, not each worker's."""
    clock = Clock()
    limit = RateLimit(rps=2, burst=3)
    path = shared_bucket_path(tmp_path, "iris", limit)
    first = SharedTokenBucket(limit, path, clock)
    second = SharedTokenBucket(limit, path, clock)  # another worker maps the same file
    assert [first.take(), second.take(), first.take()] == [0.0, 0.0, 0.0]
    assert second.take() == pytest.approx(0.5)
    clock.now += 0.5
    assert second.take() == 0.0
    assert first.take() == pytest.approx(0.5)
    clock.now += 10
    assert [second.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert first.take() > 0
    # A later worker joins the bucket as it stands; it does not refill it.
    assert SharedTokenBucket(limit, path, clock).take() > 0
    # A changed limit is a fresh bucket, as in one process.
    assert shared_bucket_path(tmp_path, "iris", RateLimit(rps=3, burst=3)) != path


def test_shared_buckets_across_processes(tmp_path: Path) -> None:
    limit = RateLimit(rps=MIN_RPS, burst=50)
    path = shared_bucket_path(tmp_path, "iris", limit)
    script = (
        "import sys; from pathlib import Path; from registry.ratelimit import *\n"
        "b = SharedTokenBucket(RateLimit(rps=0.001, burst=50), Path(sys.argv[1]))\n"
        "print(sum(b.take() == 0.0 for _ in range(40)))\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE)
        for _ in range(3)
    ]
    granted = [int(p.communicate()[0]) for p in procs]
    assert sum(granted) == 50  # 120 asked, the burst granted once in all
