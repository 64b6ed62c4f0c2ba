"""Loads under a memory budget in one process: side by side, measured never below zero,
every admission settled, refused before evicting where the outcome is known, and the
process's real memory kept within the budget as its versions serve."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plugserve.registry.errors import PluginLoadError, Unavailable
from plugserve.registry.lifecycle.budget import (
    Admission,
    LocalBudget,
    release_memory,
    resident,
)
from plugserve.registry.lifecycle.ledger import HOST, Cost, Key
from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.types import RequestContext
from tests.helpers import write_plugin

MIB = 2**20

RUNNER = """
    import os
    import time

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Runner:
        def __init__(self, config):
            gate = config.get("gate")
            deadline = time.monotonic() + 30
            while gate and not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.02)  # a load that hangs until the test opens its gate
            if config.get("fail"):
                raise RuntimeError("this load fails")
            self.mib = config.get("mib", 0)
            self.weights = np.ones(self.mib * 1024 * 1024 // 8) if config.get("eager") else None

        def infer(self, inputs):
            if self.weights is None and self.mib:  # allocates on first use
                self.weights = np.ones(self.mib * 1024 * 1024 // 8)
            return {"y": np.asarray(inputs["x"]) * 2}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Runner(config)
"""


def write(plugins_dir: Path, name: str, config: str = "", runner: str = "") -> Key:
    write_plugin(
        plugins_dir, "runner", name, "1.0.0",
        f'[config]\n{config}\n[runner]\nload = "on_demand"\n{runner}',
        files={"plugin.py": RUNNER},
    )  # fmt: skip
    return ("runner", name, "1.0.0")


def budgeted(plugins_dir: Path, models_dir: Path, limit: int, **kwargs: Any) -> Registry:
    return Registry(plugins_dir, models_dir, drain_timeout=2, memory_budget=limit, **kwargs)


def ledger(registry: Registry) -> LocalBudget:
    assert isinstance(registry.budget, LocalBudget)
    return registry.budget


def loads_held(registry: Registry) -> set[int]:
    """The estimates held for loads under way (not those held for a first use)."""
    accounts = ledger(registry).ledger
    return set(accounts.reserved) - set(accounts.first_use)


async def serve(registry: Registry, name: str) -> None:
    """One request to ``name``, loading it on demand first."""
    await registry.demand([("runner", name, "1.0.0")], within=30)
    chain = registry.routes.resolve(name, None)
    ctx = RequestContext("id", name, {}, {}, "application/json")
    await chain.run({"x": np.ones((1, 4), np.float32)}, ctx)


async def until(check: Any, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_hung_load_holds_no_other_version_s_load(
    plugins_dir: Path, models_dir: Path, tmp_path: Path
) -> None:
    """``slow`` hangs in its load; ``tiny``, asked for after it, loads and serves
    meanwhile: loads under a budget run side by side, each holding its estimate."""
    gate = tmp_path / "gate"
    slow = write(plugins_dir, "slow", f'gate = "{gate}"')
    tiny = write(plugins_dir, "tiny")
    registry = budgeted(plugins_dir, models_dir, 512 * MIB)
    try:
        await registry.start()
        hung = asyncio.ensure_future(registry.demand([slow], within=30))
        assert await until(lambda: registry.records[slow].state == "loading")
        await asyncio.wait_for(serve(registry, "tiny"), 10)
        assert registry.records[tiny].state == "ready"
        assert registry.records[slow].state == "loading"
        assert len(loads_held(registry)) == 1  # slow's estimate, held
        gate.touch()
        await hung
        assert registry.records[slow].state == "ready"
        assert loads_held(registry) == set()
    finally:
        gate.touch()
        await registry.close()


async def test_memory_given_back_beside_a_load_never_makes_its_measure_negative(
    plugins_dir: Path, models_dir: Path, tmp_path: Path
) -> None:
    """64 MiB this process held is given back while a version loads: the load's share
    of the process's growth is not below zero."""
    gate = tmp_path / "gate"
    key = write(plugins_dir, "a", f'gate = "{gate}"')
    registry = budgeted(plugins_dir, models_dir, 512 * MIB)
    ballast: np.ndarray | None = np.ones(64 * MIB // 8)
    try:
        await registry.start()
        loading = asyncio.ensure_future(registry.demand([key], within=30))
        assert await until(lambda: registry.records[key].state == "loading")
        before = resident()
        ballast = None
        gc.collect()
        release_memory()
        assert resident() < before - 32 * MIB  # given back to the system
        gate.touch()
        await loading
        assert registry.records[key].memory_bytes is not None
        assert registry.records[key].memory_bytes >= 0
        assert ledger(registry).ledger.cost[key][HOST] >= 0
    finally:
        gate.touch()
        del ballast
        await registry.close()


class Recording:
    """A budget that admits everything and notes how each admission was settled;
    ``measured`` does what ``outcome`` says."""

    gpus = False

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome
        self.admitted: list[int] = []
        self.settled: list[tuple[int, str]] = []

    async def admit(self, key: Key, isolated: bool, least: int = 0) -> Admission:
        self.admitted.append(len(self.admitted) + 1)
        return Admission(key, self.admitted[-1])

    async def measured(
        self, admission: Admission, cost: Cost, totals: dict[str, int], sure: bool = True
    ) -> None:
        assert cost[HOST] >= 0
        if self.outcome == "lost":
            raise Unavailable("the memory budget is not answering", retry_after_s=1)
        self.settled.append((admission.ticket, "measured"))
        if self.outcome == "refused":
            raise PluginLoadError("over the whole memory_budget")

    async def cancel(self, admission: Admission) -> None:
        self.settled.append((admission.ticket, "cancel"))

    async def gone(self, key: Key) -> None:
        pass

    async def watch(self) -> None:
        pass

    def describe(self) -> None:
        return None


@pytest.mark.parametrize(
    ("config", "outcome", "state", "settled"),
    [
        ("", "ok", "ready", ("measured",)),
        ("fail = true", "ok", "failed", ("cancel",)),
        ('gate = "{never}"', "ok", "failed", ("cancel",)),  # past load_timeout
        ("", "lost", "ready", ("cancel",)),  # the measure never reached the budget
        # over the whole budget: its estimate held until the instance is let go
        ("", "refused", "failed", ("measured", "cancel")),
    ],
    ids=["measured", "failed", "timed-out", "measure-lost", "refused"],
)
async def test_every_admission_is_settled_once_whatever_becomes_of_the_load(
    plugins_dir: Path, models_dir: Path, tmp_path: Path,
    config: str, outcome: str, state: str, settled: tuple[str, ...],
) -> None:  # fmt: skip
    key = write(plugins_dir, "a", config.format(never=tmp_path / "never"))
    budget = Recording(outcome)
    registry = budgeted(plugins_dir, models_dir, 512 * MIB, load_timeout=0.5,
                        budget=lambda _: budget)  # fmt: skip
    try:
        await registry.sync()
        await registry.load(registry.folder_of(key), demanded=True)
        assert registry.records[key].state == state
        assert budget.settled == [(1, each) for each in settled]
    finally:
        await registry.close()


async def test_a_load_that_will_fail_evicts_nothing(plugins_dir: Path, models_dir: Path) -> None:
    """``a`` fills the budget; ``broken`` names a model file that does not exist: its load
    fails before the budget makes room, and ``a`` stays."""
    a = write(plugins_dir, "a", "mib = 24\neager = true")
    broken = write(plugins_dir, "broken", runner='model = "missing.onnx"')
    registry = budgeted(plugins_dir, models_dir, 30 * MIB)
    try:
        await registry.start()
        await serve(registry, "a")
        await registry.demand([broken], within=30)
        assert registry.records[broken].state == "failed"
        assert "missing.onnx" in (registry.records[broken].last_error or "")
        assert registry.records[a].state == "ready"
        assert registry.evictions == {}
        assert ledger(registry).ledger.reserved == {}
    finally:
        await registry.close()


async def test_a_version_over_the_whole_budget_is_refused_and_evicts_nothing(
    plugins_dir: Path, models_dir: Path
) -> None:
    """``big`` measures 64 MiB against a budget of 48: it is not served (its error names
    memory_budget), the idle ``a`` is not evicted for it, and its next load is refused
    before it begins."""
    a = write(plugins_dir, "a", "mib = 8\neager = true")
    big = write(plugins_dir, "big", "mib = 64\neager = true")
    registry = budgeted(plugins_dir, models_dir, 48 * MIB)
    try:
        await registry.start()
        await serve(registry, "a")
        await registry.demand([big], within=30)
        record = registry.records[big]
        assert record.state == "failed" and record.current is None
        assert "memory_budget" in (record.last_error or ""), record.last_error
        assert registry.records[a].state == "ready"
        assert registry.evictions == {}
        loads = registry.loads["demand"]
        record.state = "available"  # asked again
        await registry.demand([big], within=30)
        assert record.state == "failed" and registry.loads["demand"] == loads
        assert "memory_budget" in (record.last_error or "")
        assert loads_held(registry) == set()
        assert big not in ledger(registry).ledger.cost
    finally:
        await registry.close()


async def test_memory_taken_as_versions_serve_evicts_the_least_recently_used(
    plugins_dir: Path, models_dir: Path
) -> None:
    """Each version measures next to nothing at its load and takes 32 MiB on its first
    request: the budget reads the process as they serve and evicts the least recently
    used until the process's growth is within the budget again."""
    names = ["a", "b", "c", "d", "e"]
    for name in names:
        write(plugins_dir, name, "mib = 32")
    registry = budgeted(plugins_dir, models_dir, 80 * MIB)
    try:
        await registry.start()
        base = resident()
        for name in names:
            await serve(registry, name)
        budget = ledger(registry)

        def within() -> bool:  # a few MiB of slack: this process's own noise
            return resident() - base <= 84 * MIB and not budget.ledger.over({})

        assert await until(within), (resident() - base) / MIB
        states = {name: registry.records[("runner", name, "1.0.0")].state for name in names}
        assert states["e"] == "ready" and states["a"] == "available", states
        assert sum(registry.evictions.values()) >= 3  # two of 32 MiB fit in 80
        status = budget.describe()
        assert status["resident_bytes"] <= status["budget_bytes"], status
    finally:
        await registry.close()
