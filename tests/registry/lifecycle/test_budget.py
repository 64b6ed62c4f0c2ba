"""The budget's accounts: what fits, what goes first, on the machine and on each GPU."""

from __future__ import annotations

import pytest

from plugserve.registry.errors import PluginLoadError
from plugserve.registry.lifecycle import budget as budget_module
from plugserve.registry.lifecycle.budget import (
    IN_PROCESS,
    Held,
    LocalBudget,
    parse_budget,
    parse_gpu_budget,
)
from plugserve.registry.lifecycle.ledger import HOST, Ledger

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


def test_what_a_process_uses_beyond_its_versions_counts_and_is_shared_out() -> None:
    """A worker using 260 bytes for a and b (costs 100 and 0) and a load of 50 under way:
    110 unattributed, counted, and expected back in equal shares when a or b goes (b's
    load measured nothing, yet evicting it frees its share)."""
    ledger: Ledger = Ledger(300)
    ledger.measured(key("a"), key("a"), {HOST: 100}, group="worker 0")
    ledger.measured(key("b"), key("b"), {HOST: 0}, group="worker 0")
    ledger.reserve({HOST: 50}, "worker 0")
    ledger.sampled("worker 0", 260)
    assert ledger.unattributed == {"worker 0": 110}
    assert ledger.resident() == 210 and ledger.held(HOST) == 260
    assert ledger.over({HOST: 100}) == {HOST: 60}
    assert ledger.frees(key("b")) == {HOST: 55}
    assert ledger.victims([(1.0, key("b")), (2.0, key("a"))], {HOST: 100}) == [key("b"), key("a")]
    ledger.sampled("worker 0", 120)  # explained by its entries and its load: nothing more
    assert ledger.unattributed == {}


def test_a_reservation_lapses_and_a_version_measured_alone_is_read_again() -> None:
    ledger: Ledger = Ledger(1000)
    kept = ledger.reserve({HOST: 10}, lapses=5.0)
    ledger.reserve({HOST: 10})
    assert ledger.lapsed(4.9) == [] and ledger.lapsed(5.0) == [kept]
    ledger.measured(key("a"), key("a"), {HOST: 100})
    ledger.remeasured(key("a"), key("a"), 250)
    assert ledger.cost[key("a")] == {HOST: 250} and ledger.estimate(key("a")) == {HOST: 250}
    assert ledger.estimate(key("new"), least=400) == {HOST: 400}  # its model files at least


class NoVersions:
    """A registry holding nothing the budget counts."""

    def budgeted(self) -> list[Held]:
        return []

    async def evict(self, key: tuple[str, str, str], reason: str, only_idle: bool = False) -> None:
        raise AssertionError("nothing to evict")


def test_a_refused_load_being_let_go_is_attributed_and_evicts_nothing() -> None:
    """A load measured at 64 MiB against a 48 MiB budget is refused; until its instance is
    let go, a reading of the process sees those 64 MiB: they are the load's, not the
    process's own, and nothing is over the budget for them (the idle ``small`` stays)."""
    ledger: Ledger[tuple[str, str, str]] = Ledger(48 * MIB)
    small = ledger.reserve({HOST: 8 * MIB}, IN_PROCESS, float("inf"))
    ledger.measured(key("small"), key("small"), {HOST: 8 * MIB}, small, IN_PROCESS, True)
    big = ledger.reserve({HOST: 8 * MIB}, IN_PROCESS, float("inf"))
    assert ledger.refused(key("big"), {HOST: 64 * MIB}, big) is not None
    ledger.sampled(IN_PROCESS, 72 * MIB)
    assert ledger.unattributed == {} and ledger.over({}) == {}
    ledger.release(big)  # let go: its memory is back
    ledger.sampled(IN_PROCESS, 8 * MIB)
    assert ledger.over({}) == {} and ledger.reserved == {}


async def test_only_a_measure_taken_alone_refuses_a_version() -> None:
    """A load in the worker measured beside another is given a share of what grew beside
    both, which may be more than its own: it is counted, not refused; a measure taken
    alone over the whole budget is refused, and so is that version's next load."""
    budget = LocalBudget(100 * MIB, 0, NoVersions())
    shared = await budget.admit(key("a"), isolated=False)
    await budget.measured(shared, {HOST: 150 * MIB}, {}, sure=False)
    assert budget.ledger.cost[key("a")] == {HOST: 150 * MIB}
    alone = await budget.admit(key("b"), isolated=False)
    with pytest.raises(PluginLoadError, match="memory_budget"):
        await budget.measured(alone, {HOST: 150 * MIB}, {}, sure=True)
    assert key("b") not in budget.ledger.cost and budget.ledger.reserved  # until let go
    await budget.cancel(alone)
    assert budget.ledger.reserved == {}
    with pytest.raises(PluginLoadError, match="measured at 150 MiB"):
        await budget.admit(key("b"), isolated=False)


