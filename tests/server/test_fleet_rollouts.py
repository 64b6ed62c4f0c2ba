"""Rollouts in a fleet: three replicas as real subprocesses sharing a real etcd. One
replica decides (the lease holder) from every replica's figures; killed mid-rollout,
another goes on from the same step; every replica restarted, the rollout resumes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from plugserve.registry.fleet.etcd import EtcdClient
from tests.etcd import EtcdProcess
from tests.helpers import ServerProcess
from tests.server.rollout_helpers import (
    Load,
    put_rollout,
    rollout,
    until,
    write_config,
    write_model,
)

STABLE, CANARY = "m@1.0.0", "m@2.0.0"


def replicas(
    tmp_path: Path, models_dir: Path, etcd: EtcdProcess, server: Callable[..., ServerProcess],
    count: int = 3, **canary: float,
) -> list[ServerProcess]:  # fmt: skip
    config = write_config(tmp_path / "plugserve.toml", rollout_interval_s=0.2,
                          fleet_lease_ttl_s=2)  # fmt: skip
    started = []
    for i in range(count):
        plugins = tmp_path / f"plugins{i}"
        if not plugins.exists():
            write_model(plugins, "1.0.0")
            write_model(plugins, "2.0.0", **canary)
        started.append(server(
            "--plugins-dir", str(plugins), "--models-dir", str(models_dir), "--config",
            str(config), "--registry", etcd.url("/rollouts"), "--replica-id", f"r{i}",
            ready=False,
        ))  # fmt: skip
    return [r.wait_ready() for r in started]


async def _put(etcd: EtcdProcess, key: str, value: bytes) -> None:
    client = EtcdClient((etcd.endpoint,))
    try:
        await client.put(key, value)
    finally:
        await client.close()


def deciders(fleet: list[ServerProcess]) -> list[int]:
    return [i for i, r in enumerate(fleet) if rollout(r).get("decided_here")]


def history(state: dict[str, Any]) -> list[tuple[str, int, str]]:
    return [(d["decision"], d["step"], d["by"]) for d in state["status"]["history"]]


@pytest.mark.workers(1)
def test_the_deciding_replica_killed_another_goes_on_and_a_restart_of_all_resumes(
    tmp_path: Path, models_dir: Path, etcd: EtcdProcess, server: Callable[..., ServerProcess]
) -> None:
    fleet = replicas(tmp_path, models_dir, etcd, server)
    policy = {"canary": CANARY, "steps": [10, 25, 50, 75, 100], "min_requests": 20,
              "min_seconds": 1.5}  # fmt: skip
    put_rollout(fleet[1], {"runner": STABLE, "rollout": policy})
    load = Load(fleet, clients=6)
    with load:
        until(lambda: rollout(fleet[0])["status"]["step"] >= 1, 60, "a first step")
        (leader,) = deciders(fleet)  # exactly one replica decides
        survivors = [r for i, r in enumerate(fleet) if i != leader]
        load.servers = survivors
        step = rollout(survivors[0])["status"]["step"]
        fleet[leader].proc.kill()  # no goodbye: its lease runs out
        fleet[leader].proc.wait()
        until(lambda: rollout(survivors[0])["status"]["step"] > step + 1, 60, "steps go on")
        until(lambda: len(deciders(survivors)) == 1, 10, "one decider")
    state = rollout(survivors[0])
    moves = history(state)
    assert [s for _, s, _ in moves] == list(range(len(moves)))  # no step skipped or repeated
    ids = {f"r{i}" for i in range(3)}
    assert {by for _, _, by in moves[:step]} == {f"r{leader}"}
    assert moves[step + 1][2] in ids - {f"r{leader}"}
    failures = load.failures()
    assert not failures, failures  # no request failed because of a step or a takeover
    # Every replica stops mid-rollout; started again, they take it up where it stood.
    for replica in survivors:
        replica.stop()
    stood = state["status"]["step"]
    again = replicas(tmp_path, models_dir, etcd, server)
    assert {rollout(r)["status"]["step"] for r in again} == {stood}
    with Load(again, clients=6) as after:
        until(lambda: rollout(again[2])["status"]["state"] == "promoted", 90, "promotion")
    final = history(rollout(again[0]))
    assert [d for d, _, _ in final] == ["advance"] * 4 + ["promote"]
    assert [s for _, s, _ in final] == [0, 1, 2, 3, 4]
    assert not after.failures(), after.failures()


@pytest.mark.workers(1, 2)
def test_a_failing_canary_is_rolled_back_for_the_whole_fleet_from_every_replicas_figures(
    tmp_path: Path, models_dir: Path, etcd: EtcdProcess, server: Callable[..., ServerProcess]
) -> None:
    # A decider key written by hand (under no lease, naming no replica) holds nobody back.
    asyncio.run(_put(etcd, "/rollouts/rollouts/decider", b"ghost"))
    fleet = replicas(tmp_path, models_dir, etcd, server, fail_every=20)
    policy = {"canary": CANARY, "steps": [10, 50, 100], "min_requests": 90, "min_seconds": 600}
    put_rollout(fleet[0], {"runner": STABLE, "rollout": policy})
    load = Load(fleet, clients=6)
    with load:
        until(lambda: rollout(fleet[2])["status"]["state"] != "running", 90, "a decision")
    state = rollout(fleet[1])
    assert state["status"]["state"] == "rolled_back", state
    (decision,) = state["status"]["history"]
    assert decision["step"] == 0 and "error rate" in decision["reason"]
    # Decided on every replica's requests: more canary requests than any one replica served.
    counted = decision["figures"]["canary"]["requests"]
    assert counted >= 90
    assert set(load.failures()) == {(500, CANARY)}, load.failures()
    with Load(fleet) as after:
        until(lambda: len(after.answers) >= 90, 30)
    assert set(after.served()) == {STABLE}, after.served()
