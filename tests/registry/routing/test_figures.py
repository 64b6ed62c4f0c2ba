"""Window figures: quantiles within a bucket, exact merges, and a round trip through JSON
that refuses what is not figures."""

from __future__ import annotations

import math

import pytest

from plugserve.registry.routing.figures import (
    VariantFigures,
    WindowFigures,
    Windows,
    cohort_of,
    parse_windows,
)


def test_quantiles_fall_within_a_bucket_of_the_truth() -> None:
    figures = VariantFigures()
    samples = [0.001 * (i + 1) for i in range(1000)]  # 1 ms .. 1 s
    for s in samples:
        figures.record(200, s)
    for q in (0.5, 0.99):
        truth = samples[math.ceil(q * 1000) - 1]
        assert abs(figures.quantile(q) - truth) / truth < 0.1  # type: ignore[operator]
    assert VariantFigures().quantile(0.5) is None


def test_merged_windows_count_as_one() -> None:
    one, two, both = WindowFigures(), WindowFigures(), WindowFigures()
    for i in range(300):
        target = one if i % 3 else two
        for each in (target, both):
            status = (200, 500, 400)[i % 3 if i % 10 == 0 else 0]
            each.variant("a").record(status, 0.002 * (i % 7 + 1), f"u{i % 40}".encode())
            each.shadow.record(i % 4 != 0, {"y": i / 1000})
    merged = WindowFigures()
    merged.add(WindowFigures.from_json(one.as_json()))
    merged.add(WindowFigures.from_json(two.as_json()))
    assert merged.summary() == both.summary()


def test_what_counts_is_the_versions_doing_not_the_clients() -> None:
    """A 4xx is only tallied as refused; a 5xx is an error, without a latency; a success
    counts its latency; all of one key's requests are in one cohort."""
    figures = VariantFigures()
    figures.record(400, 0.001, b"k")
    figures.record(499, 0.001, b"k")
    figures.record(500, 2.0, b"k")
    figures.record(504, 3.0, b"k")
    figures.record(200, 0.01, b"k")
    assert (figures.refused, figures.requests, figures.errors) == (2, 3, 2)
    (tally,) = figures.cohorts.values()
    assert tally.samples == 1 and figures.quantile(0.99) == pytest.approx(0.01, rel=0.1)
    assert cohort_of(b"k") == cohort_of(b"k") and set(figures.cohorts) == {cohort_of(b"k")}


def test_windows_keep_one_window_per_route_and_forget_ended_ones() -> None:
    windows = Windows()
    windows.window("m", "id/1").variant("a").record(200, 0.01)
    windows.window("m", "id/2").variant("a").record(500, 0.01)  # a new window: counts anew
    assert windows.get("m", "id/1") is None
    assert windows.get("m", "id/2").variant("a").errors == 1  # type: ignore[union-attr]
    windows.window("n", "x/1")
    windows.keep({"m": "id/2"})
    assert set(parse_windows(windows.as_json())) == {"m"}


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {"m": {"figures": {}}},
        {"m": {"key": "k", "figures": {"variants": {"a": {"refused": -1}}}}},
        {"m": {"key": "k", "figures": {"variants": {"a": {"cohorts": {"0": {"requests": -1}}}}}}},
        {"m": {"key": "k", "figures": {"variants": {"a": {"cohorts": {"99": {}}}}}}},
        {"m": {"key": "k", "figures": {"variants": {"a": {"cohorts": {"x": {}}}}}}},
        {
            "m": {
                "key": "k",
                "figures": {"variants": {"a": {"cohorts": {"0": {"latency": {"9999": 1}}}}}},
            }
        },
        {"m": {"key": "k", "figures": {"shadow": {"largest": {"y": "big"}}}}},
    ],
)
def test_figures_from_another_process_are_checked(raw: object) -> None:
    with pytest.raises(ValueError):
        parse_windows(raw)
