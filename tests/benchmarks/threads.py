"""Where the CPU goes under load: per process and thread of the server, and the load generator.

    python -m tests.benchmarks.threads [--workers 1 2] [--payload binary] [--duration 10]
                                       [--isolated]

Serves the serving benchmark's MLP (tests/benchmarks/serving.py) with
``--workers N``, drives it with ``wrk -c 64`` and reads, from /proc, the CPU
each thread of the server's process tree used during the run (grouped by
thread name: the event loop is the process's main thread, ONNX Runtime runs
on the runner's thread pool), and wrk's own. Prints CPU microseconds per
request by group and the cores busy, and the machine's idle, stolen and softirq
time over the run (/proc/stat): what a 2-core machine has left for a
second worker. ``--isolated`` runs the model in a runner process of its own
(``isolation = "process"``), counted as its own group. Not run by CI.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from plugserve.registry.execution.isolation.host import RUNNER_MODULE
from tests.benchmarks.serving import (
    RUNNER_OPTIONS,
    Server,
    binary_body,
    json_body,
    lua_script,
    machine_cpu,
    wait_workers,
    write_mlp_runner,
)
from tests.helpers import free_port

TICK = os.sysconf("SC_CLK_TCK")


def threads_of(root: int, single: bool = False) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (group name, CPU seconds) for every thread of ``root``'s process tree;
    ``single``: the root serves HTTP itself (``--workers 1``)."""
    out: dict[tuple[int, int], tuple[str, float]] = {}
    pending = [root]
    while pending:
        pid = pending.pop()
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if RUNNER_MODULE.encode() in command:
            role = "runner process"
        elif pid == root:
            role = "server" if single else "supervisor"
        else:
            role = "worker"
        for task in tasks:
            try:
                stat = (task / "stat").read_text()
                pending += [int(c) for c in (task / "children").read_text().split()]
            except FileNotFoundError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            seconds = (int(fields[11]) + int(fields[12])) / TICK
            group = f"{role}: {'event loop' if int(task.name) == pid else name}"
            out[(pid, int(task.name))] = (group, seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--payload", choices=["json", "binary"], default="binary")
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--isolated", action="store_true", help="the runner in a process")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plugserve-threads-"))
    options = RUNNER_OPTIONS + ('\nisolation = "process"' if args.isolated else "")
    write_mlp_runner(work, options)
    kind = ", isolated" if args.isolated else ""
    if args.payload == "json":
        script = lua_script(work, json_body(), {"Content-Type": "application/json"})
    else:
        body, length = binary_body()
        script = lua_script(work, body, {"Content-Type": "application/octet-stream",
                                         "Inference-Header-Content-Length": str(length)})  # fmt: skip
    for workers in args.workers:
        port = free_port()
        command = [sys.executable, "-m", "plugserve", "serve", "--plugins-dir", str(work / "plugins"),
                   "--models-dir", str(work / "models"), "--port", str(port), "--log-level", "warning",
                   "--grpc-port", str(free_port()), "--workers", str(workers)]  # fmt: skip
        server = Server(command, port, work / f"server{workers}.log")
        try:
            server.wait("/v2/health/ready", 120)
            if workers > 1:
                wait_workers(server, workers)
            url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
            subprocess.run(["wrk", "-t1", "-c64", "-d2s", "-s", str(script), url],
                           capture_output=True, check=True)  # fmt: skip
            wrk = subprocess.Popen(["wrk", "-t1", "-c64", f"-d{args.duration}s", "-s", str(script), url],
                                   stdout=subprocess.PIPE, text=True)  # fmt: skip
            started = time.monotonic()
            time.sleep(0.25)  # its connections open
            # Every figure below is read over the same window, inside wrk's run.
            opened = time.monotonic()
            before, wrk_before = threads_of(server.proc.pid, workers == 1), _cpu(wrk.pid)
            machine_before = machine_cpu()
            time.sleep(args.duration - 0.75)
            after, wrk_cpu = threads_of(server.proc.pid, workers == 1), _cpu(wrk.pid) - wrk_before
            machine = {k: v - machine_before[k] for k, v in machine_cpu().items()}
            window = time.monotonic() - opened
            output, _ = wrk.communicate()
            elapsed = time.monotonic() - started
            requests = int(next(line.split()[0] for line in output.splitlines()
                                if "requests in" in line))  # fmt: skip
            rate = requests / elapsed
            served = rate * window  # the requests of the window, at the run's mean rate
            by_group: dict[str, float] = defaultdict(float)
            for key, (group, seconds) in after.items():
                by_group[group] += seconds - before.get(key, (group, 0.0))[1]
            total = sum(by_group.values())
            print(f"workers {workers}{kind}, {args.payload}, c=64: {rate:.0f} req/s, server "
                  f"{total / served * 1e6:.0f} us/req ({total / window:.2f} cores), wrk "
                  f"{wrk_cpu / served * 1e6:.0f} us/req ({wrk_cpu / window:.2f} cores)")  # fmt: skip
            for group, seconds in sorted(by_group.items(), key=lambda kv: -kv[1]):
                if seconds > 0.005 * total:
                    print(f"  {group:40} {seconds / served * 1e6:7.1f} us/req  "
                          f"{seconds / window:5.2f} cores")  # fmt: skip
            print(f"  machine, all cores: idle {machine['idle'] / window:.2f} cores, stolen by the "
                  f"hypervisor {machine['steal'] / window:.2f}, softirq {machine['softirq'] / window:.2f}")  # fmt: skip
        finally:
            server.stop()


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


if __name__ == "__main__":
    main()
