"""Soak: minutes of mixed load while plugins reload every few seconds, plus faulty requests.

    python -m tests.benchmarks.soak [--minutes 3] [--clients 4] [--reload-every 3] [--hostile]

Starts ``plugserve serve`` on a temporary plugins folder (an ONNX runner behind a
preprocessor, a Python runner, an ONNX runner with a STRING input and a slow
Python runner with a bounded queue), drives it from several client threads over
keep-alive connections (v2 JSON, v2 binary, v2 BYTES, /predict), sends a few
faulty requests on purpose (malformed JSON, unknown routes, wrong shapes: the
expected-failure bucket), and meanwhile adds, edits and deletes plugin versions
every few seconds. ``--hostile`` adds the hostile mix of
``tests/benchmarks/hostile.py`` beside the same good traffic (gzip bombs,
half-open and slow-body connections, clients hanging up mid-queue, non-UTF-8
BYTES, malformed binary headers, huge JSON), so that two runs, with and without
it, compare good-request latency. Prints every good request's status (target:
all 200), good-request p50/p99 by kind, the expected-failure bucket, hostile
attempts by outcome, and the server's RSS, open file descriptors and threads
sampled over the run (target: flat). Exits 1 if a good request failed or a
faulty one got an answer other than its expected one. Not run by CI.

The hostile mix also sends what each client of a shared server must survive: prompts of
many MiB to the bundled chat and embeddings routes over OpenAI's API and Triton's generate,
tensors that ONNX Runtime refuses (shapes its declared inputs admit), silent gRPC
``ModelStreamInfer`` calls above the call limit, and gRPC streams that never read their
answers (``tests/benchmarks/hostile_grpc.py``), and, one at a time, the protocol attacks of
``tests/benchmarks/hostile_h2.py``: HTTP/2 floods, MadeYouReset, window storms and dribbles,
oversized and malformed headers, gzip bombs and unfinished messages on the gRPC port, and an
HTTP/1.1 connection pipelining far ahead of its answers (``--no-h2`` leaves them out). Good
traffic goes over HTTP and gRPC, and a prober asks ``/v2/health/live``, gRPC ``ServerLive``
and ``grpc.health.v1`` every 0.25 s (target: never refused, never over 2 s). The server's
RSS is sampled every second; its peak must stay within the start's RSS and, per worker, the
request byte budget and ``RSS_SLACK_MIB``. ``--workers N`` runs the supervisor with N workers;
``--isolated`` puts the ONNX runners in runner processes (``isolation = "process"``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import onnx
from onnx import TensorProto, helper

from tests.benchmarks import hostile, hostile_features, hostile_grpc, hostile_h2
from tests.helpers import (
    ROOT,
    ServerProcess,
    add_model,
    descendants,
    identity_model,
    rss_mib,
    write_plugin,
    write_processor,
)

ECHO = """
import numpy as np
import pluggy
hookimpl = pluggy.HookimplMarker("plugserve")

class Echo:
    def __init__(self, tag):
        self.tag = tag
    def infer(self, inputs):
        return {"tag": np.array([self.tag] * len(inputs["x"]), dtype=object)}

@hookimpl
def plugserve_create_component(plugin, config):
    return Echo(config["tag"])
"""

SLOW = """
import asyncio
import numpy as np
import pluggy
hookimpl = pluggy.HookimplMarker("plugserve")

class Slow:
    async def infer(self, inputs):
        await asyncio.sleep(0.2)
        return {"y": np.asarray(inputs["x"])}

@hookimpl
def plugserve_create_component(plugin, config):
    return Slow()
