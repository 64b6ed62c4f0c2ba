"""Soak: minutes of mixed load while plugins reload every few seconds, plus faulty requests.

    python -m tests.benchmarks.soak [--minutes 3] [--clients 4] [--reload-every 3]

Starts ``plugserve serve`` on a temporary plugins folder (an ONNX runner behind a
preprocessor, and a Python runner), drives it from several client threads over
keep-alive connections (v2 JSON, v2 binary, /predict), sends a few faulty requests
on purpose (malformed JSON, unknown routes, wrong shapes), and meanwhile adds,
edits and deletes plugin versions every few seconds. Prints requests served,
answers by status (expected and unexpected), and the server's memory at start
and end. Target: zero unexpected answers, flat memory. Not run by CI.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from tests.helpers import ServerProcess, add_model, rss_mib, write_plugin, write_processor

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


def requests_for(rng: random.Random) -> tuple[str, str, bytes, dict[str, str], set[int]]:
    """One request: method, path, body, headers, the statuses that count as expected."""
    x = [rng.random() for _ in range(4)]
    roll = rng.random()
    if roll < 0.02:
        return "POST", "/v2/models/add/infer", b"{oops", {}, {400}
    if roll < 0.04:
        return "POST", "/v2/models/nope/infer", json.dumps({"inputs": []}).encode(), {}, {400, 404}
    if roll < 0.06:
        bad = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": x[:3]}]}
        return "POST", "/v2/models/add/infer", json.dumps(bad).encode(), {}, {400}
    if roll < 0.45:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": x}]}
        return "POST", "/v2/models/add/infer", json.dumps(body).encode(), {}, {200}
    if roll < 0.7:
        raw = np.array([x], np.float32).tobytes()
        header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                         "parameters": {"binary_data_size": len(raw)}}]}).encode()  # fmt: skip
        headers = {"Inference-Header-Content-Length": str(len(header))}
        return "POST", "/v2/models/add/infer", header + raw, headers, {200}
    body = json.dumps({"x": [x]}).encode()
    return "POST", "/predict/echo", body, {"Content-Type": "application/json"}, {200}


def client(port: int, stop: threading.Event, seed: int, answers: Counter[tuple[int, bool]],
           latencies: list[float]) -> None:  # fmt: skip
    rng = random.Random(seed)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    while not stop.is_set():
        method, path, body, headers, expected = requests_for(rng)
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
        latencies.append(time.perf_counter() - started)
        answers[(status, status in expected)] += 1


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--reload-every", type=float, default=3.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plugins, models = root / "plugins", root / "models"
        models.mkdir()
        write_processor(plugins, "preprocessor", "scale", "1.0.0", 0)
        folder = write_plugin(plugins, "runner", "add", "1.0.0",
                              '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\nmax_batch_size = 16\n'
                              'intra_op_threads = 1\n[route]\npreprocess = ["scale"]\n', module=None)  # fmt: skip
        add_model(folder / "model.onnx")
        write_plugin(plugins, "runner", "echo", "1.0.0", '[config]\ntag = "v1"\n[runner]\nmax_batch_size = 8\n',
                     {"plugin.py": ECHO})  # fmt: skip
        server = ServerProcess("--plugins-dir", str(plugins), "--models-dir", str(models),
                               "--log-level", "warning", log=root / "server.log")  # fmt: skip
        server.wait_ready()
        stop = threading.Event()
        answers: Counter[tuple[int, bool]] = Counter()
        latencies: list[float] = []
        threads = [threading.Thread(target=client, args=(server.port, stop, i, answers, latencies))
                   for i in range(args.clients)]  # fmt: skip
        for t in threads:
            t.start()
        time.sleep(10)  # warm up before the first memory reading
        start_rss = rss_mib(server.proc.pid)
        churn_log: list[str] = []
        churner = threading.Thread(target=churn, args=(plugins, stop, args.reload_every, churn_log))
        churner.start()
        samples = [start_rss]
        deadline = time.monotonic() + args.minutes * 60
        while time.monotonic() < deadline:
            time.sleep(min(30, max(0.0, deadline - time.monotonic())))
            samples.append(rss_mib(server.proc.pid))
        stop.set()
        for t in [*threads, churner]:
            t.join(30)
        end_rss = rss_mib(server.proc.pid)
        server.stop()
    served = sum(answers.values())
    unexpected = {status: n for (status, ok), n in answers.items() if not ok}
    expected = {status: n for (status, ok), n in answers.items() if ok}
    print(f"soak: {args.minutes:g} min, {args.clients} clients, a reload every {args.reload_every:g} s "
          f"({len(churn_log)} rounds: a version added, one edited, one deleted)")  # fmt: skip
    print(f"requests answered: {served}  ({served / (args.minutes * 60 + 10):.0f}/s), "
          f"p50 {statistics.median(latencies) * 1000:.2f} ms")  # fmt: skip
    print(f"expected answers by status: {dict(sorted(expected.items()))}")
    print(f"unexpected answers by status: {dict(sorted(unexpected.items())) or 'none'}")
    print(f"server RSS: start {start_rss:.1f} MiB, end {end_rss:.1f} MiB, samples "
          + ", ".join(f"{s:.1f}" for s in samples))  # fmt: skip
    raise SystemExit(1 if unexpected else 0)


if __name__ == "__main__":
    main()
