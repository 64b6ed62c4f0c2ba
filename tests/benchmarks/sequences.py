"""Sequences batching: 16 concurrent streams through a stateful model, its state batched on
axis 1 and its sample rate shared (``[runner.batching]``), the state kept by the server.

    python -m tests.benchmarks.sequences [--streams 16] [--steps 200] [--rounds 3]

Starts ``plugserve serve`` on the VAD-shaped model of the tests (``tests/helpers.py``
``vad_model``: a chunk [N, 4], a state [2, N, 3], a scalar rate) three ways: in the
worker (``--workers 1``), and ``isolation = "process"`` with ``--workers 2``; each
round, ``--streams`` clients (one keep-alive connection each) send their sequence of
``--steps`` chunks as v2 JSON, each chunk once the previous one is answered, as a
streaming client does. Prints per round the requests per second, the p50 and p99
latency, and the runner's mean batch (rows per execution, from ``/admin/plugins``),
then the medians. Not run by CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.helpers import ServerProcess, write_vad_runner

SETUPS = {
    "in-worker w1": ("", ()),
    "isolated w2": ('isolation = "process"\ninstances = 1', ("--workers", "2")),
}


async def stream(session: aiohttp.ClientSession, url: str, sid: int, steps: int) -> list[float]:
    latencies = []
    for step in range(steps):
        body = {
            "inputs": [
                {"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [0.1 * sid] * 4},
                {"name": "sr", "datatype": "INT64", "shape": [], "data": [16000]},
            ],
            "parameters": {"sequence_id": sid, "sequence_start": step == 0,
                           "sequence_end": step == steps - 1},
        }  # fmt: skip
        started = time.perf_counter()
        async with session.post(url, json=body) as response:
            await response.read()
            assert response.status == 200, await response.text()
        latencies.append(time.perf_counter() - started)
    return latencies


async def one_round(port: int, streams: int, steps: int, base: int) -> tuple[float, list[float]]:
    url = f"http://127.0.0.1:{port}/v2/models/vad/infer"
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(stream(session, url, base + i, steps) for i in range(streams))
        )
        took = time.perf_counter() - started
    return streams * steps / took, [x for r in results for x in r]


def batch_figures(srv: ServerProcess) -> tuple[int, int]:
    status, _, body = srv.request("GET", "/admin/plugins")
    assert status == 200, body
    (record,) = [p for p in json.loads(body)["plugins"] if p["name"] == "vad"]
    figures: dict[str, Any] = record.get("figures") or record
    return figures["executions"], figures["batched_rows"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for name, (runner, flags) in SETUPS.items():
        with tempfile.TemporaryDirectory() as tmp:
            plugins, models = Path(tmp) / "plugins", Path(tmp) / "models"
            models.mkdir()
            write_vad_runner(plugins, runner=runner)
            srv = ServerProcess(
                *flags, "--plugins-dir", str(plugins), "--models-dir", str(models),
                log=Path(tmp) / "server.log",
            ).wait_ready(60)  # fmt: skip
            try:
                rates, p50s, p99s, means = [], [], [], []
                for round_ in range(args.rounds):
                    before = batch_figures(srv)
                    rate, latencies = asyncio.run(
                        one_round(srv.port, args.streams, args.steps, 1000 * (round_ + 1))
                    )
                    after = batch_figures(srv)
                    runs, rows = after[0] - before[0], after[1] - before[1]
                    latencies.sort()
                    p50 = latencies[len(latencies) // 2] * 1e3
                    p99 = latencies[int(len(latencies) * 0.99)] * 1e3
                    rates.append(rate)
                    p50s.append(p50)
                    p99s.append(p99)
                    means.append(rows / runs)
                    print(f"{name} round {round_ + 1}: {rate:.0f} req/s, p50 {p50:.2f} ms, "
                          f"p99 {p99:.2f} ms, mean batch {rows / runs:.2f} ({rows} rows, "
                          f"{runs} runs)")  # fmt: skip
                print(f"{name} median: {statistics.median(rates):.0f} req/s, p50 "
                      f"{statistics.median(p50s):.2f} ms, p99 {statistics.median(p99s):.2f} ms, "
                      f"mean batch {statistics.median(means):.2f}")  # fmt: skip
            finally:
                srv.stop()


if __name__ == "__main__":
    main()