"""

Request = tuple[str, str, bytes, dict[str, str], set[int]]


def requests_for(rng: random.Random) -> tuple[str, Request]:
    """One request and its kind: method, path, body, headers, the statuses that count as expected.

    Good requests expect 200 and nothing else; the faulty ones (2 % each) form the
    expected-failure bucket.
    """
    x = [rng.random() for _ in range(4)]
    roll = rng.random()
    if roll < 0.02:
        return "malformed JSON", ("POST", "/v2/models/add/infer", b"{oops", {}, {400})
    if roll < 0.04:
        body = json.dumps({"inputs": []}).encode()
        return "unknown route", ("POST", "/v2/models/nope/infer", body, {}, {400, 404})
    if roll < 0.06:
        bad = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": x[:3]}]}
        return "wrong shape", ("POST", "/v2/models/add/infer", json.dumps(bad).encode(), {}, {400})
    if roll < 0.40:
        doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": x}]}
        return "v2 JSON", ("POST", "/v2/models/add/infer", json.dumps(doc).encode(), {}, {200})
    if roll < 0.62:
        raw = np.array([x], np.float32).tobytes()
        inputs = [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                   "parameters": {"binary_data_size": len(raw)}}]  # fmt: skip
        body, headers = hostile.binary_request(inputs, raw)
        return "v2 binary", ("POST", "/v2/models/add/infer", body, headers, {200})
    if roll < 0.80:
        blob = hostile.bytes_elements(f"good {roll:.6f}".encode())
        inputs = [{"name": "in_s", "datatype": "BYTES", "shape": [1, 1],
                   "parameters": {"binary_data_size": len(blob)}}]  # fmt: skip
        body, headers = hostile.binary_request(inputs, blob)
        return "v2 BYTES", ("POST", "/v2/models/strings/infer", body, headers, {200})
    if roll < 0.90:
        body = hostile.matmul_request(4, 4, x)
        return "v2 matmul", ("POST", "/v2/models/matmul/infer", body, {}, {200})
    body = json.dumps({"x": [x]}).encode()
    return "predict echo", ("POST", "/predict/echo", body, {}, {200})


SLOW_KIND = "predict slow"
CHAT_KIND = "chat completion"
"""Kinds whose latency is their runner's own (0.2 s a request; generation), left out of
the overall good-request percentiles."""


def chat_request(rng: random.Random) -> tuple[str, Request]:
    """A good, short chat completion from the bundled chat route."""
    messages = [{"role": "user", "content": f"hello {rng.randint(0, 999)}"}]
    body = json.dumps({"model": "chat", "messages": messages, "max_tokens": 8}).encode()
    return CHAT_KIND, ("POST", "/v1/chat/completions", body, {}, {200})


def slow_request(rng: random.Random) -> tuple[str, Request]:
    """A good request to the slow runner (0.2 s, one at a time, a bounded queue)."""
    body = json.dumps({"x": [[rng.random()]]}).encode()
    return SLOW_KIND, ("POST", "/predict/slow", body, {}, {200})


@dataclass
class Answers:
    """Every answer the soak's clients got, by kind and status, and good-request latencies."""

    counts: Counter[tuple[str, int, bool]] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, status: int, expected: set[int], seconds: float) -> None:
        with self.lock:
            self.counts[(kind, status, status in expected)] += 1
            if expected == {200}:
                self.latencies[kind].append(seconds)

    def add_good(self, kind: str, status: int, seconds: float) -> None:
        """A good request's answer: 200 expected."""
        self.add(kind, status, {200}, seconds)

    def good(self) -> Counter[int]:
        statuses: Counter[int] = Counter()
        for (kind, status, _), n in self.counts.items():
            if kind in self.latencies:
                statuses[status] += n
        return statuses

    def faulty(self) -> dict[str, dict[str, int]]:
        table: dict[str, dict[str, int]] = {}
        for (kind, status, ok), n in sorted(self.counts.items()):
            if kind not in self.latencies:
                table.setdefault(kind, {})[f"{status}{'' if ok else ' (unexpected)'}"] = n
        return table

    def failed(self) -> int:
        return sum(n for (_, _, ok), n in self.counts.items() if not ok)