def test_what_a_version_takes_on_first_use_lands_in_room_held_for_it() -> None:
    """``a`` served at 150 (100 from its load, 50 taken serving): ``b``'s load, never seen,
    is admitted at 150 (the mean of the versions' peaks); measured at 100, the other 50
    stay held for its first use, so that the 50 it takes serving is in room already
    made, and are given back once it has served."""
    w0 = "worker 0"
    ledger: Ledger = Ledger(300)
    ledger.measured(key("a"), key("a"), {HOST: 100}, group=w0)
    ledger.sampled(w0, 150)
    assert ledger.peak[key("a")] == {HOST: 150}
    estimate = ledger.estimate(key("b"), group=w0)
    assert estimate == {HOST: 150}
    ticket = ledger.reserve(estimate, w0)
    ledger.measured(key("b"), key("b"), {HOST: 100}, ticket, group=w0)
    assert ledger.reserved == {ticket: {HOST: 50}} and ledger.first_use == {ticket: key("b")}
    assert ledger.held(HOST) == 300 and ledger.over({HOST: 1}) == {HOST: 1}  # no room left
    assert ledger.frees(key("b")) == {HOST: 150}  # its hold goes with it
    ledger.sampled(w0, 300)  # b took its 50 serving: in its hold, not unattributed
    assert ledger.unattributed == {w0: 50} and ledger.held(HOST) == 300
    assert key("b") not in ledger.peak  # not served yet
    ledger.served([key("b")])
    assert ledger.reserved == {} and ledger.first_use == {}
    ledger.sampled(w0, 300)
    assert ledger.unattributed == {w0: 100} and ledger.held(HOST) == 300
    assert ledger.peak[key("b")] == {HOST: 150}


def test_a_version_s_served_peak_outlives_it_and_estimates_loads_elsewhere() -> None:
    """``a`` served at 150 in worker 0 and was evicted: its next load, into an empty
    worker, is estimated at 150 (not its load's 100), a never-seen version's too; an
    isolated load keeps its own measure."""
    ledger: Ledger = Ledger(1000)
    ledger.measured(key("a"), key("a"), {HOST: 100}, group="worker 0")
    ledger.sampled("worker 0", 150)
    ledger.forget(key("a"))
    ledger.sampled("worker 0", 0)
    assert ledger.estimate(key("a"), group="worker 0") == {HOST: 150}
    assert ledger.estimate(key("new"), group="worker 1") == {HOST: 150}
    assert ledger.estimate(key("new"), least=400, group="worker 1") == {HOST: 400}
    assert ledger.estimate(key("a")) == {HOST: 100}


def test_evicting_a_version_gives_back_what_was_held_for_its_first_use() -> None:
    ledger: Ledger = Ledger(1000)
    ledger.peak[key("a")] = {HOST: 150}
    ticket = ledger.reserve(ledger.estimate(key("a"), group="worker 0"), "worker 0")
    ledger.measured(key("a"), key("a"), {HOST: 100}, ticket, group="worker 0")
    assert ledger.reserved == {ticket: {HOST: 50}}
    ledger.forget(key("a"))
    assert ledger.reserved == {} and ledger.first_use == {} and ledger.held(HOST) == 0


class Serving:
    """A registry holding ``a`` in this process, served or not yet."""

    def __init__(self) -> None:
        self.served = False

    def budgeted(self) -> list[Held]:
        return [Held(key("a"), 1.0, False, True, False, None, self.served)]

    async def evict(self, key: tuple[str, str, str], reason: str, only_idle: bool = False) -> None:
        raise AssertionError("nothing to evict")


async def test_a_version_s_first_use_is_held_until_a_reading_after_it_has_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The process's memory, read before ``a`` has served, leaves its hold in place; the
    first reading once it has served gives it back and counts what it took."""
    used = [0]
    monkeypatch.setattr(budget_module, "resident", lambda pid=None: used[0])
    registry = Serving()
    budget = LocalBudget(1000 * MIB, 0, registry)
    budget._sample()  # the process before any load
    budget.ledger.peak[key("a")] = {HOST: 150 * MIB}
    admission = await budget.admit(key("a"), isolated=False)
    used[0] = 100 * MIB
    await budget.measured(admission, {HOST: 100 * MIB}, {})
    assert budget.ledger.reserved == {admission.ticket: {HOST: 50 * MIB}}
    used[0] = 150 * MIB  # its first request takes 50 more
    budget._sample()
    assert budget.ledger.reserved and budget.ledger.unattributed == {}
    registry.served = True
    budget._sample()
    assert budget.ledger.reserved == {}
    assert budget.ledger.unattributed == {IN_PROCESS: 50 * MIB}
    assert budget.ledger.held(HOST) == 150 * MIB
