"""Many models in a memory budget: runner versions loaded on demand, a budget that holds a
few, skewed traffic; the process tree's memory, read every second, beside what the budget
counted.

    python -m tests.benchmarks.density [--versions 32] [--mib 24] [--grow-mib 24]
        [--holds 5.5] [--minutes 3] [--clients 4] [--in-worker] [--workers 1]

Writes ``--versions`` Python runners that each hold ``--mib`` MiB of weights from their
load and ``--grow-mib`` MiB more from their first request (as an arena that grows on use
does), ``load = "on_demand"``, in runner processes of their own (``--in-worker``: in the
worker), and serves them with ``--memory-budget`` set to hold ``--holds`` of them (one
version's cost read from the tree of a server without a budget, after a request).
``--clients`` threads send requests for ``--minutes``, each to a version drawn from a
Zipf law (a few hot, a long tail). Prints every status count, the hit rate (requests that
found their version loaded), the cold loads' p50 and p99 (the server's own
``plugin_demanded`` seconds), the evictions, the loads of one version in one process that
overlapped (0 expected) and, isolated, the runner processes started against the cold
loads; then, every second, the server tree's resident memory above its baseline (the
supervisor, its workers and their runner processes) and what the budget counted
(``/admin/status``: resident and reserved): their p50 and peak, and the seconds the tree
was over the budget, and over the budget plus one version (0 expected). ``--workers``:
that many workers, under the supervisor's one budget. Not run by CI.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import itertools
import json
import re
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from tests.helpers import ServerProcess, write_plugin

RUNNER = """
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Held:
        def __init__(self, mib, grow_mib):
            self.weights = np.ones(mib * 1024 * 1024 // 8)
            self.grow_mib = grow_mib
            self.grown = None

        def infer(self, inputs):
            if self.grown is None and self.grow_mib:  # taken on first use
                self.grown = np.ones(self.grow_mib * 1024 * 1024 // 8)
            return {"y": np.asarray(inputs["x"]) * 2}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Held(config["mib"], config["grow_mib"])
"""
ERRORS: collections.Counter[str] = collections.Counter()
"""Each error's answer (its start), counted."""
BODY = json.dumps(
    {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
).encode()


def tree_resident(root: int) -> int:
    """Resident bytes of ``root`` and every process below it."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    rss: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        children[int(fields[1])].append(pid)
        rss[pid] = int(fields[21]) * 4096
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total


def overlapping(text: str) -> int:
    """Loads (``plugin_demanded``) of one version in one process that overlapped in time."""
    spans: dict[tuple[str, str], list[tuple[float, float]]] = collections.defaultdict(list)
    for line in text.splitlines():
        if "plugin_demanded" not in line:
            continue
        end = datetime.datetime.fromisoformat(line.split()[0]).timestamp()
        fields = dict(re.findall(r"(\w+)=(\S+)", line))
        seconds = float(fields.get("seconds", 0))
        spans[(fields.get("plugin", ""), fields.get("worker", ""))].append((end - seconds, end))
    count = 0
    for runs in spans.values():
        runs.sort()
        count += sum(1 for before, after in itertools.pairwise(runs) if after[0] < before[1])
    return count


def post(url: str) -> tuple[int, float]:
    started = time.perf_counter()
    request = urllib.request.Request(url, BODY, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
        ERRORS[exc.read()[:200].decode(errors="replace")] += 1
    return status, time.perf_counter() - started


def counted(url: str) -> int:
    """What the budget counts now: resident and reserved bytes (``/admin/status``)."""
    try:
        with urllib.request.urlopen(f"{url}/admin/status", timeout=10) as response:
            state = json.loads(response.read())["memory"]
    except (OSError, ValueError, KeyError, TypeError):
        return -1
    return int(state["resident_bytes"]) + int(state["reserved_bytes"])


def quantile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=32)
    parser.add_argument("--mib", type=int, default=24)
    parser.add_argument("--grow-mib", type=int, default=24)
    parser.add_argument("--holds", type=float, default=5.5)
    parser.add_argument("--minutes", type=float, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=1.3)
    parser.add_argument("--in-worker", action="store_true")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    workers = ("--workers", str(args.workers)) if args.workers > 1 else ()
    isolation = "" if args.in_worker else 'isolation = "process"\n'
    with tempfile.TemporaryDirectory() as tmp:
        plugins, models = Path(tmp) / "plugins", Path(tmp) / "models"
        models.mkdir()
        names = [f"m{i:02d}" for i in range(args.versions)]
        for name in names:
            manifest = (f"[config]\nmib = {args.mib}\ngrow_mib = {args.grow_mib}\n"
                        f'[runner]\nload = "on_demand"\n{isolation}')  # fmt: skip
            write_plugin(plugins, "runner", name, "1.0.0", manifest, files={"plugin.py": RUNNER})
        # One version's cost as the tree measures it, read from a server without a budget.
        probe = ServerProcess("--plugins-dir", str(plugins), "--models-dir", str(models), *workers,
                              log=Path(tmp) / "probe.log").wait_ready(60)  # fmt: skip
        idle_tree = tree_resident(probe.proc.pid)
        post(f"{probe.url}/v2/models/m00/infer")
        time.sleep(1)
        one = tree_resident(probe.proc.pid) - idle_tree
        probe.stop()
        budget = int(one * args.holds)
        log = Path(tmp) / "server.log"
        srv = ServerProcess("--plugins-dir", str(plugins), "--models-dir", str(models), *workers,
                            "--memory-budget", str(budget), log=log).wait_ready(60)  # fmt: skip
        baseline = tree_resident(srv.proc.pid)
        tree: list[int] = []
        count: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(1.0):
                tree.append(tree_resident(srv.proc.pid) - baseline)
                count.append(counted(srv.url))

        weights = 1 / np.arange(1, args.versions + 1) ** args.zipf
        weights /= weights.sum()
        statuses: collections.Counter[int] = collections.Counter()
        lock = threading.Lock()
        deadline = time.monotonic() + args.minutes * 60

        def client(seed: int) -> None:
            rng = np.random.default_rng(seed)
            while time.monotonic() < deadline:
                name = names[rng.choice(args.versions, p=weights)]
                status, _ = post(f"{srv.url}/v2/models/{name}/infer")
                with lock:
                    statuses[status] += 1

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stop.set()
        sampler.join()
        srv.stop()
        text = log.read_text(errors="replace")
        loads = [float(m) for m in re.findall(r"plugin_demanded.*?seconds=([0-9.]+)", text)]
        evictions = text.count("plugin_evicted")
        total = sum(statuses.values())
        mib = 2**20
        mode = "in-worker" if args.in_worker else "isolated"
        mode += f", {args.workers} workers" if args.workers > 1 else ""
        print(f"{mode}: {args.versions} versions of ~{one / mib:.0f} MiB each ({args.mib} at "
              f"load, {args.grow_mib} on first use; measured), budget {budget / mib:.0f} MiB "
              f"(holds {args.holds:g}), {args.clients} clients, {args.minutes:g} min, "
              f"Zipf {args.zipf:g}")  # fmt: skip
        print(f"requests {total}: {dict(sorted(statuses.items()))}")
        for message, n in ERRORS.most_common(5):
            print(f"  {n} x {message}")
        print(f"hit rate {1 - len(loads) / total:.3f} ({len(loads)} cold loads, {evictions} "
              "evictions)")  # fmt: skip
        if loads:
            loads.sort()
            p99 = loads[min(len(loads) - 1, int(len(loads) * 0.99))]
            print(f"cold load p50 {statistics.median(loads):.3f} s, p99 {p99:.3f} s")
        print(f"overlapping loads of one version in one process: {overlapping(text)}")
        if not args.in_worker:
            starts = text.count("runner_process_started")
            print(f"runner processes started: {starts} for {len(loads)} cold loads")
        seen = [n for n in count if n >= 0]
        print(
            f"tree above baseline ({baseline / mib:.0f} MiB), {len(tree)} one-second samples: "
            f"p50 {quantile(tree, 0.5) / mib:.0f} MiB, peak {max(tree, default=0) / mib:.0f} "
            f"MiB; over the budget in {sum(n > budget for n in tree)}, over the budget + one "
            f"version ({(budget + one) / mib:.0f} MiB) in {sum(n > budget + one for n in tree)}"
        )
        print(f"budget counted (resident + reserved): p50 {quantile(seen, 0.5) / mib:.0f} MiB, "
              f"peak {max(seen, default=0) / mib:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