def client(port: int, stop: threading.Event, seed: int, answers: Answers,
           make: Callable[[random.Random], tuple[str, Request]] = requests_for,
           pause_s: float = 0.0) -> None:  # fmt: skip
    """Send ``make``'s requests over one keep-alive connection until stopped."""
    rng = random.Random(seed)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    while not stop.wait(pause_s):
        kind, (method, path, body, headers, expected) = make(rng)
        started = time.perf_counter()
        try:
            conn.request(method, path, body, {"Content-Type": "application/json", **headers})
            response = conn.getresponse()
            response.read()
            status = response.status
        except (OSError, http.client.HTTPException):
            status = -1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        answers.add(kind, status, expected, time.perf_counter() - started)
    conn.close()


def churn(plugins: Path, stop: threading.Event, every: float, log: list[str]) -> None:
    """Add a version, edit one in place, delete the oldest: over and over."""
    version = 1
    while not stop.wait(every):
        version += 1
        staging = write_processor(plugins, "preprocessor", "scale", f".{version}.0.0.tmp", 0)
        manifest = staging / "plugin.toml"
        manifest.write_text(manifest.read_text().replace(f".{version}.0.0.tmp", f"{version}.0.0"))
        staging.rename(staging.with_name(f"{version}.0.0"))
        echo = plugins / "runner" / "echo" / "1.0.0" / "plugin.toml"
        echo.write_text(echo.read_text().replace(f'"v{version - 1}"', f'"v{version}"'))
        old = plugins / "preprocessor" / "scale" / f"{version - 2}.0.0"
        if version > 3 and old.exists():
            shutil.rmtree(old)
        log.append(f"scale@{version}.0.0 added, echo edited to v{version}")


@dataclass(frozen=True)
class Sample:
    """The server's processes (the supervisor, workers, runner processes) at one moment:
    seconds since the soak began, their RSS, open fds and threads, summed."""

    at_s: float
    rss_mib: float
    fds: int
    threads: int

    @classmethod
    def take(cls, pid: int, began: float) -> Sample:
        rss, fds, threads = 0.0, 0, 0
        for each in {pid, *descendants(pid)}:
            try:
                status = Path(f"/proc/{each}/status").read_text()
                threads += next(int(line.split()[1]) for line in status.splitlines()
                                if line.startswith("Threads:"))  # fmt: skip
                fds += len(os.listdir(f"/proc/{each}/fd"))
                rss += rss_mib(each)
            except (OSError, RuntimeError, StopIteration):
                continue  # ended meanwhile
        return cls(time.monotonic() - began, rss, fds, threads)


