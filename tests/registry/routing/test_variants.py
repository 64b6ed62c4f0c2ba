"""Weighted choice and sticky keys: shares within tolerance, stable keys, minimal movement."""

from collections import Counter

import pytest

from plugserve.registry.routing.variants import Candidate, WeightedChoice, salt_of

KEYS = [f"user-{i}".encode() for i in range(20_000)]


def choice(**weights: int) -> WeightedChoice[str]:
    return WeightedChoice([Candidate(k, w, k, salt_of(k)) for k, w in weights.items()])


def shares(picks: Counter[str]) -> dict[str, float]:
    total = sum(picks.values())
    return {k: v / total for k, v in picks.items()}


@pytest.mark.parametrize(
    "weights", [{"a": 90, "b": 10}, {"a": 50, "b": 30, "c": 20}, {"a": 1, "b": 99}]
)
def test_sticky_keys_split_by_weight(weights: dict[str, int]) -> None:
    picks = Counter(choice(**weights).pick(key).label for key in KEYS)
    total = sum(weights.values())
    for label, weight in weights.items():
        # 20 000 keys: the binomial standard deviation is under 0.4 %; allow 1.5 %.
        assert shares(picks)[label] == pytest.approx(weight / total, abs=0.015)


def test_random_picks_split_by_weight() -> None:
    c = choice(a=80, b=15, c=5)
    got = shares(Counter(c.pick().label for _ in range(40_000)))
    assert got == pytest.approx({"a": 0.80, "b": 0.15, "c": 0.05}, abs=0.01)


def test_same_key_same_variant_while_weights_stand() -> None:
    first = choice(a=70, b=30)
    again = choice(b=30, a=70)  # rebuilt, in another order: what a new route table does
    for key in KEYS[:2000]:
        label = first.pick(key).label
        assert first.pick(key).label == label
        assert again.pick(key).label == label


def test_a_variant_that_leaves_hands_only_its_keys_on_in_proportion() -> None:
    full = choice(a=50, b=30, c=20)
    before = {key: full.pick(key).label for key in KEYS}
    after_choice = full.without({"c"})
    after = {key: after_choice.pick(key).label for key in KEYS}
    # Keys that were not on c stay where they were ...
    assert all(after[k] == v for k, v in before.items() if v != "c")
    # ... and c's keys spread over a and b as 50:30.
    moved = Counter(after[k] for k, v in before.items() if v == "c")
    assert shares(moved)["a"] == pytest.approx(50 / 80, abs=0.03)
    assert set(after.values()) == {"a", "b"}


def test_raising_a_weight_moves_keys_only_towards_that_variant() -> None:
    before = choice(stable=90, canary=10)
    after = choice(stable=50, canary=50)
    moves = Counter((before.pick(k).label, after.pick(k).label) for k in KEYS)
    assert moves[("canary", "stable")] == 0
    assert shares(Counter(after.pick(k).label for k in KEYS))["canary"] == pytest.approx(
        0.5, abs=0.015
    )


def test_zero_weight_takes_nothing_and_share_reports_the_split() -> None:
    c = choice(a=3, b=1, z=0)
    assert {c.pick(k).label for k in KEYS[:500]} == {"a", "b"}
    assert (c.share("a"), c.share("b"), c.share("z")) == (0.75, 0.25, 0.0)
    assert not choice(z=0)
