"""Side by side: this checkout against an earlier commit, to tell a regression from noise.

    python -m tests.benchmarks.ab --against 938ba34 [--connections 1 16] [--rounds 5]
    python -m tests.benchmarks.ab --isolated [--workers 2]   # in-worker vs isolated runner
    python -m tests.benchmarks.ab --against HEAD~1 --isolated  # isolated runners, two commits
    python -m tests.benchmarks.ab --against HEAD~2 --model mlp [--payload binary]
    python -m tests.benchmarks.ab --inline-runners --workers 2 --model mlp --connections 64

Checks the commit out into a temporary git worktree, serves the same small ONNX
runner from both (each ``plugserve serve`` runs its own code), and drives them
with wrk in alternation, so both see the same moments of a noisy machine.
Prints, per concurrency, the median req/s, p50 and server CPU time per request
(from /proc, the server's whole process tree: steadier than throughput on a
shared machine) of each, and the req/s ratio. ``--model mlp`` serves the serving
benchmark's MLP and request (tests/benchmarks/serving.py, JSON or binary) instead. With ``--isolated`` both servers
run this checkout, the runner in the worker and in a process of its own
(``isolation = "process"``); with ``--inline-runners``, the in-worker runner's
batches on a thread (``--inline-runners off``) and on the worker's event loop (``on``).
Not run by CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tests.benchmarks.canary import lua
from tests.benchmarks.serving import (
    RUNNER_OPTIONS,
    Result,
    binary_body,
    cpu_tree,
    json_body,
    lua_script,
    write_mlp_runner,
    wrk,
)
from tests.helpers import ROOT, free_port, wait_until_ok, write_add_runner

ISOLATED = 'isolation = "process"'


def serve(
    source: Path,
    plugins: Path,
    models: Path,
    log: Path,
    workers: int = 1,
    extra: Sequence[str] = (),
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [
        sys.executable, "-m", "plugserve", "serve", "--port", str(port),
        "--grpc-port", str(free_port()),
        "--plugins-dir", str(plugins), "--models-dir", str(models), "--log-level", "warning",
    ]  # fmt: skip
    command += ["--workers", str(workers)]
    command += extra
    out = log.open("wb")
    proc = subprocess.Popen(
        command, cwd=source, env={**os.environ, "PYTHONPATH": str(source)}, stdout=out, stderr=out
    )
    url = f"http://127.0.0.1:{port}"
    wait_until_ok(proc, url + "/v2/health/ready", 60, log.read_text)
    return proc, url


def mlp_script(folder: Path, payload: str) -> Path:
    """wrk's script for the serving benchmark's request (one row), JSON or binary."""
    if payload == "json":
        return lua_script(folder, json_body(), {"Content-Type": "application/json"})
    body, header_length = binary_body()
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(header_length),
    }
    return lua_script(folder, body, headers)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process's tree (workers, runner processes), from /proc."""
    return sum(cpu for _, cpu in cpu_tree(pid).values())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", help="the earlier commit (any git revision)")
    parser.add_argument(
        "--isolated",
        action="store_true",
        help="in-worker runner against an isolated one; with --against, isolated on both sides",
    )
    parser.add_argument(
        "--inline-runners",
        action="store_true",
        help="this checkout's in-worker runners on a thread (--inline-runners off) against "
        "on each worker's event loop (on)",
    )
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--connections", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=int, default=4)
    parser.add_argument("--model", choices=["add", "mlp"], default="add")
    parser.add_argument("--payload", choices=["json", "binary"], default="json")
    args = parser.parse_args()
    if args.inline_runners and (args.against or args.isolated):
        parser.error(
            "--inline-runners compares this checkout with itself: not with --against or --isolated"
        )
    if not (args.against or args.isolated or args.inline_runners):
        parser.error("say --against, --isolated (or both), or --inline-runners")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        earlier = root / "earlier"
        if args.against:
            subprocess.run(
                ["git", "worktree", "add", "-q", "--detach", str(earlier), args.against],
                cwd=ROOT,
                check=True,
            )
        procs = []
        try:
            if args.model == "add":
                write_add_runner(root / "plugins", "add", "1.0.0")
                write_add_runner(root / "iso" / "plugins", "add", "1.0.0", runner=ISOLATED)
                (root / "models").mkdir()
                script, path = lua(root, "add"), ""
            else:
                write_mlp_runner(root, RUNNER_OPTIONS)
                write_mlp_runner(root / "iso", f"{RUNNER_OPTIONS}\n{ISOLATED}")
                script, path = mlp_script(root, args.payload), "/v2/models/mlp/infer"
            servers: dict[str, str] = {}
            pids: dict[str, int] = {}
            cpu_per_request: dict[tuple[str, int], list[float]] = {}
            sides: list[tuple[str, Path, Path, list[str]]]
            if args.against:
                plugins = root / "iso" / "plugins" if args.isolated else root / "plugins"
                sides = [("this", ROOT, plugins, []), (args.against, earlier, plugins, [])]
            elif args.inline_runners:
                sides = [
                    ("loop", ROOT, root / "plugins", ["--inline-runners", "on"]),
                    ("thread", ROOT, root / "plugins", ["--inline-runners", "off"]),
                ]
            else:
                sides = [
                    ("in-worker", ROOT, root / "plugins", []),
                    ("isolated", ROOT, root / "iso" / "plugins", []),
                ]
            for name, source, plugins, flags in sides:
                log = root / f"{name}.log"
                proc, url = serve(source, plugins, root / "models", log, args.workers, flags)
                procs.append(proc)
                servers[name] = url + path
                pids[name] = proc.pid
            results: dict[tuple[str, int], list[Result]] = {}
            for c in args.connections:
                for url in servers.values():
                    wrk(url, script, c, 1)  # warm up
                for n in range(args.rounds):
                    order = list(servers.items()) if n % 2 == 0 else list(reversed(servers.items()))
                    for name, url in order:
                        before = cpu_seconds(pids[name])
                        result = wrk(url, script, c, args.duration)
                        used = cpu_seconds(pids[name]) - before
                        results.setdefault((name, c), []).append(result)
                        requests = result.rps * args.duration
                        cpu_per_request.setdefault((name, c), []).append(used / requests * 1e6)
            for c in args.connections:
                rps = {
                    name: statistics.median(r.rps for r in results[(name, c)]) for name in servers
                }
                p50 = {
                    name: statistics.median(r.p50_ms for r in results[(name, c)])
                    for name in servers
                }
                cpu = {n: statistics.median(cpu_per_request[(n, c)]) for n in servers}
                shown = " | ".join(
                    f"{n}: {rps[n]:.0f} req/s, p50 {p50[n]:.2f} ms, {cpu[n]:.0f} CPU µs/request"
                    for n in servers
                )
                first, second = list(servers)
                extra = ""
                if args.inline_runners:
                    extra = f" | CPU loop - thread {cpu[first] - cpu[second]:+.0f} µs"
                elif not args.against:
                    extra = f" | CPU isolated - in-worker {cpu[second] - cpu[first]:+.0f} µs"
                print(f"c={c}: {shown} | {first}/{second} {rps[first] / rps[second]:.3f}{extra}")
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait()
            if args.against:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(earlier)], cwd=ROOT, check=False
                )


if __name__ == "__main__":
    main()
