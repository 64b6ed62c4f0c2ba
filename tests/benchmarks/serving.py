"""Serving benchmark: plugserve against MLServer, a bare aiohttp handler and in-process ONNX Runtime.

    apt-get install -y wrk          # the load generator, the same for every server
    python -m tests.benchmarks.serving [--duration 10] [--concurrency 1 64] [--workers 1 2]
                                       [--rounds 3] [--no-mlserver]

One run, side by side on the same machine: the medium MLP
(256 -> 1024 -> 1024 -> 1024 -> 10, FP32) is generated, then

- ONNX Runtime in-process: batch-1 latency (p50) and batch-64 throughput, the
  physical limit;
- a bare aiohttp handler that reads the body and answers: the ceiling of any
  aiohttp server on this machine;
- plugserve (dynamic batching 64 / 2 ms), one server per ``--workers`` count
  (cases ``plugserve-w1``, ``plugserve-w2``, ...), and MLServer 1.7.1 (adaptive
  batching 64 / 2 ms, in-process, started by ../shared/peers/mlserver/serve.sh)
  with one row per request, v2 JSON; plugserve also with binary tensors.

Every server is up for the whole run and they take turns under load, round
after round; the table gives medians over the rounds. wrk drives each with c
concurrent connections: requests/s, p50, p99, the mean batch size and the
server's CPU per request (user + system time of its whole process tree, read
from /proc before and after the wrk run, over the requests wrk completed).
After each measurement of a plugserve with more than one worker, the spread of
the load over its workers: per-worker request counts when ``/admin/status``
lists ``workers`` with ``requests``, otherwise each worker's share of the CPU
its workers used (the supervisor's share shown beside). A round's line also shows
the cores the hypervisor stole from this VM during it, when it stole any (/proc/stat):
a sign of the neighbours' load. Then the ratios the
targets are stated in, each with PASS or MISS: a ratio is taken within each round
(the two servers measured minutes apart at most, on a machine whose speed drifts
more than that between rounds) and the verdict goes by the median of those
per-round ratios, printed beside them. Not run by CI.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from plugserve.server.runtime.cores import usable_cores
from tests.helpers import ROOT, _save, free_port

# shared/ lies beside the repository, or beside the folder of its worktrees.
PEERS = next(
    (p / "shared/peers" for p in ROOT.parents if (p / "shared/peers").is_dir()),
    ROOT.parent / "shared/peers",
)
PEER = PEERS / "mlserver/serve.sh"
TRITON = PEERS / "triton/serve.sh"
DIMS = (256, 1024, 1024, 1024, 10)
# One intra-op thread: on 2 cores a second one brought nothing at batch 32 (measured
# 873 vs 874 us) and its spinning or wake-ups cost the event loop; see the README.
RUNNER_OPTIONS = "intra_op_threads = 1"


def make_mlp(path: Path, seed: int = 0) -> Path:
    """The benchmark model: ReLU MLP 256-1024-1024-1024-10, FP32, dynamic batch."""
    rng = np.random.default_rng(seed)
    nodes, inits, prev = [], [], "x"
    layers = list(itertools.pairwise(DIMS))
    for i, (n_in, n_out) in enumerate(layers):
        w = (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)
        inits += [
            numpy_helper.from_array(w, f"w{i}"),
            numpy_helper.from_array(np.zeros(n_out, np.float32), f"b{i}"),
        ]
        last = i == len(layers) - 1
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], ["y" if last else f"z{i}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"z{i}"], [f"a{i}"]))
        prev = f"a{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", DIMS[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", DIMS[-1]])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def make_identity(path: Path) -> Path:
    """A model that costs nearly nothing: ``y = x`` over the MLP's input, the servers' own
    cost with the model taken out (its output is the 256 floats sent, not the MLP's 10)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", DIMS[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", DIMS[0]])],
    )
    return _save(graph, path)


MODELS = {"mlp": make_mlp, "identity": make_identity}


