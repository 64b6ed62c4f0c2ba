"""Serving benchmark: plugserve against MLServer, a bare aiohttp handler and in-process ONNX Runtime.

    apt-get install -y wrk          # the load generator, the same for every server
    python -m tests.benchmarks.serving [--duration 10] [--concurrency 1 64] [--no-mlserver]

One run, side by side on the same machine: the medium MLP
(256 -> 1024 -> 1024 -> 1024 -> 10, FP32) is generated, then

- ONNX Runtime in-process: batch-1 latency (p50) and batch-64 throughput, the
  physical limit;
- a bare aiohttp handler that reads the body and answers: the ceiling of any
  aiohttp server on this machine;
- plugserve (dynamic batching 64 / 2 ms) and MLServer 1.7.1 (adaptive batching
  64 / 2 ms, in-process, started by ../shared/peers/mlserver/serve.sh) with one
  row per request, v2 JSON; plugserve also with binary tensors.

wrk drives each with c concurrent connections; the table gives requests/s,
p50, p99 and the mean batch size, then the ratios the targets are stated in.
Not run by CI.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.helpers import ROOT, free_port

PEER = ROOT.parent / "shared" / "peers" / "mlserver" / "serve.sh"
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


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def wrk(url: str, script: Path, connections: int, duration: int) -> Result:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(script), url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    socket_errors = re.search(r"Socket errors: (.*)", out)
    errors = int(bad.group(1)) if bad else 0
    if socket_errors:
        errors += sum(int(n) for n in re.findall(r"\d+", socket_errors.group(1)))
    return Result(rps, p50, p99, errors)


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
    def __init__(self, command: list[str], port: int, log: Path, env: dict[str, str] | None = None):
        self.port = port
        self.log = log
        self.proc = subprocess.Popen(
            command, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )  # fmt: skip

    def wait(self, path: str, timeout: float = 300) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args} exited:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=1):
                    return self
            except Exception:
                time.sleep(0.2)
        raise TimeoutError(self.log.read_text()[-3000:])

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)


def plugserve_stats(port: int) -> tuple[int, int]:
    """(executions, rows) of the mlp runner, from the admin API."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/plugins") as r:
        row = next(p for p in json.load(r)["plugins"] if p["name"] == "mlp")
    return row.get("executions", 0), row.get("batched_rows", 0)


@dataclass
class Case:
    name: str
    payload: str
    url: str
    script: Path
    stats_port: int | None = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="medians are taken over rounds")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--no-mlserver", action="store_true")
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument(
        "--runner", default=RUNNER_OPTIONS, help="extra [runner] TOML for plugserve"
    )
    parser.add_argument("--only", nargs="+", default=["bare", "plugserve", "mlserver"])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plugserve-bench-"))
    model = make_mlp(work / "mlp.onnx")
    plugins = work / "plugins"
    runner = plugins / "runner" / "mlp" / "1.0.0"
    runner.mkdir(parents=True)
    (runner / "plugin.toml").write_text(
        '[plugin]\nname = "mlp"\nversion = "1.0.0"\ntype = "runner"\n'
        '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\n'
        f"max_batch_size = 64\nmax_queue_delay_ms = 2.0\ninstances = {args.instances}\n{args.runner}\n"
    )
    make_mlp(runner / "model.onnx")
    (work / "models").mkdir()

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
            servers.append(
                Server([sys.executable, "-c", BARE, str(port)], port, work / "bare.log").wait(
                    "/health", 30
                )
            )
            url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
            cases += [
                Case("bare", "json", url, json_script),
                Case("bare", "binary", url, bin_script),
            ]
        if "plugserve" in args.only:
            port = free_port()
            command = [sys.executable, "-m", "server", "serve", "--plugins-dir", str(plugins),
                       "--models-dir", str(work / "models"), "--port", str(port), "--log-level", "warning"]  # fmt: skip
            servers.append(
                Server(command, port, work / "plugserve.log").wait("/v2/health/ready", 60)
            )
            url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
            cases += [Case("plugserve", "json", url, json_script, port),
                      Case("plugserve", "binary", url, bin_script, port)]  # fmt: skip
        if "mlserver" in args.only and not args.no_mlserver:
            port = free_port()
            command = ["bash", str(PEER), str(model), str(port), "64", "0.002"]
            servers.append(
                Server(command, port, work / "mlserver.log").wait("/v2/health/ready", 600)
            )
            cases.append(
                Case(
                    "mlserver", "json", f"http://127.0.0.1:{port}/v2/models/mlp/infer", json_script
                )
            )
        results = measure(cases, args.concurrency, args.rounds, args.duration)
    finally:
        for server in servers:
            server.stop()
    print_summary(results, base)


