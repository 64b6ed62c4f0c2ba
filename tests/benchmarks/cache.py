"""Response cache: a hit's latency against a miss at c=1, on the medium MLP.

    python -m tests.benchmarks.cache [--requests 2000] [--rounds 3]

Starts ``plugserve serve`` on the benchmark's MLP (tests/benchmarks/serving.py)
served twice: route ``mlp`` with ``response_cache = true`` and route ``plain``
without. One keep-alive connection sends binary v2 requests of one row, one at
a time, round after round:

- ``hit``: the same row every time (after one request that fills the cache);
- ``miss``: a new random row every time, on the cached route (the run, plus
  hashing, comparing nothing, and copying into the cache);
- ``uncached``: new rows on the route without the cache (the run alone).

Prints the median and p90 of each over all rounds (the medians of the rounds
beside), and hit/miss as a ratio. Not run by CI.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from tests.benchmarks.serving import DIMS, RUNNER_OPTIONS, write_mlp_runner
from tests.helpers import ServerProcess


def body(row: np.ndarray) -> tuple[bytes, dict[str, str]]:
    header = json.dumps(
        {
            "inputs": [{"name": "x", "shape": [1, DIMS[0]], "datatype": "FP32",
                        "parameters": {"binary_data_size": row.nbytes}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()  # fmt: skip
    headers = {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }
    return header + row.tobytes(), headers


def timed(conn: http.client.HTTPConnection, route: str, rows: list[np.ndarray]) -> list[float]:
    """Seconds per request, sent one at a time."""
    times = []
    for row in rows:
        payload, headers = body(row)
        started = time.perf_counter()
        conn.request("POST", f"/v2/models/{route}/infer", payload, headers)
        response = conn.getresponse()
        response.read()
        times.append(time.perf_counter() - started)
        if response.status != 200:
            raise RuntimeError(f"{route}: HTTP {response.status}")
    return times


def plugins(work: Path) -> Path:
    folder = write_mlp_runner(work, RUNNER_OPTIONS + "\nresponse_cache = true")
    plain = folder / "runner" / "plain" / "1.0.0"
    shutil.copytree(folder / "runner" / "mlp" / "1.0.0", plain)
    manifest = plain / "plugin.toml"
    text = manifest.read_text().replace('name = "mlp"', 'name = "plain"')
    manifest.write_text(text.replace("response_cache = true", ""))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = plugins(work)
        srv = ServerProcess(
            "--plugins-dir", str(folder), "--models-dir", str(work / "models"),
            "--log-level", "warning", log=work / "server.log",
        ).wait_ready(120)  # fmt: skip
        try:
            conn = http.client.HTTPConnection("127.0.0.1", srv.port)
            same = rng.standard_normal((1, DIMS[0])).astype(np.float32)
            timed(conn, "mlp", [same] * 50)  # warm up, and fill the cache with `same`
            samples: dict[str, list[list[float]]] = {"hit": [], "miss": [], "uncached": []}
            for _ in range(args.rounds):
                fresh = [rng.standard_normal((1, DIMS[0])).astype(np.float32) for _ in range(args.requests)]  # fmt: skip
                samples["hit"].append(timed(conn, "mlp", [same] * args.requests))
                samples["miss"].append(timed(conn, "mlp", fresh))
                samples["uncached"].append(timed(conn, "plain", fresh))
            _, _, stats = srv.request("GET", "/v2/models/mlp/stats")
            cached = json.loads(stats)["model_stats"][0]["inference_stats"]
        finally:
            srv.stop()
    print(f"c=1, binary v2, one row of {DIMS[0]} FP32; {args.rounds} rounds of {args.requests}")
    print(f"{'case':<10}{'p50 us':>10}{'p90 us':>10}   p50 per round (us)")
    p50 = {}
    for case, rounds in samples.items():
        every = sorted(t for r in rounds for t in r)
        p50[case] = statistics.median(every) * 1e6
        p90 = every[int(len(every) * 0.9)] * 1e6
        per_round = " ".join(f"{statistics.median(r) * 1e6:.0f}" for r in rounds)
        print(f"{case:<10}{p50[case]:>10.0f}{p90:>10.0f}   {per_round}")
    print(f"hit / miss p50: {p50['hit'] / p50['miss']:.2f}; "
          f"miss / uncached p50: {p50['miss'] / p50['uncached']:.2f}")  # fmt: skip
    hit, miss = cached["cache_hit"], cached["cache_miss"]
    print(f"server side: cache_hit {hit['count']} at {hit['ns'] / max(hit['count'], 1) / 1e3:.1f} us "
          f"each, cache_miss {miss['count']} at {miss['ns'] / max(miss['count'], 1) / 1e3:.1f} us each")  # fmt: skip


if __name__ == "__main__":
    main()
