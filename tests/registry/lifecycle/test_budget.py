"""The budget's accounts: what fits, what goes first, on the machine and on each GPU."""

from __future__ import annotations

import pytest

from plugserve.registry.lifecycle.budget import HOST, Ledger, parse_budget, parse_gpu_budget

MIB = 2**20


def key(name: str) -> tuple[str, str, str]:
    return ("runner", name, "1.0.0")


def ledger_with(limit: int, gpu_limit: int | float = 0, **costs: dict[str, int]) -> Ledger:
    ledger: Ledger = Ledger(limit, gpu_limit)
    for name, cost in costs.items():
        ledger.measured(key(name), key(name), cost)
    return ledger


def test_victims_are_the_least_recently_used_until_the_load_fits() -> None:
    ledger = ledger_with(300, a={HOST: 100}, b={HOST: 100}, c={HOST: 100})
    used = [(3.0, key("a")), (1.0, key("b")), (2.0, key("c"))]
    assert ledger.victims(used, {HOST: 100}) == [key("b")]
    assert ledger.victims(used, {HOST: 150}) == [key("b"), key("c")]
    assert ledger.victims(used, {}) == []  # it fits as it is
    assert ledger.victims([(1.0, key("unknown"))], {HOST: 100}) == []  # not counted: not ours


def test_loads_under_way_count_until_measured() -> None:
    ledger = ledger_with(300, a={HOST: 100})
    ticket = ledger.reserve({HOST: 150})
    assert ledger.over({HOST: 100}) == {HOST: 50}
    ledger.measured(key("b"), key("b"), {HOST: 120}, ticket)
    assert ledger.reserved == {} and ledger.resident() == 220
    assert ledger.estimate(key("b")) == {HOST: 120}
    assert ledger.estimate(key("new")) == {HOST: 110}  # the mean of what was measured


def test_a_gpu_short_of_room_evicts_only_what_frees_room_there() -> None:
    gib = 1024 * MIB
    ledger = ledger_with(
        0, 13 * gib,
        d={HOST: MIB, "cuda:1": 6 * gib},
        a={HOST: MIB, "cuda:0": 6 * gib},
        b={HOST: MIB, "cuda:0": 6 * gib},
    )  # fmt: skip
    used = [(1.0, key("d")), (2.0, key("a")), (3.0, key("b"))]
    assert ledger.over({HOST: 10 * gib}) == {}  # no bound on the machine's memory
    assert ledger.over({"cuda:0": 6 * gib}) == {"cuda:0": 5 * gib}
    assert ledger.victims(used, {"cuda:0": 6 * gib}) == [key("a")]  # d frees nothing there
    assert ledger.victims(used, {"cuda:1": 8 * gib}) == [key("d")]


def test_a_gpu_share_is_of_each_devices_size_once_read() -> None:
    ledger: Ledger = Ledger(0, 0.5)
    assert ledger.limit_of("cuda:0") is None  # its size not read yet: nothing to bound by
    ledger.totals["cuda:0"] = 16 * 1024 * MIB
    assert ledger.limit_of("cuda:0") == 8 * 1024 * MIB
    assert ledger.limit_of(HOST) is None


@pytest.mark.parametrize(
    ("text", "value"),
    [("80%", 0.8), ("20GiB", 20 * 1024 * MIB), (0, 0), ("100%", 1.0), (4096, 4096)],
)
def test_gpu_budgets(text: int | str, value: float) -> None:
    assert parse_gpu_budget(text) == value


@pytest.mark.parametrize("text", ["0%", "101%", "x%", "lots", -1, True])
def test_refused_gpu_budgets(text: int | str) -> None:
    with pytest.raises(ValueError, match="gpu_memory_budget"):
        parse_gpu_budget(text)


def test_memory_budgets() -> None:
    assert parse_budget("512MiB") == 512 * MIB
    assert parse_budget("1.5G") == int(1.5 * 1024 * MIB)
    with pytest.raises(ValueError):
        parse_budget("-5")