def write_mlp_runner(work: Path, runner_options: str = RUNNER_OPTIONS, model: str = "mlp") -> Path:
    """``work/plugins`` with the benchmark's runner (batching 64 / 2 ms), served as route
    ``mlp`` whatever ``model`` it runs (``MODELS``), and an empty ``work/models``; returns
    the plugins folder."""
    plugins = work / "plugins"
    runner = plugins / "runner" / "mlp" / "1.0.0"
    runner.mkdir(parents=True)
    (runner / "plugin.toml").write_text(
        '[plugin]\nname = "mlp"\nversion = "1.0.0"\ntype = "runner"\n'
        '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\n'
        f"max_batch_size = 64\nmax_queue_delay_ms = 2.0\n{runner_options}\n"
    )
    MODELS[model](runner / "model.onnx")
    (work / "models").mkdir()
    return plugins


def ort_baseline(model: Path, intra_op_threads: int = 0) -> dict[str, float]:
    """Batch-1 p50 latency (warm caches, tight loop) and batch-64 throughput."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads  # 0: ONNX Runtime's default
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    one = np.random.default_rng(1).standard_normal((1, DIMS[0])).astype(np.float32)
    for _ in range(200):
        session.run(None, {"x": one})
    times = []
    for _ in range(2000):
        t = time.perf_counter()
        session.run(None, {"x": one})
        times.append(time.perf_counter() - t)
    batch = np.repeat(one, 64, axis=0)
    t = time.perf_counter()
    runs = 300
    for _ in range(runs):
        session.run(None, {"x": batch})
    rows_per_s = runs * 64 / (time.perf_counter() - t)
    return {"p50_us": statistics.median(times) * 1e6, "rows_per_s": rows_per_s}


# -- payloads and the load generator -----------------------------------------------------


def json_body() -> bytes:
    row = np.random.default_rng(2).standard_normal(DIMS[0]).astype(np.float32)
    return json.dumps(
        {"inputs": [{"name": "x", "shape": [1, DIMS[0]], "datatype": "FP32", "data": row.tolist()}]}
    ).encode()


def binary_body() -> tuple[bytes, int]:
    row = np.random.default_rng(2).standard_normal((1, DIMS[0])).astype(np.float32)
    header = json.dumps(
        {
            "inputs": [{"name": "x", "shape": [1, DIMS[0]], "datatype": "FP32",
                        "parameters": {"binary_data_size": row.nbytes}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()  # fmt: skip
    return header + row.tobytes(), len(header)


def lua_script(folder: Path, body: bytes, headers: dict[str, str]) -> Path:
    payload = folder / f"body{len(list(folder.glob('body*')))}.bin"
    payload.write_bytes(body)
    script = payload.with_suffix(".lua")
    header_lines = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
    script.write_text(
        f'local f = io.open("{payload}", "rb")\nwrk.body = f:read("*all")\nf:close()\n'
        f'wrk.method = "POST"\n{header_lines}\n'
    )
    return script


@dataclass
class Result:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def wrk(url: str, script: Path, connections: int, duration: int, threads: int = 1) -> Result:
    threads = min(threads, connections)  # wrk refuses more threads than connections
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(script), url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    done = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    socket_errors = re.search(r"Socket errors: (.*)", out)
    errors = int(bad.group(1)) if bad else 0
    if socket_errors:
        errors += sum(int(n) for n in re.findall(r"\d+", socket_errors.group(1)))
    return Result(rps, p50, p99, errors, done)


# -- servers -------------------------------------------------------------------------------

BARE = """
import sys
from aiohttp import web
ANSWER = b'{"ok":true}'
async def handle(request):
    await request.read()
    return web.Response(body=ANSWER, content_type="application/json")
app = web.Application(client_max_size=64 * 1024 * 1024)
app.router.add_post("/{tail:.*}", handle)
app.router.add_get("/health", handle)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


