"""gRPC against HTTP binary: plugserve's KServe v2 gRPC service beside its binary tensors, MLServer's gRPC as the peer.

    apt-get install -y wrk nghttp2-client   # wrk (HTTP/1.1) and h2load (HTTP/2): C load generators
    python -m tests.benchmarks.grpc_http [--duration 10] [--concurrency 1 64] [--workers 1 2]
                                         [--rounds 3] [--streams 1] [--generator-threads 1]
                                         [--no-generator-check] [--no-mlserver] [--mlserver-json]
                                         [--no-triton] [--no-auto]
                                         [--grpc-engine native grpcio]
                                         [--baseline OTHER_CHECKOUT]

Issue 15's target, in one run on one machine: the serving benchmark's medium
MLP (tests/benchmarks/serving.py: 256 -> 1024 -> 1024 -> 1024 -> 10, FP32,
batching 64 / 2 ms), one row per request, served by

- plugserve, one server per ``--workers`` count and ``--grpc-engine`` (native, the
  default, and grpcio, named ``-grpcio``), each with ``--grpc-port``:
  Triton's ``ModelInfer`` over gRPC (the row in ``raw_input_contents``) and
  HTTP with binary tensors (Triton's binary extension, as serving.py sends it);
- the floors: serving.py's bare aiohttp handler (reads the body, answers a
  constant) and a bare grpc.aio server on uvloop (``ModelInfer`` answers a
  constant message): what any server on each stack costs here (``--no-bare``
  leaves them out);
- plugserve as installed (``plugserve-auto``: no ``--workers``, no thread setting;
  ``--no-auto`` leaves it out);
- the real NVIDIA Triton 2.51 (its Python backend running ONNX Runtime, dynamic
  batcher 64 / 2 ms, ../shared/peers/triton/serve.sh; ``--no-triton``): gRPC and
  HTTP binary, the same messages; its successful inferences counted from its
  statistics extension;
- MLServer 1.7.1 (adaptive batching 64 / 2 ms, ../shared/peers/mlserver/serve.sh)
  over gRPC, the same message (and its HTTP JSON with ``--mlserver-json``: it
  has no binary extension).

Every server is up for the whole run and they take turns under load, round
after round; the table gives medians over the rounds. HTTP is driven by wrk
(c connections, one request each in flight), gRPC by h2load with the same
shape: ``-c C -m 1``, c HTTP/2 connections with one stream each
(``--streams S``: c/S connections of S streams each), POSTing
the gRPC-framed message to ``/inference.GRPCInferenceService/ModelInfer``
with ``content-type: application/grpc`` and ``te: trailers``. h2load gives
req/s and the mean; p50 and p99 come from its ``--log-file`` (each request's
time to the end of its response).

h2load counts an HTTP 200 as a success even when the gRPC status in the
trailers is an error, so success is checked apart from it: before measuring,
one call with a real gRPC client (grpcio) must return OK and the answer
in-process ONNX Runtime gives; after each run the server's own counter of
answered calls (plugserve: ``plugserve_requests_total{protocol="grpc",
route="mlp",status="200"}``; MLServer: ``grpc_server_handled_total{grpc_code="OK",
grpc_method="ModelInfer"}``) must have grown by at least the requests h2load
completed and by at most those it started (the rest were in flight when it
stopped).

Beside the server's CPU per request (its whole process tree, from /proc) the
load generator's own CPU, from ``getrusage(RUSAGE_CHILDREN)`` around each
run: per request and in cores. And, at the highest concurrency, each case is
measured again with twice the generator threads (wrk ``-t``, h2load ``-t``:
each thread its own event loop and connections, as separate client processes
would be). The generator is called the bottleneck where its threads were 80%
busy or more; where they were not, yet doubling them gained 15% or more, the
verdict is "unclear" (on a shared 2-core machine that is mostly noise). Then
the ratios the target is stated in, each with PASS or MISS. Not run by CI.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import resource
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from plugserve.server.runtime.cores import usable_cores
from tests.benchmarks.serving import (
    BARE,
    DIMS,
    PEER,
    TRITON,
    Result,
    Server,
    Spread,
    _ms,
    _two_free_ports,
    admin_workers,
    binary_body,
    cpu_tree,
    json_body,
    lua_script,
    make_mlp,
    plugserve_stats,
    spread,
    wait_workers,
    write_mlp_runner,
    wrk,
)
from tests.helpers import free_port, metric

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"

BARE_GRPC = """
import asyncio, sys, grpc, uvloop
from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc as pbg
ANSWER = pb.ModelInferResponse(model_name="mlp", model_version="1")
class Service(pbg.GRPCInferenceServiceServicer):
    async def ModelInfer(self, request, context):
        return ANSWER