Row = tuple[str, str, int, Result, float | None]


def measure(cases: list[Case], concurrency: list[int], rounds: int, duration: int) -> list[Row]:
    samples: dict[tuple[str, str, int], list[tuple[Result, float | None]]] = {}
    for round_no in range(1, rounds + 1):
        for case in cases:
            for c in concurrency:
                wrk(case.url, case.script, c, 1)  # warm up
                before = plugserve_stats(case.stats_port) if case.stats_port else None
                result = wrk(case.url, case.script, c, duration)
                batch = None
                if case.stats_port and before:
                    after = plugserve_stats(case.stats_port)
                    batch = (after[1] - before[1]) / max(1, after[0] - before[0])
                samples.setdefault((case.name, case.payload, c), []).append((result, batch))
                print(f"  round {round_no} {case.name:10} {case.payload:6} c={c:<3} {result.rps:9.0f} req/s"
                      f"  p50 {result.p50_ms:7.2f} ms  p99 {result.p99_ms:7.2f} ms  errors {result.errors}"
                      + (f"  mean batch {batch:.1f}" if batch else ""), flush=True)  # fmt: skip
    rows: list[Row] = []
    for (name, payload, c), runs in samples.items():
        median = Result(
            statistics.median(r.rps for r, _ in runs),
            statistics.median(r.p50_ms for r, _ in runs),
            statistics.median(r.p99_ms for r, _ in runs),
            sum(r.errors for r, _ in runs),
        )
        batches = [b for _, b in runs if b is not None]
        rows.append((name, payload, c, median, statistics.median(batches) if batches else None))
    return rows


def print_summary(
    rows: list[tuple[str, str, int, Result, float | None]], base: dict[str, float]
) -> None:
    table = {(n, p, c): r for n, p, c, r, _ in rows}
    print("\nMedians over the rounds:")
    print("\n| server | payload | c | req/s | p50 ms | p99 ms | mean batch | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, payload, c, r, batch in rows:
        b = f"{batch:.1f}" if batch else ""
        print(
            f"| {name} | {payload} | {c} | {r.rps:.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | {b} | {r.errors} |"
        )
    print(f"\nONNX Runtime in-process batch-1 p50: {base['p50_us']:.0f} us; "
          f"batch-64: {base['rows_per_s']:.0f} rows/s")  # fmt: skip
    ps64, ml64 = table.get(("plugserve", "json", 64)), table.get(("mlserver", "json", 64))
    if ps64 and ml64:
        print(f"c=64 JSON: plugserve/MLServer throughput {ps64.rps / ml64.rps:.2f}x (target >= 4), "
              f"p99 ratio {ps64.p99_ms / ml64.p99_ms:.2f} (target <= 0.5)")  # fmt: skip
    ps1 = table.get(("plugserve", "json", 1))
    if ps1:
        over = ps1.p50_ms * 1000 - base["p50_us"]
        print(
            f"c=1 JSON: plugserve p50 {ps1.p50_ms * 1000:.0f} us = ORT + {over:.0f} us (target <= +250 us)"
        )
    psb, bareb = table.get(("plugserve", "binary", 64)), table.get(("bare", "binary", 64))
    if psb and bareb:
        print(f"c=64 binary: plugserve/bare aiohttp {psb.rps / bareb.rps:.2f} (target >= 0.40)")


if __name__ == "__main__":
    main()