class Server:
    def __init__(
        self,
        command: list[str],
        port: int,
        log: Path,
        env: dict[str, str] | None = None,
        checkout: Path | None = None,
    ):
        """``checkout``: another copy of plugserve to run (its folder first on the path)."""
        self.port = port
        self.log = log
        if checkout is not None:
            env = {**(env or {}), "PYTHONPATH": str(checkout)}
        self.proc = subprocess.Popen(
            command, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=checkout or ROOT,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )  # fmt: skip

    def wait(self, path: str, timeout: float = 300) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args!r} exited:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=1):
                    return self
            except Exception:
                time.sleep(0.2)
        raise TimeoutError(self.log.read_text()[-3000:])

    def stop(self) -> None:
        """SIGTERM to its process group, then SIGKILL to whatever of the group is left."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def plugserve_stats(port: int) -> tuple[int, int]:
    """(executions, rows) of the mlp runner, from the admin API (summed over workers by the server)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/plugins") as r:
        row = next(p for p in json.load(r)["plugins"] if p["name"] == "mlp")
    return row.get("executions", 0), row.get("batched_rows", 0)


def admin_workers(port: int) -> dict[int, int | None] | None:
    """``{pid: requests or None}`` from ``/admin/status`` ``workers``; None where it has none."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/status", timeout=5) as r:
            workers = json.load(r).get("workers")
    except Exception:
        return None
    if not isinstance(workers, list):
        return None
    if not all(isinstance(w, dict) and "pid" in w for w in workers):
        return None
    return {int(w["pid"]): w.get("requests") for w in workers}


# -- the server's CPU, from /proc ----------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")
# /proc/<pid>/task/<tid>/children needs CONFIG_PROC_CHILDREN; without it, scan /proc for ppids.
PROC_CHILDREN = Path(f"/proc/self/task/{os.getpid()}/children").exists()
Tree = dict[int, tuple[int, float]]  # pid -> (parent pid, CPU seconds)


def machine_cpu() -> dict[str, float]:
    """The machine's CPU seconds since boot, all cores together: idle (iowait included),
    stolen by the hypervisor (a VM's neighbours) and in softirq (loopback packets)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return {"idle": (fields[3] + fields[4]) / TICK, "steal": fields[7] / TICK,
            "softirq": fields[6] / TICK}  # fmt: skip


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds): user + system time, its own and its reaped children's."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # After the command's name: state, ppid, ... utime (14), stime, cutime, cstime (17).
    return int(fields[1]), sum(int(f) for f in fields[11:15]) / TICK


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return found
    for task in tasks:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # the thread ended
            found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    return found


def _children_by_scan() -> dict[int, list[int]]:
    by_parent: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            by_parent.setdefault(stat[0], []).append(int(entry))
    return by_parent


def cpu_tree(root: int) -> Tree:
    """CPU seconds of every process in root's tree, by pid.

    Each figure includes the children that process has reaped (cutime, cstime), so a
    worker that exits between two snapshots still counts, in its parent's figure; the
    sum over the tree is then the tree's CPU whatever was replaced meanwhile.
    """
    scan = None if PROC_CHILDREN else _children_by_scan()
    tree: Tree = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in tree or (stat := _stat(pid)) is None:
            continue
        tree[pid] = stat
        todo += _children(pid) if scan is None else scan.get(pid, [])
    return tree


def subtree_cpu(tree: Tree, pid: int) -> float:
    """CPU seconds of pid and every descendant of it in the tree."""
    if pid not in tree:
        return 0.0
    kids = [c for c, (parent, _) in tree.items() if parent == pid]
    return tree[pid][1] + sum(subtree_cpu(tree, c) for c in kids)


@dataclass
class Spread:
    """How one measurement's load fell on a multi-worker server's workers."""

    by: str  # "requests" (counted by the server) or "CPU" (per worker pid, from /proc)
    amounts: dict[int, float]  # per worker pid: requests, or CPU seconds
    supervisor: float  # the supervisor's own share of the tree's CPU

    def shares(self) -> list[float]:
        """Each worker's share of the amounts, largest first."""
        total = sum(self.amounts.values()) or 1.0
        return sorted((a / total for a in self.amounts.values()), reverse=True)

    def describe(self) -> str:
        total = sum(self.amounts.values()) or 1.0
        amount = "{:.0f}" if self.by == "requests" else "{:.2f} s"
        workers = ", ".join(
            f"pid {pid} {a / total:.0%} ({amount.format(a)})"
            for pid, a in sorted(self.amounts.items())
        )
        return f"{self.by} share per worker: {workers}; supervisor {self.supervisor:.1%} of the tree CPU"


