"""Canary routing and fleet benchmarks. Not run by CI.

    python -m tests.benchmarks.canary routing [--duration 5] [--rounds 3]
    python -m tests.benchmarks.canary fleet [--changes 20]
    python -m tests.benchmarks.canary shadow [--duration 10] [--rounds 3] [--connections 64]

``routing``: the cost of choosing a variant on the request path. One server,
four routes over the same two runner versions: ``plain`` (one runner),
``weighted-one`` (sticky weights 100/0: the choosing, one runner serving),
``canary`` (90/10 at random) and ``sticky`` (90/10 by an ``X-User-ID`` that
changes with every request), driven by wrk in interleaved rounds; prints the
medians and each route's ratio to ``plain``.

``fleet``: etcd and three replicas as subprocesses. Moves a route's weights
back and forth ``--changes`` times through a different replica each time and
measures, with real requests, how long until every replica serves the new
variant; then kills etcd under load, counts failed requests, restarts it and
times until every replica is back in sync.

``shadow``: whether shadow traffic slows the live answers. One server, three routes over
the same two runner versions (answering alike): ``plain`` (the stable version, its
canary at weight 0), ``rollout`` (a rollout held at 1 %, no shadow traffic: its window
counted) and ``shadowed`` (a rollout held at its shadow-only step, copying ``--share`` of
the stable version's requests to the canary), driven by wrk in interleaved rounds at
``--connections``; prints the medians side by side, the median of the rounds' ratios
(``shadowed / rollout``: what shadow traffic costs; ``rollout / plain``: what counting
a rollout's window costs) and the copies compared and skipped. ``--share 0`` makes
``shadowed`` a second ``rollout``: its ratio then is the noise between two routes alike.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from tests.benchmarks.serving import Result, wrk
from tests.etcd import EtcdProcess
from tests.helpers import ServerProcess, write_add_runner

X = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]}
ROUTES = """
[routes.plain]
runner = "add"
[routes.weighted-one]
runner = { "add@2.0.0" = 100, "add@1.0.0" = 0 }
sticky = "x-user-id"
[routes.canary]
runner = { "add@1.0.0" = 90, "add@2.0.0" = 10 }
[routes.sticky]
runner = { "add@1.0.0" = 90, "add@2.0.0" = 10 }
sticky = "x-user-id"
"""


def plugins(folder: Path, versions: tuple[str, ...] = ("1.0.0", "2.0.0")) -> Path:
    for version in versions:
        write_add_runner(folder, "add", version, amount=float(version[0]))
    return folder


def lua(folder: Path, route: str) -> Path:
    body = json.dumps(X)
    script = folder / f"{route}.lua"
    script.write_text(
        "local n = 0\n"
        "request = function()\n"
        "  n = n + 1\n"
        f'  local headers = {{["Content-Type"] = "application/json", ["X-User-ID"] = "user-" .. n}}\n'
        f'  return wrk.format("POST", "/v2/models/{route}/infer", headers, \'{body}\')\n'
        "end\n"
    )
    return script


def routing(duration: int, rounds: int, connections: list[int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plugins(root / "plugins")
        (root / "plugins" / "routes.toml").write_text(ROUTES)
        (root / "models").mkdir()
        proc = ServerProcess(
            "--plugins-dir", str(root / "plugins"), "--models-dir", str(root / "models"),
            "--log-level", "warning", log=root / "server.log",
        ).wait_ready()  # fmt: skip
        try:
            scripts = {
                route: lua(root, route) for route in ("plain", "weighted-one", "canary", "sticky")
            }
            results: dict[tuple[str, int], list[Result]] = {}
            for c in connections:
                for script in scripts.values():
                    wrk(proc.url, script, c, 1)  # warm up
                for _ in range(rounds):
                    for route, script in scripts.items():
                        results.setdefault((route, c), []).append(
                            wrk(proc.url, script, c, duration)
                        )
        finally:
            proc.stop()
    print("| route | c | req/s | p50 ms | p99 ms | req/s vs plain | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in connections:
        plain = statistics.median(r.rps for r in results[("plain", c)])
        for route in scripts:
            rs = results[(route, c)]
            rps = statistics.median(r.rps for r in rs)
            print(
                f"| {route} | {c} | {rps:.0f} | {statistics.median(r.p50_ms for r in rs):.2f} | "
                f"{statistics.median(r.p99_ms for r in rs):.2f} | {rps / plain:.3f} | "
                f"{sum(r.errors for r in rs)} |"
            )


class Client:
    """One keep-alive connection to a replica."""

    def __init__(self, proc: ServerProcess) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", proc.port, timeout=10)

    def call(
        self, method: str, path: str, body: object = None
    ) -> tuple[int, dict[str, str], bytes]:
        data = None if body is None else json.dumps(body).encode()
        self.conn.request(method, path, data, {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        return resp.status, dict(resp.headers), resp.read()

    def variant(self) -> str | None:
        status, headers, _ = self.call("POST", "/v2/models/add/infer", X)
        return headers.get("X-Plugserve-Variant") if status == 200 else None


def fleet(changes: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "models").mkdir()
        etcd = EtcdProcess(root / "etcd").start()
        procs = [
            ServerProcess(
                "--plugins-dir", str(plugins(root / f"p{i}")), "--models-dir", str(root / "models"),
                "--registry", etcd.url(), "--replica-id", f"r{i}", "--log-level", "warning",
                log=root / f"r{i}.log",
            )
            for i in range(3)
        ]  # fmt: skip
        try:
            for proc in procs:
                proc.wait_ready()
            clients = [Client(p) for p in procs]
            spreads = []
            for n in range(changes):
                target = "add@2.0.0" if n % 2 == 0 else "add@1.0.0"
                other = "add@1.0.0" if target == "add@2.0.0" else "add@2.0.0"
                entry = {"runner": {target: 100, other: 0}}
                started = time.perf_counter()
                status, _, body = clients[n % 3].call("PUT", "/admin/routes/add", entry)
                assert status == 200, body
                seen: dict[int, float] = {}
                while len(seen) < 3:
                    for i, client in enumerate(clients):
                        if i not in seen and client.variant() == target:
                            seen[i] = time.perf_counter() - started
                spreads.append(max(seen.values()) * 1000)
            spreads.sort()
            print(
                f"weight change -> all 3 replicas serving it ({changes} changes): "
                f"median {statistics.median(spreads):.1f} ms, "
                f"p90 {spreads[int(0.9 * (len(spreads) - 1))]:.1f} ms, max {spreads[-1]:.1f} ms"
            )
            # etcd dies under load: count what fails.
            stop = threading.Event()
            counts = {"ok": 0, "failed": 0}

            def load(proc: ServerProcess) -> None:
                client = Client(proc)
                while not stop.is_set():
                    counts["ok" if client.variant() else "failed"] += 1

            threads = [threading.Thread(target=load, args=(p,)) for p in procs]
            for t in threads:
                t.start()
            time.sleep(1)
            etcd.stop()
            time.sleep(5)
            etcd.start()  # returns once etcd answers /health
            restarted = time.perf_counter()
            while not all(
                json.loads(c.call("GET", "/v2/health/ready")[2])["fleet"]["connected"]
                for c in clients
            ):
                time.sleep(0.01)
            resync = time.perf_counter() - restarted
            time.sleep(1)
            stop.set()
            for t in threads:
                t.join()
            print(
                f"etcd killed for 5 s under load: {counts['ok']} requests answered 200, "
                f"{counts['failed']} failed; all replicas in sync {resync * 1000:.0f} ms "
                "after etcd was healthy again"
            )
        finally:
            for proc in procs:
                proc.stop()
            etcd.stop()


def shadow(duration: int, rounds: int, connections: int, share: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for version in ("1.0.0", "2.0.0"):
            write_add_runner(root / "plugins", "add", version, amount=1.0)
        (root / "plugins" / "routes.toml").write_text(
            '[routes.plain]\nrunner = { "add@1.0.0" = 100, "add@2.0.0" = 0 }\n'
        )
        (root / "models").mkdir()
        proc = ServerProcess(
            "--plugins-dir", str(root / "plugins"), "--models-dir", str(root / "models"),
            "--log-level", "warning", log=root / "server.log",
        ).wait_ready()  # fmt: skip
        held = {"canary": "add@2.0.0", "min_requests": 10**7, "min_seconds": 86400}
        rollouts = {
            "rollout": {**held, "steps": [1, 100]},
            "shadowed": {**held, "steps": [0, 100], "shadow": share} if share
            else {**held, "steps": [1, 100]},  # --share 0: alike, the noise between two routes
        }  # fmt: skip
        for route, rollout in rollouts.items():
            status, _, body = proc.request(
                "PUT", f"/admin/routes/{route}", {"runner": "add@1.0.0", "rollout": rollout}
            )
            assert status == 200, body
        try:
            scripts = {route: lua(root, route) for route in ("plain", "rollout", "shadowed")}
            results: dict[str, list[Result]] = {}
            for script in scripts.values():
                wrk(proc.url, script, connections, 2)  # warm up
            for i in range(rounds):  # each route first in turn
                order = list(scripts)[i % 3 :] + list(scripts)[: i % 3]
                for route in order:
                    results.setdefault(route, []).append(
                        wrk(proc.url, scripts[route], connections, duration)
                    )
            _, _, body = proc.request("GET", "/admin/routes/shadowed/rollout")
            window = json.loads(body)["rollout"]["window"]
        finally:
            proc.stop()
    print(f"c={connections}, shadow share {share:g}, {rounds} rounds of {duration} s, medians")
    print("| route | req/s | p50 ms | p99 ms | errors |")
    print("| --- | --- | --- | --- | --- |")
    for route, rs in results.items():
        print(
            f"| {route} | {statistics.median(r.rps for r in rs):.0f} | "
            f"{statistics.median(r.p50_ms for r in rs):.2f} | "
            f"{statistics.median(r.p99_ms for r in rs):.2f} | {sum(r.errors for r in rs)} |"
        )
    for a, b in (("shadowed", "rollout"), ("rollout", "plain")):
        ratios = {
            field: statistics.median(
                getattr(x, field) / getattr(y, field)
                for x, y in zip(results[a], results[b], strict=True)
            )
            for field in ("rps", "p50_ms", "p99_ms")
        }
        print(f"{a} / {b}, median of the rounds' ratios: "
              + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))  # fmt: skip
    print("shadow copies (last window):", json.dumps(window["shadow"] if share else None))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("routing")
    r.add_argument("--duration", type=int, default=5)
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--connections", type=int, nargs="+", default=[1, 16])
    f = sub.add_parser("fleet")
    f.add_argument("--changes", type=int, default=20)
    s = sub.add_parser("shadow")
    s.add_argument("--duration", type=int, default=10)
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--connections", type=int, default=64)
    s.add_argument("--share", type=float, default=0.1)
    args = parser.parse_args()
    if args.what == "routing":
        routing(args.duration, args.rounds, args.connections)
    elif args.what == "shadow":
        shadow(args.duration, args.rounds, args.connections, args.share)
    else:
        fleet(args.changes)


if __name__ == "__main__":
    main()
