"""Rollouts in a fleet: three replicas as real subprocesses sharing a real etcd. One
replica decides (the lease holder) from every replica's figures; killed mid-rollout,
another goes on from the same step; every replica restarted, the rollout resumes."""

from __future__ import annotations

import asyncio
import json
import time
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
        await client.put(key, value, lease=await client.grant(3600))
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
    policy = {"canary": CANARY, "steps": [10, 25, 50, 75, 100], "min_requests": 50,
              "min_seconds": 5}  # fmt: skip
    put_rollout(fleet[1], {"runner": STABLE, "rollout": policy})
    load = Load(fleet, clients=6)
    with load:
        until(lambda: rollout(fleet[0])["status"]["step"] >= 1, 60, "a first step")
        (leader,) = deciders(fleet)  # exactly one replica decides
        survivors = [r for i, r in enumerate(fleet) if i != leader]
        load.servers = survivors
        fleet[leader].proc.kill()  # no goodbye: its lease runs out
        fleet[leader].proc.wait()

        def others_moved() -> bool:
            return any(by != f"r{leader}" for _, _, by in history(rollout(survivors[0])))

        until(others_moved, 60, "another replica decides a step")
        until(lambda: len(deciders(survivors)) == 1, 10, "one decider")
    moves = history(rollout(survivors[0]))
    assert [s for _, s, _ in moves] == list(range(len(moves)))  # no step skipped or repeated
    first = next(i for i, (_, _, by) in enumerate(moves) if by != f"r{leader}")
    assert first >= 1 and {by for _, _, by in moves[:first]} == {f"r{leader}"}
    assert {by for _, _, by in moves[first:]} <= {f"r{i}" for i in range(3)} - {f"r{leader}"}
    # No request failed because of a step or the takeover (those in flight to the replica
    # killed are the kill's).
    failures = load.failures(but=fleet[leader])
    assert not failures, failures
    # Every replica stops mid-rollout; started again, they take it up where it stood.
    for replica in survivors:
        replica.stop()
    restarting = time.time()
    again = replicas(tmp_path, models_dir, etcd, server)
    until(lambda: len({json.dumps(rollout(r)["status"]) for r in again}) == 1, 10, "one view")
    stood = rollout(again[0])["status"]
    assert stood["state"] == "running" and stood["step"] >= moves[-1][1] + 1
    with Load(again, clients=6) as after:
        until(lambda: rollout(again[2])["status"]["state"] == "promoted", 90, "promotion")
    final = history(rollout(again[0]))
    assert final[: len(stood["history"])] == history({"status": stood})
    # The restart began the step's window again, once; then each step once, across it (the
    # step below 100 % promotes).
    restarts = [d for d in rollout(again[0])["status"]["history"] if d["decision"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["at"] >= restarting, restarts
    passed = [(d, s) for d, s, _ in final if d != "restart"]
    assert passed == [("advance", 0), ("advance", 1), ("advance", 2), ("promote", 3)], final
    assert not after.failures(), after.failures()


@pytest.mark.workers(1, 2)
def test_a_failing_canary_is_rolled_back_for_the_whole_fleet_from_every_replicas_figures(
    tmp_path: Path, models_dir: Path, etcd: EtcdProcess, server: Callable[..., ServerProcess]
) -> None:
    # A decider key written by hand (naming a replica, under a lease not that replica's)
    # holds nobody back.
    asyncio.run(_put(etcd, "/rollouts/rollouts/decider", b"r0"))
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
    # Decided on every replica's requests, each counted once: more canary requests than any
    # one replica served, no more than all of them served (the weight went to 0 with it).
    counted = decision["figures"]["canary"]["requests"]
    served = load.by_server(CANARY)
    assert max(served.values()) < counted <= sum(served.values()), (counted, served)
    assert set(load.failures()) == {(500, CANARY)}, load.failures()
    with Load(fleet) as after:
        until(lambda: len(after.answers) >= 90, 30)
    assert set(after.served()) == {STABLE}, after.served()