def matmul_model(path: Path) -> None:
    """``y = a @ b``, row by row: ``a`` ``[N, k]`` and ``b`` ``[N, j]`` with ``k`` and ``j``
    named apart, so only ONNX Runtime, at run time, finds that they must be equal."""
    a = helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, ["N", "k"])
    b = helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, ["N", "j"])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 1, 1])
    rows = helper.make_tensor("rows", onnx.TensorProto.INT64, [1], [1])
    columns = helper.make_tensor("columns", onnx.TensorProto.INT64, [1], [2])
    nodes = [
        helper.make_node("Unsqueeze", ["a", "rows"], ["a3"]),
        helper.make_node("Unsqueeze", ["b", "columns"], ["b3"]),
        helper.make_node("MatMul", ["a3", "b3"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "matmul", [a, b], [y], initializer=[rows, columns])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


BUNDLED = ["preprocessor/chat_template", "runner/chat", "postprocessor/detokenize",
           "preprocessor/tokenize", "runner/embed", "postprocessor/pool"]  # fmt: skip
"""The bundled plugins the soak serves beside its own: OpenAI's and Triton's text routes."""


def write_plugins(plugins: Path, models: Path, isolated: bool = False, workers: int = 1) -> None:
    """The soak's plugins: add (behind scale), echo, strings, slow, matmul, and the bundled
    chat and embed routes with their models; ``isolated``: the ONNX runners in processes."""
    isolation = 'isolation = "process"\n' if isolated else ""
    write_processor(plugins, "preprocessor", "scale", "1.0.0", 0)
    folder = write_plugin(plugins, "runner", "add", "1.0.0",
                          '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\nmax_batch_size = 16\n'
                          f'intra_op_threads = 1\n{isolation}[route]\npreprocess = ["scale"]\n', module=None)  # fmt: skip
    add_model(folder / "model.onnx")
    write_plugin(plugins, "runner", "echo", "1.0.0", '[config]\ntag = "v1"\n[runner]\nmax_batch_size = 8\n',
                 {"plugin.py": ECHO})  # fmt: skip
    folder = write_plugin(plugins, "runner", "strings", "1.0.0",
                          '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\nmax_batch_size = 8\n'
                          f'intra_op_threads = 1\n{isolation}', module=None)  # fmt: skip
    identity_model(folder / "model.onnx", {"s": TensorProto.STRING}, ["N", 1])
    write_plugin(plugins, "runner", "slow", "1.0.0",
                 "[runner]\nmax_batch_size = 0\ninstances = 1\nmax_queue_size = 32\n",
                 {"plugin.py": SLOW})  # fmt: skip
    folder = write_plugin(plugins, "runner", "matmul", "1.0.0",
                          '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\nmax_batch_size = 16\n'
                          f'intra_op_threads = 1\n{isolation}', module=None)  # fmt: skip
    matmul_model(folder / "model.onnx")
    for bundled in BUNDLED:
        shutil.copytree(ROOT / "plugins" / bundled, plugins / bundled)
    for model in ("chat", "embed"):
        shutil.copytree(ROOT / "models" / model, models / model)
    hostile_features.write_plugins(plugins, workers)


@dataclass
class Health:
    """The prober's answers: by probe and outcome, and the time each took."""

    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def add(self, probe: str, outcome: str, seconds: float) -> None:
        self.counts[(probe, outcome)] += 1
        self.latencies[probe].append(seconds)

    def refused(self) -> int:
        return sum(n for (_, outcome), n in self.counts.items() if outcome != "ok")


HEALTH_EVERY_S = 0.25
HEALTH_TIMEOUT_S = 2.0


def prober(server: ServerProcess, stop: threading.Event, health: Health) -> None:
    """``/v2/health/live`` on a new connection each time, gRPC ``ServerLive`` and
    ``grpc.health.v1`` ``Check``, every ``HEALTH_EVERY_S``: a probe refused, failed or over
    ``HEALTH_TIMEOUT_S`` is what an orchestrator would count against the server."""
    with grpc.insecure_channel(server.grpc_url) as channel:
        while not stop.wait(HEALTH_EVERY_S):
            started = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HEALTH_TIMEOUT_S)
            try:
                conn.request("GET", "/v2/health/live")
                status = conn.getresponse().status
                outcome = "ok" if status == 200 else str(status)
            except (OSError, http.client.HTTPException) as exc:
                outcome = type(exc).__name__
            finally:
                conn.close()
            health.add("HTTP /v2/health/live", outcome, time.perf_counter() - started)
            for probe, (outcome, seconds) in hostile_grpc.probe(channel).items():
                health.add(probe, outcome, seconds)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


SOAK_CONFIG = "max_connections = 512\n"
"""Below the idle gRPC streams the hostile mix holds (600), so that they reach the call
limit, and above what the HTTP hostile kinds hold (about 230 connections)."""
REQUEST_BYTES_MIB = 8 * 64
"""The request byte budget of each worker (the default: eight times ``max_body_bytes``)."""
RSS_SLACK_MIB = 256
"""What a worker may hold past its request byte budget: parsed JSON bodies (within
``max_json_bytes``), answers being written, the allocator's free lists."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--grpc-clients", type=int, default=2)
    parser.add_argument("--reload-every", type=float, default=3.0)
    parser.add_argument("--hostile", action="store_true", help="add the hostile mix")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--isolated", action="store_true",
                        help='the ONNX runners with isolation = "process"')  # fmt: skip
    parser.add_argument("--half-open", type=int, default=hostile.Mix.half_open,
                        help="hostile connections held with unfinished headers")  # fmt: skip
    parser.add_argument("--idle-streams", type=int, default=hostile_grpc.GrpcMix.idle_streams,
                        help="silent gRPC streams held at any time")  # fmt: skip
    parser.add_argument("--no-h2", dest="h2", action="store_false",
                        help="leave the protocol attacks (hostile_h2.py) out of --hostile")  # fmt: skip
    args = parser.parse_args()
    answers, outcomes, health = Answers(), hostile.Outcomes(), Health()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plugins, models = root / "plugins", root / "models"
        models.mkdir()
        write_plugins(plugins, models, args.isolated, args.workers)
        config = root / "plugserve.toml"
        config.write_text(SOAK_CONFIG)
        server = ServerProcess("--plugins-dir", str(plugins), "--models-dir", str(models),
                               "--config", str(config), "--workers", str(args.workers),
                               "--log-level", "warning", log=root / "server.log")  # fmt: skip
        try:
            server.wait_ready(60)
            hostile_features.start_rollout(server.port)
            samples, churn_log, peak = soak(server, plugins, args, answers, outcomes, health)
            features, features_ok = hostile_features.verdict(server.port)
        finally:
            code = server.stop()
        log_lines = server.log().splitlines()
        if any("[error" in line or "Traceback" in line for line in log_lines):
            kept = Path(tempfile.gettempdir()) / f"plugserve-soak-{os.getpid()}.log"
            shutil.copy(root / "server.log", kept)
            print(f"the server's log, which has errors: {kept}")
    bound = rss_bound(args, samples)
    report(args, answers, outcomes, health, samples, churn_log, code, log_lines, peak, bound)
    print("\n".join(features))
    failed = answers.failed() or health.refused() or peak.rss_mib > bound or not features_ok
    raise SystemExit(1 if failed else 0)


def rss_bound(args: argparse.Namespace, samples: list[tuple[str, Sample]]) -> float:
    """The most the server's processes may hold: the start's RSS and, for each worker, its
    request byte budget, ``RSS_SLACK_MIB`` and a second copy of the sequence runner that
    reloads (its old version serves its running sequences while the new one loads)."""
    return (samples[0][1].rss_mib + args.workers * (REQUEST_BYTES_MIB + RSS_SLACK_MIB)
            + args.workers * hostile_features.COUNTER_BALLAST_MIB)  # fmt: skip


def soak(server: ServerProcess, plugins: Path, args: argparse.Namespace, answers: Answers,
         outcomes: hostile.Outcomes, health: Health) -> tuple[list[tuple[str, Sample]], list[str], Sample]:  # fmt: skip
    """Run the load, the churn, the prober and (with ``--hostile``) the hostile mix;
    sample the server's processes (and, every second, their peak RSS)."""
    pid, began = server.proc.pid, time.monotonic()
    stop, hostile_stop = threading.Event(), threading.Event()
    threads = [threading.Thread(target=client, args=(server.port, stop, i, answers), daemon=True)
               for i in range(args.clients)]  # fmt: skip
    # One client of the slow route, on its own: its queue is what the hang-ups target.
    threads.append(threading.Thread(target=client, daemon=True,
                                    args=(server.port, stop, -1, answers, slow_request, 0.5)))  # fmt: skip
    threads.append(threading.Thread(target=client, daemon=True,
                                    args=(server.port, stop, -2, answers, chat_request, 0.5)))  # fmt: skip
    threads += [threading.Thread(target=hostile_grpc.good_client, daemon=True,
                                 args=(server.grpc_port, stop, 100 + i, answers.add_good))
                for i in range(args.grpc_clients)]  # fmt: skip
    threads.append(threading.Thread(target=prober, args=(server, stop, health), daemon=True))
    for t in threads:
        t.start()
    time.sleep(10)  # warm up before the first reading
    samples = [("start", Sample.take(pid, began))]
    churn_log: list[str] = []
    reloads: list[str] = []
    churner = threading.Thread(target=churn, args=(plugins, stop, args.reload_every, churn_log),
                               daemon=True)  # fmt: skip
    churner.start()
    sequences = threading.Thread(target=hostile_features.churn, daemon=True,
                                 args=(plugins, stop, args.reload_every, reloads))  # fmt: skip
    sequences.start()
    threads += hostile_features.good_clients(server.port, stop, answers.add_good)
    peak = [samples[0][1]]
    sampler = threading.Thread(target=sample_peak, args=(pid, began, stop, peak), daemon=True)
    sampler.start()
    if args.hostile:
        mix = hostile.Mix(half_open=args.half_open)
        threads += hostile.start(server.port, hostile_stop, outcomes, mix)
        grpc_mix = hostile_grpc.GrpcMix(idle_streams=args.idle_streams)
        threads += hostile_grpc.start_hostile(server.grpc_port, hostile_stop, outcomes, grpc_mix)
        threads += hostile_features.start(server.port, hostile_stop, outcomes, mix)
        if args.h2:
            threads += hostile_h2.start(server.grpc_port, server.port, hostile_stop, outcomes,
                                        hostile_h2.H2Mix())  # fmt: skip
    deadline = time.monotonic() + args.minutes * 60
    every = max(5.0, args.minutes * 60 / 8)
    while time.monotonic() < deadline:
        time.sleep(min(every, max(0.0, deadline - time.monotonic())))
        if server.proc.poll() is not None:
            samples.append(("server exited", Sample(time.monotonic() - began, 0, 0, 0)))
            break
        samples.append(("during", Sample.take(pid, began)))
    hostile_stop.set()
    stop.set()
    for t in [*threads, churner, sequences, sampler]:
        t.join(70)
    hung = [t.name for t in [*threads, churner, sequences] if t.is_alive()]
    if hung:
        print(f"threads still running after the stop: {hung}")
    time.sleep(3)  # let the server close what the clients closed
    if server.proc.poll() is None:
        samples.append(("after (3 s)", Sample.take(pid, began)))
    return samples, churn_log + reloads, peak[0]


def sample_peak(pid: int, began: float, stop: threading.Event, peak: list[Sample]) -> None:
    """Keep in ``peak[0]`` the sample of the largest RSS, taken every second until stopped."""
    while not stop.wait(1.0):
        sample = Sample.take(pid, began)
        if sample.rss_mib > peak[0].rss_mib:
            peak[0] = sample


def report(args: argparse.Namespace, answers: Answers, outcomes: hostile.Outcomes,
           health: Health, samples: list[tuple[str, Sample]], churn_log: list[str], code: int,
           log_lines: list[str], peak: Sample, bound: float) -> None:  # fmt: skip
    good = answers.good()
    served = sum(answers.counts.values())
    mode = "WITH the hostile mix" if args.hostile else "good traffic only (no --hostile)"
    where = f"--workers {args.workers}" + (", isolated runners" if args.isolated else "")
    print(f"soak: {args.minutes:g} min, {where}, {args.clients} HTTP and {args.grpc_clients} gRPC "
          f"clients, {mode}, a reload every {args.reload_every:g} s ({len(churn_log)} rounds: "
          "a version added, one edited, one deleted)")  # fmt: skip
    print(f"requests answered: {served} ({served / (args.minutes * 60 + 10):.0f}/s)")
    bad = sum(n for status, n in good.items() if status != 200)
    verdict = "all 200" if not bad else f"{bad} NOT 200"
    print(f"good requests: {sum(good.values())}, by status {dict(sorted(good.items()))}: {verdict}")
    own = (SLOW_KIND, CHAT_KIND)
    every = [s for kind, values in answers.latencies.items() if kind not in own for s in values]
    print(f"good-request latency (all but {' and '.join(own)}): p50 "
          f"{percentile(every, 0.5) * 1000:.2f} ms, p99 {percentile(every, 0.99) * 1000:.2f} ms, "
          f"max {max(every, default=0) * 1000:.0f} ms")  # fmt: skip
    for kind, values in sorted(answers.latencies.items()):
        statuses = {s: n for (k, s, _), n in answers.counts.items() if k == kind}
        print(f"  {kind:<16} n={len(values):<7} p50 {percentile(values, 0.5) * 1000:8.2f} ms  "
              f"p99 {percentile(values, 0.99) * 1000:8.2f} ms  statuses {dict(sorted(statuses.items()))}")  # fmt: skip
    print("  (gRPC statuses: 200 is OK, 1000 + n is gRPC status code n)")
    print(
        f"health probes (every {HEALTH_EVERY_S:g} s, {HEALTH_TIMEOUT_S:g} s timeout): "
        f"{'never refused' if not health.refused() else f'{health.refused()} REFUSED'}"
    )
    for probe, values in sorted(health.latencies.items()):
        table = {o: n for (p, o), n in health.counts.items() if p == probe}
        print(f"  {probe:<22} {table}  p99 {percentile(values, 0.99) * 1000:.1f} ms, "
              f"max {max(values, default=0) * 1000:.0f} ms")  # fmt: skip
    print("expected-failure bucket (deliberately faulty requests):")
    for kind, answered in answers.faulty().items():
        print(f"  {kind:<14} {answered}")
    if args.hostile:
        print(
            "hostile attempts by outcome (status and time to answer, or what the connection got):"
        )
        suspect: Counter[str] = Counter()
        for kind, table in outcomes.by_kind().items():
            print(f"  {kind}: " + ", ".join(f"{o}: {n}" for o, n in table.items()))
            for outcome, n in table.items():
                if outcome.startswith(("5", "timeout", "reset", "still held past", "client error")):
                    suspect[outcome.split(" ")[0]] += n
        print(f"hostile attempts a hardened server should not give (5xx, timeout, reset, "
              f"held to the end, an attack's own error): {dict(suspect) or 'none'}")  # fmt: skip
    print("server processes (RSS MiB / open fds / threads, summed):")
    for label, sample in samples:
        print(f"  {sample.at_s:7.1f} s  {label:<14} {sample.rss_mib:8.1f}  {sample.fds:6d}  "
              f"{sample.threads:4d}")  # fmt: skip
    within = "within it" if peak.rss_mib <= bound else "OVER IT"
    print(f"peak RSS (sampled every 1 s) {peak.rss_mib:.1f} MiB at {peak.at_s:.0f} s; bound "
          f"{bound:.0f} MiB (the start's RSS + {args.workers} x ({REQUEST_BYTES_MIB} MiB request "
          f"byte budget + {RSS_SLACK_MIB} MiB + {hostile_features.COUNTER_BALLAST_MIB} MiB, a "
          f"reloading version's second copy)): {within}")  # fmt: skip
    levels = Counter(word for line in log_lines for word in ("[error", "[critical", "Traceback")
                     if word in line)  # fmt: skip
    print(f"server exit code {code}; log: {len(log_lines)} lines, {dict(levels) or 'no errors'}")
    if hostile_grpc.REFUSED:
        print(f"good gRPC calls that failed, by what they were told: {dict(hostile_grpc.REFUSED)}")
    print(f"good requests failed: {bad}; faulty requests answered unexpectedly: "
          f"{answers.failed() - bad}; health probes refused: {health.refused()}")  # fmt: skip


if __name__ == "__main__":
    main()