def spread(
    root: int,
    cpu: tuple[Tree, Tree],
    listed: tuple[dict[int, int | None] | None, dict[int, int | None] | None],
) -> Spread:
    """Per-worker requests where the server lists them both times, else per-worker CPU."""
    before, after = cpu
    tree_delta = sum(c for _, c in after.values()) - sum(c for _, c in before.values())
    own = (after[root][1] - before.get(root, (0, after[root][1]))[1]) if root in after else 0.0
    supervisor = own / tree_delta if tree_delta > 0 else 0.0
    counted_before, counted_after = listed
    if counted_before and counted_after:
        deltas = {
            pid: float(n - (counted_before.get(pid) or 0))
            for pid, n in counted_after.items()
            if isinstance(n, int)
        }
        if deltas and len(deltas) == len(counted_after):
            return Spread("requests", deltas, supervisor)
    # A worker is a child of the supervisor (the ones /admin/status names, where it does).
    pids = set(counted_after or ()) or {p for p, (parent, _) in after.items() if parent == root}
    amounts = {p: subtree_cpu(after, p) - subtree_cpu(before, p) for p in pids}
    return Spread("CPU", amounts, supervisor)


@dataclass
class Case:
    name: str
    payload: str
    url: str
    script: Path
    server: Server
    stats_port: int | None = None
    workers: int = 1


@dataclass
class Sample:
    result: Result
    batch: float | None
    cpu_us: float | None  # server CPU per completed request, whole process tree
    spread: Spread | None
    stolen: float = 0.0  # cores the hypervisor gave to other VMs during the run


def measure_once(case: Case, connections: int, duration: int, threads: int = 1) -> Sample:
    """One wrk run, with the server's CPU (and stats) read around it, not inside it."""
    root = case.server.proc.pid
    stats = plugserve_stats(case.stats_port) if case.stats_port else None
    listed = admin_workers(case.stats_port) if case.stats_port and case.workers > 1 else None
    cpu_before, machine_before, started = cpu_tree(root), machine_cpu(), time.monotonic()
    result = wrk(case.url, case.script, connections, duration, threads)
    cpu_after, machine_after = cpu_tree(root), machine_cpu()
    stolen = (machine_after["steal"] - machine_before["steal"]) / (time.monotonic() - started)
    cpu_s = sum(c for _, c in cpu_after.values()) - sum(c for _, c in cpu_before.values())
    cpu_us = cpu_s / result.requests * 1e6 if result.requests else None
    batch, where = None, None
    if case.stats_port and stats:
        after = plugserve_stats(case.stats_port)
        batch = (after[1] - stats[1]) / max(1, after[0] - stats[0])
    if case.workers > 1:
        listed_after = admin_workers(case.stats_port) if case.stats_port else None
        where = spread(root, (cpu_before, cpu_after), (listed, listed_after))
    return Sample(result, batch, cpu_us, where, stolen)