async def main():
    server = grpc.aio.server()
    pbg.add_GRPCInferenceServiceServicer_to_server(Service(), server)
    server.add_insecure_port("127.0.0.1:" + sys.argv[1])
    await server.start()
    await server.wait_for_termination()
uvloop.run(main())
"""
"""The floor of any grpc.aio server here: a ModelInfer that answers at once, on uvloop
(as plugserve runs), beside serving.py's bare aiohttp handler, the floor of HTTP."""
GRPC_HEADERS = ("content-type: application/grpc", "te: trailers")
T = TypeVar("T")
# The generator limits a run when its threads are this busy, or when doubling them gains
# this much (beyond the noise of a machine whose cores the server shares).
GENERATOR_BUSY = 0.8
GENERATOR_GAIN = 1.15


# -- the gRPC message, checked with a real client ------------------------------------------


def infer_request(typed: bool = False) -> service_pb2.ModelInferRequest:
    """binary_body()'s row as a ModelInferRequest: in raw_input_contents, or in fp32_contents."""
    body, header_len = binary_body()
    raw = body[header_len:]
    request = service_pb2.ModelInferRequest(model_name="mlp")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, DIMS[0]])
    if typed:
        tensor.contents.fp32_contents.extend(np.frombuffer(raw, np.float32).tolist())
    else:
        request.raw_input_contents.append(raw)
    request.outputs.add(name="y")
    return request


def grpc_frame(folder: Path, request: service_pb2.ModelInferRequest, name: str) -> Path:
    """The request as h2load posts it: compressed flag 0, 4-byte big-endian length, message."""
    message = request.SerializeToString()
    path = folder / f"{name}.grpc"
    path.write_bytes(b"\0" + struct.pack(">I", len(message)) + message)
    return path


def expected_answer(model: Path) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    body, header_len = binary_body()
    row = np.frombuffer(body[header_len:], np.float32).reshape(1, DIMS[0])
    return np.asarray(session.run(None, {"x": row})[0])


