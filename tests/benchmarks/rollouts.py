"""Rollouts deciding themselves across a fleet: how often each kind of canary ends as it
should. Not run by CI.

    python -m tests.benchmarks.rollouts [--good 20] [--failing 5] [--slow 5]
        [--min-seconds 5] [--min-requests 50] [--steps 10 50 100] [--clients 6]

etcd and three replicas as subprocesses, each with four versions of runner ``m``
(``tests/server/rollout_helpers.py``'s model): the stable ``1.0.0``, a good canary
``2.0.0`` (the same code), ``3.0.0`` failing one request in five, ``4.0.0`` 20 ms slower.
Clients send requests to the three replicas in turn all along; each rollout is a ``PUT``
on the next replica of the stable version with one canary, waited for until the fleet
decides it. Prints a table: per canary, the rollouts, how many were promoted and rolled
back, the seconds to the decision (median and most), the failed requests, and the reason
of every decision that was not the expected one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tests.etcd import EtcdProcess
from tests.helpers import ServerProcess
from tests.server.rollout_helpers import Load, write_config, write_model

STABLE = "m@1.0.0"
CANARIES = {
    "good": ("m@2.0.0", {}, "promoted"),
    "failing": ("m@3.0.0", {"fail_every": 5}, "rolled_back"),
    "slow": ("m@4.0.0", {"delay_s": 0.02}, "rolled_back"),
}
"""Each kind: its version, its model's config, the outcome it should have."""


def start_fleet(root: Path, etcd: EtcdProcess, interval_s: float) -> list[ServerProcess]:
    config = write_config(root / "plugserve.toml", rollout_interval_s=interval_s)
    (root / "models").mkdir()
    procs = []
    for i in range(3):
        plugins = root / f"plugins{i}"
        write_model(plugins, "1.0.0")
        for version, model, _ in CANARIES.values():
            write_model(plugins, version.split("@")[1], **model)
        procs.append(ServerProcess(
            "--plugins-dir", str(plugins), "--models-dir", str(root / "models"),
            "--config", str(config), "--registry", etcd.url("/bench"), "--replica-id", f"r{i}",
            "--log-level", "warning", log=root / f"r{i}.log",
        ))  # fmt: skip
    return [p.wait_ready() for p in procs]


def state_of(proc: ServerProcess) -> dict[str, Any]:
    status, _, body = proc.request("GET", "/admin/routes/m/rollout")
    assert status == 200, body
    return json.loads(body)["rollout"]  # type: ignore[no-any-return]


def one_rollout(
    fleet: list[ServerProcess], turn: int, canary: str, policy: dict[str, Any], within_s: float
) -> tuple[str, float, str]:
    """The outcome of one rollout started on replica ``turn % 3``: its state, the seconds
    it took, and the reason of its last decision."""
    entry = {"runner": STABLE, "rollout": {"canary": canary, **policy}}
    started = time.monotonic()
    status, _, body = fleet[turn % 3].request("PUT", "/admin/routes/m", entry)
    assert status == 200, body
    ident = json.loads(body)["entry"]["rollout"]["status"]["id"]
    watcher = fleet[(turn + 1) % 3]
    while time.monotonic() - started < within_s:
        state = state_of(watcher)
        if state["status"]["id"] == ident and state["status"]["state"] != "running":
            return state["status"]["state"], time.monotonic() - started, state["status"]["reason"]
        time.sleep(0.1)
    return "undecided", time.monotonic() - started, ""


def run(args: argparse.Namespace) -> None:
    policy = {"steps": args.steps, "min_requests": args.min_requests,
              "min_seconds": args.min_seconds}  # fmt: skip
    counts = {"good": args.good, "failing": args.failing, "slow": args.slow}
    rows: list[tuple[str, list[tuple[str, float, str]], Counter[tuple[int, str]]]] = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        etcd = EtcdProcess(root / "etcd").start()
        fleet: list[ServerProcess] = []
        try:
            fleet = start_fleet(root, etcd, args.interval)
            turn = 0
            for kind, (canary, _, _) in CANARIES.items():
                outcomes = []
                with Load(fleet, clients=args.clients) as load:
                    for _ in range(counts[kind]):
                        outcomes.append(one_rollout(fleet, turn, canary, policy, args.within))
                        turn += 1
                rows.append((kind, outcomes, load.failures()))
                print(kind, [(s, round(t, 1)) for s, t, _ in outcomes], flush=True)
        finally:
            for proc in fleet:
                proc.stop()
            etcd.stop()
    took = time.monotonic() - began
    print(
        f"\n3 replicas, etcd, {args.clients} clients; steps {args.steps}, min_requests "
        f"{args.min_requests}, min_seconds {args.min_seconds:g}; {took:.0f} s in all\n"
    )
    print("| canary | rollouts | promoted | rolled back | seconds to decide: median, most "
          "| failed requests (status, variant: count) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    unexpected = []
    for kind, outcomes, failures in rows:
        states = Counter(s for s, _, _ in outcomes)
        times = [t for _, t, _ in outcomes]
        failed = ", ".join(f"{s} {v}: {n}" for (s, v), n in sorted(failures.items())) or "none"
        print(
            f"| {kind} ({CANARIES[kind][0]}) | {len(outcomes)} | {states['promoted']} | "
            f"{states['rolled_back']} | {statistics.median(times):.1f}, {max(times):.1f} | "
            f"{failed} |"
        )
        expected = CANARIES[kind][2]
        unexpected += [(kind, s, r) for s, _, r in outcomes if s != expected]
    for kind, state, reason in unexpected:
        print(f"unexpected: {kind} canary {state}: {reason}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--good", type=int, default=20, help="rollouts of the good canary")
    parser.add_argument("--failing", type=int, default=5, help="of the one failing 20 %%")
    parser.add_argument("--slow", type=int, default=5, help="of the one 20 ms slower")
    parser.add_argument("--steps", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--min-requests", type=int, default=50)
    parser.add_argument("--min-seconds", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--interval", type=float, default=0.2, help="rollout_interval_s")
    parser.add_argument("--within", type=float, default=120.0, help="seconds a rollout may take")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