def wait_workers(server: Server, count: int, timeout: float = 60) -> None:
    """Until the server lists ``count`` workers, or (where it lists none) has that many children."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = admin_workers(server.port)
        have = len(listed) if listed is not None else len(_children(server.proc.pid))
        if have >= count:
            return
        time.sleep(0.2)
    print(f"warning: {server.log.name}: not {count} workers after {timeout:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="medians are taken over rounds")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1, 2], help="one plugserve per count"
    )
    parser.add_argument("--no-mlserver", action="store_true")
    parser.add_argument("--no-triton", action="store_true")
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="mlp",
        help="what every server runs: the MLP, or identity (the servers' own cost)",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", type=Path, default=None,
        help="another checkout of plugserve (a git worktree): served beside this one, in turns",
    )  # fmt: skip
    parser.add_argument(
        "--wrk-threads", type=int, default=1, help="wrk's threads (1 here; more on many cores)"
    )
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument(
        "--runner", default=RUNNER_OPTIONS, help="extra [runner] TOML for plugserve"
    )
    parser.add_argument(
        "--only", nargs="+", default=["bare", "auto", "plugserve", "triton", "mlserver"],
        help="auto: plugserve with no thread or worker settings, as installed",
    )  # fmt: skip
    parser.add_argument(
        "--isolated", action="store_true",
        help="also a plugserve per --workers count with the runner in a process of its own",
    )  # fmt: skip
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plugserve-bench-"))
    model = MODELS[args.model](work / "peers" / f"{args.model}.onnx")
    options = f"instances = {args.instances}\n{args.runner}"
    plugins = write_mlp_runner(work, options, args.model)
    variants = [("", plugins)]
    if args.isolated:
        isolated = write_mlp_runner(work / "iso", options + '\nisolation = "process"', args.model)
        variants.append(("-iso", isolated))
    as_installed = write_mlp_runner(work / "auto", "", args.model)

    base = ort_baseline(model)
    one = ort_baseline(model, intra_op_threads=1)
    for label, b in (("default session", base), ("1 intra-op thread", one)):
        print(f"ONNX Runtime in-process, {label}: batch-1 p50 {b['p50_us']:.0f} us, "
              f"batch-64 {b['rows_per_s']:.0f} rows/s", flush=True)  # fmt: skip
    json_script = lua_script(work, json_body(), {"Content-Type": "application/json"})
    body, header_len = binary_body()
    bin_script = lua_script(work, body, {"Content-Type": "application/octet-stream",
                                         "Inference-Header-Content-Length": str(header_len)})  # fmt: skip

    servers: list[Server] = []
    cases: list[Case] = []
    try:
        # Every server is up for the whole run; they take turns under load, round after round.
        if "bare" in args.only:
            port = free_port()
            server = Server([sys.executable, "-c", BARE, str(port)], port, work / "bare.log")
            # In the list before it is waited for: stopped in finally even if never ready.
            servers.append(server)
            server.wait("/health", 30)
            url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
            cases += [
                Case("bare", "json", url, json_script, server),
                Case("bare", "binary", url, bin_script, server),
            ]
        checkouts: list[tuple[str, Path | None]] = [("plugserve", None)]
        if args.baseline is not None:
            checkouts.append(("baseline", args.baseline.resolve()))
        if "auto" in args.only:
            for label, checkout in checkouts:
                port = free_port()
                command = [sys.executable, "-m", "plugserve", "serve", "--plugins-dir", str(as_installed),
                           "--models-dir", str(as_installed.parent / "models"), "--port", str(port),
                           "--grpc-port", str(free_port()), "--log-level", "warning"]  # fmt: skip
                name = f"{label}-auto"
                server = Server(command, port, work / f"{name}.log", checkout=checkout)
                servers.append(server)
                server.wait("/v2/health/ready", 60)
                # This checkout chooses one worker per usable core; an older one, one worker.
                count = usable_cores() if admin_workers(port) is not None else 1
                if count > 1:
                    wait_workers(server, count)
                url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
                cases += [Case(name, "json", url, json_script, server, port, count),
                          Case(name, "binary", url, bin_script, server, port, count)]  # fmt: skip
        if "plugserve" in args.only:
            for (suffix, folder), n, (label, checkout) in itertools.product(
                variants, args.workers, checkouts
            ):
                port = free_port()
                command = [sys.executable, "-m", "plugserve", "serve", "--plugins-dir", str(folder),
                           "--models-dir", str(folder.parent / "models"), "--port", str(port),
                           "--grpc-port", str(free_port()), "--log-level", "warning"]  # fmt: skip
                command += ["--workers", str(n)]
                name = f"{label}-w{n}{suffix}"
                server = Server(command, port, work / f"{name}.log", checkout=checkout)
                servers.append(server)
                server.wait("/v2/health/ready", 60)
                if n > 1:
                    wait_workers(server, n)
                url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
                cases += [Case(name, "json", url, json_script, server, port, n),
                          Case(name, "binary", url, bin_script, server, port, n)]  # fmt: skip
        if "triton" in args.only and not args.no_triton:
            port = _two_free_ports()  # HTTP on port, gRPC on port + 1
            command = ["bash", str(TRITON), str(model), str(port), "64", "2000"]
            server = Server(command, port, work / "triton.log")
            servers.append(server)
            server.wait(f"/v2/models/{model.stem}/ready", 900)
            url = f"http://127.0.0.1:{port}/v2/models/{model.stem}/infer"
            cases += [Case("triton", "json", url, json_script, server),
                      Case("triton", "binary", url, bin_script, server)]  # fmt: skip
        if "mlserver" in args.only and not args.no_mlserver:
            port = free_port()
            command = ["bash", str(PEER), str(model), str(port), "64", "0.002"]
            server = Server(command, port, work / "mlserver.log")
            servers.append(server)
            server.wait("/v2/health/ready", 600)
            url = f"http://127.0.0.1:{port}/v2/models/{model.stem}/infer"
            cases.append(Case("mlserver", "json", url, json_script, server))
        rows = measure(cases, args.concurrency, args.rounds, args.duration, args.wrk_threads)
    finally:
        for server in servers:
            server.stop()
    fastest = min(base["p50_us"], one["p50_us"])
    print_summary(rows, {**base, "best_p50_us": fastest}, args.workers)


def _two_free_ports() -> int:
    """A free port whose next one is free too (Triton's HTTP and gRPC)."""
    while True:
        port = free_port()
        with contextlib.suppress(OSError), socket.socket() as probe:
            probe.bind(("127.0.0.1", port + 1))
            return port


@dataclass
class Row:
    name: str
    payload: str
    c: int
    result: Result  # medians over the rounds (errors summed)
    batch: float | None
    cpu_us: float | None
    shares: list[float] | None  # per worker, largest first: medians over the rounds by rank
    share_by: str
    supervisor: float | None
    runs: list[Sample]  # one per round, in order


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def measure(
    cases: list[Case], concurrency: list[int], rounds: int, duration: int, threads: int = 1
) -> list[Row]:
    samples: dict[tuple[str, str, int], list[Sample]] = {}
    for round_no in range(1, rounds + 1):
        for case in cases:
            for c in concurrency:
                wrk(case.url, case.script, c, 1, threads)  # warm up
                s = measure_once(case, c, duration, threads)
                samples.setdefault((case.name, case.payload, c), []).append(s)
                r = s.result
                print(f"  round {round_no} {case.name:12} {case.payload:6} c={c:<3} {r.rps:9.0f} req/s"
                      f"  p50 {r.p50_ms:7.2f} ms  p99 {r.p99_ms:7.2f} ms  errors {r.errors}"
                      + (f"  CPU {s.cpu_us:6.0f} us/req" if s.cpu_us is not None else "")
                      + (f"  mean batch {s.batch:.1f}" if s.batch else "")
                      + (f"  stolen {s.stolen:.2f} cores" if s.stolen >= 0.01 else ""), flush=True)  # fmt: skip
                if s.spread:
                    print(f"      {s.spread.describe()}", flush=True)
    rows: list[Row] = []
    for (name, payload, c), runs in samples.items():
        results = [s.result for s in runs]
        median = Result(
            statistics.median(r.rps for r in results),
            statistics.median(r.p50_ms for r in results),
            statistics.median(r.p99_ms for r in results),
            sum(r.errors for r in results),
            sum(r.requests for r in results),
        )
        spreads = [s.spread for s in runs if s.spread]
        shares = None
        if spreads:
            ranked = [sp.shares() for sp in spreads]
            width = min(len(r) for r in ranked)
            shares = [statistics.median(r[i] for r in ranked) for i in range(width)]
        rows.append(Row(
            name, payload, c, median,
            _median([s.batch for s in runs]),
            _median([s.cpu_us for s in runs]),
            shares,
            "/".join(sorted({sp.by for sp in spreads})),
            _median([sp.supervisor for sp in spreads]),
            runs,
        ))  # fmt: skip
    return rows


def _verdict(line: str, ok: bool) -> None:
    print(f"{line}  {'PASS' if ok else 'MISS'}")


def paired(
    top: Row, bottom: Row, value: Callable[[Sample], float | None], ratio: bool = True
) -> tuple[float | None, str]:
    """``top / bottom`` (or ``top - bottom``) of ``value`` within each round: the median of
    those, and them all as text ("4.5, 5.2, 4.5")."""
    each = []
    for a, b in zip(top.runs, bottom.runs, strict=False):
        x, y = value(a), value(b)
        if x is not None and y:
            each.append(x / y if ratio else x - y)
    if not each:
        return None, ""
    shown = ", ".join(f"{v:.2f}" if ratio else f"{v:+.0f}" for v in each)
    return statistics.median(each), shown


def _rps(sample: Sample) -> float:
    return sample.result.rps


def _cpu(sample: Sample) -> float | None:
    return sample.cpu_us


def _batch(sample: Sample) -> float | None:
    return sample.batch


def print_summary(rows: list[Row], base: dict[str, float], workers: list[int]) -> None:
    table = {(r.name, r.payload, r.c): r for r in rows}
    print("\nMedians over the rounds:")
    print("\n| server | payload | c | req/s | p50 ms | p99 ms | CPU us/req | mean batch | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        r = row.result
        b = f"{row.batch:.1f}" if row.batch else ""
        cpu = f"{row.cpu_us:.0f}" if row.cpu_us is not None else ""
        print(f"| {row.name} | {row.payload} | {row.c} | {r.rps:.0f} | {r.p50_ms:.2f} | "
              f"{r.p99_ms:.2f} | {cpu} | {b} | {r.errors} |")  # fmt: skip
    spread_rows = [row for row in rows if row.shares]
    if spread_rows:
        print("\nLoad spread over workers (medians by rank, busiest first):")
        for row in spread_rows:
            shares = " / ".join(f"{s:.0%}" for s in row.shares or [])
            sup = "" if row.supervisor is None else f"; supervisor {row.supervisor:.1%} of CPU"
            print(f"  {row.name} {row.payload} c={row.c}: {row.share_by} share {shares}{sup}")

    print(f"\nONNX Runtime in-process batch-1 p50: {base['p50_us']:.0f} us; "
          f"batch-64: {base['rows_per_s']:.0f} rows/s")  # fmt: skip

    def rps(name: str, payload: str, c: int = 64) -> float | None:
        row = table.get((name, payload, c))
        return row.result.rps if row else None

    ml = table.get(("mlserver", "json", 64))
    w1j, w1b = table.get(("plugserve-w1", "json", 64)), table.get(("plugserve-w1", "binary", 64))
    w2j, w2b = table.get(("plugserve-w2", "json", 64)), table.get(("plugserve-w2", "binary", 64))
    bare_b = table.get(("bare", "binary", 64))

    def ratio(line: str, top: Row | None, bottom: Row | None, at_least: float) -> None:
        """A throughput ratio's verdict, by the median of the per-round ratios."""
        if top is None or bottom is None:
            return
        x, each = paired(top, bottom, _rps)
        if x is not None:
            _verdict(f"  {line} {x:.2f}x per round: {each} (target >= {at_least})", x >= at_least)

    print("\nIssue 13 (c=64, plugserve --workers 2):")
    if not (w2j or w2b):
        print("  no plugserve-w2 at c=64 in this run")
    ratio("JSON: workers 2 / workers 1 throughput", w2j, w1j, 1.4)
    ratio("JSON: workers 2 / MLServer throughput", w2j, ml, 5)
    ratio("binary: workers 2 / bare aiohttp throughput", w2b, bare_b, 0.40)
    for payload, two, one_ in (("JSON", w2j, w1j), ("binary", w2b, w1b)):
        if two and one_:
            d, each = paired(two, one_, _cpu)
            if d is not None:
                _verdict(f"  {payload}: server CPU per request, workers 2 / workers 1 {d - 1:+.1%}, "
                         f"per round: {each} (target <= +10%)", d <= 1.10)  # fmt: skip
    for c, payload in itertools.product(sorted({r.c for r in rows}), ("json", "binary")):
        series = [(n, rps(f"plugserve-w{n}", payload, c)) for n in workers]
        first = series[0][1]
        if len(series) > 1 and first:
            scaled = ", ".join(f"w{n} {v:.0f}" + (f" ({v / first:.2f}x)" if n != workers[0] else "")
                               for n, v in series if v)  # fmt: skip
            print(f"  c={c} {payload} req/s by workers (medians): {scaled}")

    if any(r.name.endswith("-iso") for r in rows):
        print("\nIssue 14 (isolated runner beside the in-worker one):")
        for n in workers:
            for c in sorted({r.c for r in rows}):
                for payload in ("json", "binary"):
                    inside = table.get((f"plugserve-w{n}", payload, c))
                    iso = table.get((f"plugserve-w{n}-iso", payload, c))
                    if not (inside and iso):
                        continue
                    d, each = paired(iso, inside, _cpu, ratio=False)
                    if d is not None:
                        _verdict(f"  w{n} c={c} {payload}: CPU per request isolated - in-worker "
                                 f"{d:+.0f} us, per round: {each} (target <= +40)", d <= 40)  # fmt: skip
        for payload in ("json", "binary"):
            iso2 = table.get(("plugserve-w2-iso", payload, 64))
            one = table.get(("plugserve-w1", payload, 64))
            two = table.get(("plugserve-w2", payload, 64))
            if iso2 and one and iso2.batch and one.batch:
                _verdict(f"  c=64 {payload}: mean batch w2 isolated {iso2.batch:.1f} vs w1 {one.batch:.1f} "
                         "(target >=)", iso2.batch >= one.batch)  # fmt: skip
            ratio(f"c=64 {payload}: throughput w2 isolated / w2 in-worker", iso2, two, 1.0)

    auto_j, auto_b = (
        table.get(("plugserve-auto", "json", 64)),
        table.get(("plugserve-auto", "binary", 64)),
    )
    tr_j, tr_b = table.get(("triton", "json", 64)), table.get(("triton", "binary", 64))
    if auto_j or tr_j:
        print("\nIssue 31 (c=64; plugserve-auto: no thread or worker settings given):")
    ratio("JSON: plugserve-auto / Triton throughput", auto_j, tr_j, 1.2)
    if auto_j and tr_j:
        d, each = paired(auto_j, tr_j, lambda x: x.result.p99_ms)
        if d is not None:
            _verdict(f"  JSON: plugserve-auto / Triton p99 {d:.2f}, per round: {each} "
                     "(target <= 1)", d <= 1.0)  # fmt: skip
    ratio("JSON: plugserve-w1 / Triton throughput", w1j, tr_j, 0.7)
    ratio("JSON: plugserve-auto / MLServer throughput", auto_j, ml, 6)
    ratio("binary: plugserve-auto / Triton throughput", auto_b, tr_b, 1.2)
    tuned = [r for r in rows if r.name.startswith("plugserve-w") and r.c == 64]
    for payload, auto in (("json", auto_j), ("binary", auto_b)):
        best = max((r for r in tuned if r.payload == payload), key=lambda r: r.result.rps,
                   default=None)  # fmt: skip
        if auto and best:
            ratio(f"{payload}: plugserve-auto / the best tuned ({best.name})", auto, best, 0.9)
    auto_1 = table.get(("plugserve-auto", "json", 1))
    if auto_1:
        over = auto_1.result.p50_ms * 1000 - base["best_p50_us"]
        _verdict(f"  c=1 JSON: plugserve-auto p50 {auto_1.result.p50_ms * 1000:.0f} us = ONNX Runtime's "
                 f"best warm batch-1 + {over:.0f} us (target <= +150 us)", over <= 150)  # fmt: skip

    print("\nEarlier targets (plugserve --workers 1):")
    ratio("c=64 JSON: plugserve/MLServer throughput", w1j, ml, 4)
    if w1j and ml:
        p = w1j.result.p99_ms / ml.result.p99_ms
        _verdict(f"  c=64 JSON: plugserve/MLServer p99 ratio {p:.2f} (target <= 0.5)", p <= 0.5)
    ps1 = table.get(("plugserve-w1", "json", 1))
    if ps1:
        over = ps1.result.p50_ms * 1000 - base["p50_us"]
        _verdict(f"  c=1 JSON: plugserve p50 {ps1.result.p50_ms * 1000:.0f} us = ORT + {over:.0f} us "
                 "(target <= +250 us)", over <= 250)  # fmt: skip
    ratio("c=64 binary: plugserve/bare aiohttp throughput", w1b, bare_b, 0.40)


if __name__ == "__main__":
    main()