def grpc_check(port: int, request: service_pb2.ModelInferRequest, expected: np.ndarray) -> None:
    """One ModelInfer with grpcio: it must return OK and the answer ONNX Runtime gives."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(request, timeout=30)
    out = response.outputs[0]
    if response.raw_output_contents:
        got = np.frombuffer(response.raw_output_contents[0], np.float32)
    else:
        got = np.asarray(out.contents.fp32_contents, np.float32)
    got = got.reshape(tuple(out.shape))
    if out.datatype != "FP32" or not np.allclose(got, expected, atol=1e-4):
        raise AssertionError(f"port {port}: {out.datatype} {got} != ONNX Runtime's {expected}")


def message_for(port: int, expected: np.ndarray) -> tuple[service_pb2.ModelInferRequest, str]:
    """The raw-contents request where the server accepts it, else the typed one."""
    raw = infer_request()
    try:
        grpc_check(port, raw, expected)
        return raw, "raw_input_contents"
    except grpc.RpcError as exc:
        print(f"port {port}: raw_input_contents refused ({exc}); using fp32_contents", flush=True)
    typed = infer_request(typed=True)
    grpc_check(port, typed, expected)
    return typed, "fp32_contents"


# -- the load generators, and their own CPU ------------------------------------------------


@dataclass
class Load:
    """One load generator run: its result and what it cost."""

    result: Result
    started: int  # requests sent; the same as result.requests for wrk
    mean_ms: float
    cpu_s: float  # the generator's user + system time
    seconds: float  # wall time of the run


def h2load(
    url: str, body: Path, connections: int, duration: int, log: Path, streams: int, threads: int
) -> Load:
    """h2load keeping ``connections`` calls in flight, ``streams`` of them per connection."""
    streams = min(streams, connections)
    command = ["h2load", f"-c{max(1, connections // streams)}", f"-m{streams}", f"-t{threads}",
               f"-D{duration}", "-d", str(body), "--log-file", str(log), url]  # fmt: skip
    for header in GRPC_HEADERS:
        command += ["-H", header]
    log.unlink(missing_ok=True)  # h2load appends to it
    out, cpu_s, seconds = _timed(lambda: _run(command))
    rps = float(_find(r"finished in [\d.]+s, ([\d.]+) req/s", out)[0])
    counts = _find(r"requests: \d+ total, (\d+) started, (\d+) done, \d+ succeeded, "
                   r"(\d+) failed, (\d+) errored, (\d+) timeout", out)  # fmt: skip
    started, done, *failures = (int(n) for n in counts)
    non_2xx = sum(
        int(n) for n in _find(r"status codes: \d+ 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    )
    mean = _ms(_find(r"time for request:\s+\S+\s+\S+\s+(\S+)", out)[0])
    times = [int(line.split("\t")[2]) / 1000 for line in log.read_text().splitlines() if line]
    p50, p99 = np.percentile(times, [50, 99]) if times else (float("nan"), float("nan"))
    result = Result(rps, float(p50), float(p99), sum(failures) + non_2xx, done)
    return Load(result, started, mean, cpu_s, seconds)


def wrk_load(url: str, script: Path, connections: int, duration: int, threads: int) -> Load:
    result, cpu_s, seconds = _timed(lambda: wrk(url, script, connections, duration, threads))
    return Load(result, result.requests, float("nan"), cpu_s, seconds)


def _timed(run: Callable[[], T]) -> tuple[T, float, float]:
    """run()'s value, the CPU of the children it waited for, and its wall time."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    value = run()
    after, seconds = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - start
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return value, cpu, seconds


def _run(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def _find(pattern: str, text: str) -> tuple[str, ...]:
    match = re.search(pattern, text)
    if match is None:
        raise ValueError(f"no {pattern!r} in:\n{text}")
    return match.groups()


# -- the server's own count of answered calls ----------------------------------------------


@dataclass(frozen=True)
class Counter:
    """A Prometheus counter, summed over the series that carry ``labels``."""

    url: str
    name: str
    labels: tuple[tuple[str, str], ...]

    def read(self) -> float:
        with urllib.request.urlopen(self.url, timeout=10) as r:
            return metric(r.read(), self.name, **dict(self.labels))

    def settled(self, timeout: float = 5.0) -> float:
        """The count once two reads 0.2 s apart agree (calls cut off at the end of a run may
        still be finishing)."""
        last, deadline = self.read(), time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = self.read()
            if now == last:
                break
            last = now
        return last


@dataclass(frozen=True)
class TritonCounter(Counter):
    """Triton's successful inferences of a model, from its statistics extension (its
    Prometheus metrics are off in the peer): every protocol's, which in a gRPC run are
    the gRPC calls."""

    def read(self) -> float:
        with urllib.request.urlopen(self.url, timeout=10) as r:
            doc = json.load(r)
        return float(sum(m["inference_stats"]["success"]["count"] for m in doc["model_stats"]))


def triton_counter(port: int, model: str) -> Counter:
    return TritonCounter(f"http://127.0.0.1:{port}/v2/models/{model}/stats", "", ())


def plugserve_counter(port: int) -> Counter:
    labels = (("protocol", "grpc"), ("route", "mlp"), ("status", "200"))
    return Counter(f"http://127.0.0.1:{port}/metrics", "plugserve_requests_total", labels)


def mlserver_counter(metrics_port: int) -> Counter:
    labels = (("grpc_code", "OK"), ("grpc_method", "ModelInfer"))
    return Counter(f"http://127.0.0.1:{metrics_port}/metrics", "grpc_server_handled_total", labels)


# -- cases and measurements ----------------------------------------------------------------


@dataclass
class Case:
    name: str  # plugserve-w1, mlserver
    protocol: str  # grpc, binary, json
    url: str
    payload: Path  # the gRPC frame for h2load, the wrk script otherwise
    server: Server
    counter: Counter | None = None  # gRPC: the server's count of OK calls
    stats_port: int | None = None  # plugserve: batch statistics
    workers: int = 1


@dataclass
class Sample:
    load: Load
    threads: int  # the generator's
    batch: float | None
    cpu_us: float | None  # server CPU per completed request, whole process tree
    counted: float | None  # the server's count of OK calls over the run (gRPC)
    spread: Spread | None

    @property
    def checked(self) -> bool:
        """The server counted every call h2load completed, and none it did not start."""
        if self.counted is None:
            return True
        return self.load.result.requests <= self.counted <= self.load.started


def measure_once(
    case: Case, c: int, duration: int, threads: int, streams: int, work: Path
) -> Sample:
    """One generator run, with the server's CPU, stats and count read around it, not inside it."""
    grpc_streams = min(streams, c) if case.protocol == "grpc" else 1
    threads = min(threads, max(1, c // grpc_streams))  # at most one per connection
    root = case.server.proc.pid
    stats = plugserve_stats(case.stats_port) if case.stats_port else None
    listed = admin_workers(case.stats_port) if case.stats_port and case.workers > 1 else None
    count = case.counter.settled() if case.counter else None
    cpu_before = cpu_tree(root)
    if case.protocol == "grpc":
        load = h2load(case.url, case.payload, c, duration, work / "h2load.log", streams, threads)
    else:
        load = wrk_load(case.url, case.payload, c, duration, threads)
    cpu_after = cpu_tree(root)
    cpu_s = sum(t for _, t in cpu_after.values()) - sum(t for _, t in cpu_before.values())
    requests = load.result.requests
    cpu_us = cpu_s / requests * 1e6 if requests else None
    counted = case.counter.settled() - count if case.counter and count is not None else None
    batch = None
    if case.stats_port and stats:
        after = plugserve_stats(case.stats_port)
        batch = (after[1] - stats[1]) / max(1, after[0] - stats[0])
    where = None
    if case.workers > 1:
        listed_after = admin_workers(case.stats_port) if case.stats_port else None
        where = spread(root, (cpu_before, cpu_after), (listed, listed_after))
    return Sample(load, threads, batch, cpu_us, counted, where)


def warm_up(case: Case, c: int, streams: int, work: Path) -> None:
    if case.protocol == "grpc":
        h2load(case.url, case.payload, c, 1, work / "warm.log", streams, 1)
    else:
        wrk(case.url, case.payload, c, 1)


def describe(round_no: int, case: Case, c: int, s: Sample) -> str:
    r, load = s.load.result, s.load
    line = (f"  round {round_no} {case.name:12} {case.protocol:6} c={c:<3} t={s.threads} {r.rps:8.0f} req/s"
            f"  p50 {r.p50_ms:6.2f} ms  p99 {r.p99_ms:6.2f} ms  errors {r.errors}")  # fmt: skip
    if case.protocol == "grpc":
        line += f" (h2load mean {load.mean_ms:.2f})"
    if s.cpu_us is not None:
        line += f"  server {s.cpu_us:5.0f} us/req"
    if r.requests:
        line += (f"  generator {load.cpu_s / r.requests * 1e6:4.0f} us/req "
                 f"({load.cpu_s / load.seconds:.2f} cores)")  # fmt: skip
    if s.batch:
        line += f"  mean batch {s.batch:.1f}"
    if s.counted is not None:
        verdict = "ok" if s.checked else "MISMATCH"
        line += (f"  server counted {s.counted:.0f} OK of {r.requests} done/"
                 f"{load.started} started: {verdict}")  # fmt: skip
    return line


Key = tuple[str, str, int, int]  # name, protocol, c, generator threads


def measure(cases: list[Case], args: argparse.Namespace, work: Path) -> dict[Key, list[Sample]]:
    samples: dict[Key, list[Sample]] = {}
    top = max(args.concurrency)
    for round_no in range(1, args.rounds + 1):
        for case, c in itertools.product(cases, args.concurrency):
            tries = [args.generator_threads]
            if c == top and not args.no_generator_check:
                tries.append(2 * args.generator_threads)
            for threads in tries:
                warm_up(case, c, args.streams, work)
                s = measure_once(case, c, args.duration, threads, args.streams, work)
                samples.setdefault((case.name, case.protocol, c, threads), []).append(s)
                print(describe(round_no, case, c, s), flush=True)
                if s.spread:
                    print(f"      {s.spread.describe()}", flush=True)
    return samples


# -- servers -------------------------------------------------------------------------------


def start_plugserve(
    plugins: Path,
    workers: int,
    work: Path,
    frame: Path,
    script: Path,
    engine: str = "grpcio",
    checkout: Path | None = None,
) -> tuple[Server, int, list[Case]]:
    """A plugserve with ``--workers`` and ``--grpc-engine`` (of ``checkout``, another copy of
    plugserve, if given: named ``-baseline``), its gRPC port, and its two cases."""
    port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "plugserve", "serve", "--plugins-dir", str(plugins),
               "--models-dir", str(plugins.parent / "models"), "--port", str(port),
               "--grpc-port", str(grpc_port), "--log-level", "warning"]  # fmt: skip
    command += ["--workers", str(workers)] if workers else []  # 0: as installed
    command += ["--grpc-engine", engine]
    name = (f"plugserve-w{workers}" if workers else "plugserve-auto") + _suffix(engine)
    name += "" if checkout is None else "-baseline"
    server = Server(command, port, work / f"{name}.log", checkout=checkout)
    return server, grpc_port, [
        Case(name, "grpc", f"http://127.0.0.1:{grpc_port}{MODEL_INFER}", frame, server,
             plugserve_counter(port), port, workers),
        Case(name, "binary", f"http://127.0.0.1:{port}/v2/models/mlp/infer", script, server,
             None, port, workers),
    ]  # fmt: skip


def _suffix(engine: str) -> str:
    """Servers of the default engine go by plain names; the others' say which."""
    return "" if engine == "native" else f"-{engine}"


@dataclass
class Run:
    cases: list[Case] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)
    contents: dict[str, str] = field(default_factory=dict)  # server name: how its gRPC row travels


def start_all(args: argparse.Namespace, work: Path, run: Run) -> None:
    """Every server, each checked with one real gRPC call; cases in ``run``."""
    model = make_mlp(work / "mlp.onnx")
    expected = expected_answer(model)
    plugins = write_mlp_runner(work)
    as_installed = write_mlp_runner(work / "auto", "")  # no thread setting: the server's
    body, header_len = binary_body()
    binary = lua_script(work, body, {"Content-Type": "application/octet-stream",
                                     "Inference-Header-Content-Length": str(header_len)})  # fmt: skip
    raw_frame = grpc_frame(work, infer_request(), "raw")
    if not args.no_bare:
        port, grpc_port = free_port(), free_port()
        bare = Server([sys.executable, "-c", BARE, str(port)], port, work / "bare.log")
        run.servers.append(bare)
        bare.wait("/health", 30)
        bare_grpc = Server([sys.executable, "-c", BARE_GRPC, str(grpc_port)], port,
                           work / "bare-grpc.log")  # fmt: skip
        run.servers.append(bare_grpc)
        time.sleep(2)
        run.cases += [
            Case("bare", "binary", f"http://127.0.0.1:{port}/v2/models/mlp/infer", binary, bare),
            Case("bare", "grpc", f"http://127.0.0.1:{grpc_port}{MODEL_INFER}", raw_frame,
                 bare_grpc),
        ]  # fmt: skip
    counts = [*args.workers, *([] if args.no_auto else [0])]
    checkouts = [None, *([] if args.baseline is None else [args.baseline.resolve()])]
    for engine, n, checkout in itertools.product(args.grpc_engine, counts, checkouts):
        folder = plugins if n else as_installed
        server, grpc_port, cases = start_plugserve(
            folder, n, work, raw_frame, binary, engine, checkout
        )
        run.servers.append(server)  # stopped in finally even if never ready
        server.wait("/v2/health/ready", 120)
        if n == 0:  # as installed: a worker per usable core
            for case in cases:
                case.workers = usable_cores()
        if (n or usable_cores()) > 1:
            wait_workers(server, n or usable_cores())
        grpc_check(grpc_port, infer_request(), expected)
        run.contents[cases[0].name] = "raw_input_contents"
        run.cases += cases
    if not args.no_triton:
        port = _two_free_ports()  # serve.sh: HTTP on port, gRPC on port + 1
        command = ["bash", str(TRITON), str(model), str(port), "64", "2000"]
        server = Server(command, port, work / "triton.log")
        run.servers.append(server)
        server.wait(f"/v2/models/{model.stem}/ready", 900)
        grpc_check(port + 1, infer_request(), expected)
        run.contents["triton"] = "raw_input_contents"
        url = f"http://127.0.0.1:{port + 1}{MODEL_INFER}"
        run.cases += [
            Case("triton", "grpc", url, raw_frame, server, triton_counter(port, model.stem)),
            Case("triton", "binary", f"http://127.0.0.1:{port}/v2/models/{model.stem}/infer",
                 binary, server),
        ]  # fmt: skip
    if args.no_mlserver:
        return
    port = free_port()  # serve.sh: gRPC on port + 1, metrics on port + 2
    command = ["bash", str(PEER), str(model), str(port), "64", "0.002"]
    server = Server(command, port, work / "mlserver.log")
    run.servers.append(server)
    server.wait("/v2/health/ready", 600)
    request, contents = message_for(port + 1, expected)
    run.contents["mlserver"] = contents
    frame = grpc_frame(work, request, "mlserver")
    url = f"http://127.0.0.1:{port + 1}{MODEL_INFER}"
    run.cases.append(Case("mlserver", "grpc", url, frame, server, mlserver_counter(port + 2)))
    if args.mlserver_json:
        script = lua_script(work, json_body(), {"Content-Type": "application/json"})
        url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
        run.cases.append(Case("mlserver", "json", url, script, server))


# -- the summary ---------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    protocol: str
    c: int
    threads: int
    result: Result  # medians over the rounds (errors and requests summed)
    cpu_us: float | None
    gen_us: float | None  # the generator's CPU per request
    gen_cores: float
    batch: float | None
    checked: str  # gRPC: "ok", or how many runs the server's count contradicted h2load


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def rows_of(samples: dict[Key, list[Sample]]) -> list[Row]:
    rows = []
    for (name, protocol, c, threads), runs in samples.items():
        results = [s.load.result for s in runs]
        median = Result(
            statistics.median(r.rps for r in results),
            statistics.median(r.p50_ms for r in results),
            statistics.median(r.p99_ms for r in results),
            sum(r.errors for r in results),
            sum(r.requests for r in results),
        )
        bad = sum(not s.checked for s in runs)
        checked = "" if runs[0].counted is None else ("ok" if not bad else f"{bad} MISMATCH")
        rows.append(Row(
            name, protocol, c, threads, median,
            _median([s.cpu_us for s in runs]),
            _median([s.load.cpu_s / s.load.result.requests * 1e6 if s.load.result.requests else None
                     for s in runs]),
            statistics.median(s.load.cpu_s / s.load.seconds for s in runs),
            _median([s.batch for s in runs]),
            checked,
        ))  # fmt: skip
    return rows


def _verdict(line: str, ok: bool) -> None:
    print(f"{line}  {'PASS' if ok else 'MISS'}")


def print_table(rows: list[Row]) -> None:
    print("\nMedians over the rounds (t: generator threads; CPU: us per request, cores: "
          "the generator's CPU over the run's wall time):")  # fmt: skip
    print("\n| server | protocol | c | t | req/s | p50 ms | p99 ms | server CPU | generator CPU "
          "| generator cores | mean batch | errors | server's count |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        r = row.result
        cpu = f"{row.cpu_us:.0f}" if row.cpu_us is not None else ""
        gen = f"{row.gen_us:.0f}" if row.gen_us is not None else ""
        batch = f"{row.batch:.1f}" if row.batch else ""
        print(f"| {row.name} | {row.protocol} | {row.c} | {row.threads} | {r.rps:.0f} | "
              f"{r.p50_ms:.2f} | {r.p99_ms:.2f} | {cpu} | {gen} | {row.gen_cores:.2f} | "
              f"{batch} | {r.errors} | {row.checked} |")  # fmt: skip


def print_generator_check(rows: list[Row], threads: int) -> None:
    """Whether the generator limited a case: its threads saturated, or more of them gained."""
    table = {(r.name, r.protocol, r.c, r.threads): r for r in rows}
    doubled = [r for r in rows if r.threads == 2 * threads]
    if not doubled:
        return
    print(f"\nLoad generator check ({threads} vs {2 * threads} generator threads; the machine's "
          f"{os.cpu_count()} cores are shared by the server and the generator):")  # fmt: skip
    for two in doubled:
        one = table.get((two.name, two.protocol, two.c, threads))
        if one is None:
            continue
        gain, busy = two.result.rps / one.result.rps, one.gen_cores / threads
        if busy >= GENERATOR_BUSY:
            verdict = f"LIKELY THE BOTTLENECK: its threads busy {busy:.0%}"
        elif gain >= GENERATOR_GAIN:
            verdict = (
                f"UNCLEAR: its threads busy {busy:.0%}, yet more of them gained {gain - 1:.0%}"
            )
        else:
            verdict = (
                f"not the bottleneck: its threads busy {busy:.0%}, more of them gained no more"
            )
        print(f"  {two.name} {two.protocol} c={two.c}: {one.result.rps:.0f} req/s with {threads} "
              f"({one.gen_cores:.2f} cores), {two.result.rps:.0f} with {2 * threads} "
              f"({two.gen_cores:.2f} cores): {gain:.2f}x; generator {verdict}")  # fmt: skip


def print_ratios(
    rows: list[Row], workers: list[int], threads: int, engines: tuple[str, ...] = ("native",)
) -> None:
    table = {(r.name, r.protocol, r.c): r for r in rows if r.threads == threads}
    cs = sorted({r.c for r in rows})
    print("\nIssue 15 (gRPC against HTTP binary, same server, same load shape):")
    for n, c in itertools.product(workers, cs):
        g, b = (
            table.get((f"plugserve-w{n}", "grpc", c)),
            table.get((f"plugserve-w{n}", "binary", c)),
        )
        if g and b:
            x = g.result.rps / b.result.rps
            _verdict(f"  w{n} c={c}: gRPC / HTTP binary throughput {x:.2f}x "
                     f"({g.result.rps:.0f} vs {b.result.rps:.0f} req/s; target >= 1)", x >= 1.0)  # fmt: skip
        if g and b and c == 1:
            print(f"  w{n} c=1: p50 gRPC {g.result.p50_ms * 1000:.0f} us vs HTTP binary "
                  f"{b.result.p50_ms * 1000:.0f} us ({g.result.p50_ms / b.result.p50_ms:.2f}x; "
                  "no target stated)")  # fmt: skip
    for c in cs:
        g, b = table.get(("bare", "grpc", c)), table.get(("bare", "binary", c))
        if g and b:
            print(f"  floors c={c}: bare grpc.aio {g.result.rps:.0f} req/s, {g.cpu_us or 0:.0f} us "
                  f"CPU/call; bare aiohttp {b.result.rps:.0f} req/s, {b.cpu_us or 0:.0f} us")  # fmt: skip
    checked = [r for r in rows if r.checked]
    if checked:
        bad = [f"{r.name} c={r.c} t={r.threads}" for r in checked if r.checked != "ok"]
        _verdict("  every gRPC run: the server counted each call h2load completed as OK"
                 + (f" (not: {', '.join(bad)})" if bad else ""), not bad)  # fmt: skip
    names = [
        name + _suffix(engine)
        for engine in engines
        for name in [*(f"plugserve-w{n}" for n in workers), "plugserve-auto"]
    ]
    triton, bare = table.get(("triton", "grpc", 64)), table.get(("bare", "grpc", 64))
    if triton or bare:
        print("\nIssue 31 (gRPC ModelInfer at c=64, the same h2load for every server):")
    for name in names:
        g = table.get((name, "grpc", 64))
        if g and bare:
            x = g.result.rps / bare.result.rps
            _verdict(f"  {name}: gRPC / bare grpc.aio throughput {x:.2f}x ({g.result.rps:.0f} vs "
                     f"{bare.result.rps:.0f} req/s; target >= 0.7)", x >= 0.7)  # fmt: skip
        if g and triton:
            x = g.result.rps / triton.result.rps
            _verdict(f"  {name}: gRPC / Triton's gRPC throughput {x:.2f}x ({g.result.rps:.0f} vs "
                     f"{triton.result.rps:.0f} req/s, mean batch {g.batch or 0:.1f}; "
                     "target >= 1)", x >= 1.0)  # fmt: skip
    for n, c in itertools.product(workers, cs):
        g, m = table.get((f"plugserve-w{n}", "grpc", c)), table.get(("mlserver", "grpc", c))
        if g and m:
            print(f"  w{n} c={c}: plugserve gRPC / MLServer gRPC throughput "
                  f"{g.result.rps / m.result.rps:.2f}x, p50 {g.result.p50_ms:.2f} vs "
                  f"{m.result.p50_ms:.2f} ms, p99 {g.result.p99_ms:.2f} vs {m.result.p99_ms:.2f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="medians are taken over rounds")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[1], help="one plugserve per count"
    )
    parser.add_argument("--streams", type=int, default=1, help="h2load streams per connection")
    parser.add_argument("--generator-threads", type=int, default=1, help="wrk and h2load -t")
    parser.add_argument("--no-generator-check", action="store_true",
                        help="skip the runs with twice the generator threads")  # fmt: skip
    parser.add_argument("--no-mlserver", action="store_true")
    parser.add_argument("--no-triton", action="store_true")
    parser.add_argument("--no-auto", action="store_true",
                        help="skip plugserve as installed (no --workers, no thread setting)")  # fmt: skip
    parser.add_argument("--no-bare", action="store_true",
                        help="skip the bare aiohttp handler and the bare grpc.aio server")  # fmt: skip
    parser.add_argument("--mlserver-json", action="store_true", help="also MLServer's HTTP JSON")
    parser.add_argument("--grpc-engine", nargs="+", default=["native"],
                        choices=["grpcio", "native"], help="one plugserve per engine and count")  # fmt: skip
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout of plugserve (a git worktree): each plugserve "
                        "also from there, named -baseline, served in turns")  # fmt: skip
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plugserve-grpc-bench-"))
    run = Run()
    try:
        start_all(args, work, run)
        for name, contents in run.contents.items():
            print(f"{name}: gRPC call checked with grpcio (OK, ONNX Runtime's answer); "
                  f"row in {contents}", flush=True)  # fmt: skip
        samples = measure(run.cases, args, work)
    finally:
        for server in run.servers:
            server.stop()
    rows = rows_of(samples)
    print_table(rows)
    print_generator_check(rows, args.generator_threads)
    print_ratios(rows, args.workers, args.generator_threads, tuple(args.grpc_engine))


if __name__ == "__main__":
    main()
