"""Generation and embeddings through the OpenAI routes, on the bundled examples.

    python -m tests.benchmarks.generation [--streams 1 16 64] [--tokens 64]
        [--duration 8] [--rounds 2] [--embed-duration 6]

Starts two ``plugserve serve`` on copies of the repository's ``plugins/`` and
``models/``: one as shipped (the chat runner batches the steps of up to 32
streams in one model call: continuous batching) and one with the chat
runner's ``max_batch_size = 1`` (every stream stepped alone, in turn). For each
concurrency, in each round, on each server in turn, a client process keeps
that many ``/v1/chat/completions`` streams open (``stream: true``,
``max_tokens``, ``ignore_eos`` so that every stream is as long, temperature
0.8) for ``--duration`` seconds, and measures per stream the time to first
token (from sending the request to the first text), the gaps between tokens
(inter-token latency), and completion tokens (``usage``). Prints per server
and concurrency: TTFT p50/p99, ITL p50/p99, tokens/s over all streams (medians
over rounds), and the client's CPU share (it must stay well under a core for
the figures to be the server's).

Then the OpenAI layer's cost: requests/s at c=64 (wrk) of one sentence through
``/v1/embeddings`` against the same sentence through ``/v2/models/embed/infer``
(a BYTES tensor ``text``), on the same chain. Not run by CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.benchmarks.serving import lua_script, wrk
from tests.helpers import ROOT, ServerProcess

PROMPT = "How do I keep a model server fast when many people call it at once?"
SENTENCE = "The server batches requests from many clients into one model call."


# -- the client (a process of its own) ----------------------------------------------------


async def _stream(session: Any, url: str, tokens: int, out: dict[str, list[float]]) -> None:
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0.8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    last = None
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            out["errors"].append(1.0)
            await response.read()
            return
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out["tokens"].append(float(chunk["usage"]["completion_tokens"]))
            if not chunk["choices"] or not chunk["choices"][0]["delta"].get("content"):
                continue
            now = time.perf_counter()
            if last is None:
                out["ttft"].append(now - sent)
            else:
                out["itl"].append(now - last)
            last = now


async def _client(url: str, streams: int, seconds: float, tokens: int) -> dict[str, Any]:
    import aiohttp

    out: dict[str, list[float]] = {"ttft": [], "itl": [], "tokens": [], "errors": []}
    stop_at = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def keep_open() -> None:
            while time.perf_counter() < stop_at:
                await _stream(session, url, tokens, out)

        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(keep_open() for _ in range(streams)))
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu
    return {**out, "wall": wall, "client_cpu": cpu / wall}


def client_main(argv: list[str]) -> None:
    url, streams, seconds, tokens = argv[0], int(argv[1]), float(argv[2]), int(argv[3])
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(_client(url, streams, seconds, tokens))
    Path(argv[4]).write_text(json.dumps(result))  # a file: stdout is not blocking-safe here


def measure(url: str, streams: int, seconds: float, tokens: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "-m", "tests.benchmarks.generation", "--client", url,
                   str(streams), str(seconds), str(tokens), out.name]  # fmt: skip
        subprocess.run(command, cwd=ROOT, check=True)
        return json.loads(Path(out.name).read_text())  # type: ignore[no-any-return]


# -- the servers -------------------------------------------------------------------------------


def copy_examples(work: Path, batch: int | None) -> tuple[Path, Path]:
    plugins, models = work / "plugins", work / "models"
    shutil.copytree(ROOT / "plugins", plugins)
    shutil.copytree(ROOT / "models", models)
    if batch is not None:
        for manifest in (plugins / "runner" / "chat").glob("*/plugin.toml"):
            text = manifest.read_text()
            lines = [
                f"max_batch_size = {batch}" if line.startswith("max_batch_size") else line
                for line in text.splitlines()
            ]
            manifest.write_text("\n".join(lines) + "\n")
    return plugins, models


def start(work: Path, batch: int | None) -> ServerProcess:
    work.mkdir()
    plugins, models = copy_examples(work, batch)
    proc = ServerProcess(
        "--plugins-dir", str(plugins), "--models-dir", str(models), log=work / "server.log"
    )
    return proc.wait_ready(60)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def embeddings(proc: ServerProcess, work: Path, seconds: int) -> dict[str, float]:
    v1 = json.dumps({"model": "embed", "input": SENTENCE}).encode()
    v2 = json.dumps(
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [SENTENCE]}]}
    ).encode()
    json_headers = {"Content-Type": "application/json"}
    for path, body in (("/v1/embeddings", v1), ("/v2/models/embed/infer", v2)):
        status, _, answer = proc.request("POST", path, body, json_headers)
        if status != 200:
            raise RuntimeError(f"{path}: {status} {answer[:300]!r}")
    figures: dict[str, list[float]] = {"v1": [], "v2": []}
    for _ in range(2):
        for name, path, body in (
            ("v1", "/v1/embeddings", v1),
            ("v2", "/v2/models/embed/infer", v2),
        ):
            script = lua_script(work, body, json_headers)
            wrk(proc.url + path, script, 64, 1)  # warm up
            result = wrk(proc.url + path, script, 64, seconds)
            if result.errors:
                raise RuntimeError(f"{path}: {result.errors} errors")
            figures[name].append(result.rps)
    return {name: statistics.median(values) for name, values in figures.items()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--duration", type=float, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--embed-duration", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        servers = {"batched": start(work / "batched", None), "unbatched": start(work / "one", 1)}
        try:
            rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
            for _ in range(args.rounds):
                for streams in args.streams:
                    for name, proc in servers.items():
                        measure(proc.url, streams, 1, args.tokens)  # warm up
                        rows.setdefault((name, streams), []).append(
                            measure(proc.url, streams, args.duration, args.tokens)
                        )
            print(f"chat example, {args.tokens} tokens a stream, {args.rounds} rounds of "
                  f"{args.duration:g} s (medians over rounds)")  # fmt: skip
            print(f"{'server':<10} {'streams':>7} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} "
                  f"{'p99':>8} {'tokens/s':>9} {'client CPU':>10} {'errors':>6}")  # fmt: skip
            for (name, streams), runs in rows.items():

                def med(key: str, q: float, runs: list[dict[str, Any]] = runs) -> float:
                    return statistics.median(pct(r[key], q) * 1000 for r in runs)

                rate = statistics.median(sum(r["tokens"]) / r["wall"] for r in runs)
                cpu = statistics.median(r["client_cpu"] for r in runs)
                errors = sum(len(r["errors"]) for r in runs)
                print(f"{name:<10} {streams:>7} {med('ttft', .5):>7.1f}ms {med('ttft', .99):>6.1f}ms "
                      f"{med('itl', .5):>6.2f}ms {med('itl', .99):>6.2f}ms {rate:>9.0f} "
                      f"{cpu:>9.0%} {errors:>6}")  # fmt: skip
            figures = embeddings(servers["batched"], work, args.embed_duration)
            print(f"embeddings c=64: /v1/embeddings {figures['v1']:.0f} req/s, "
                  f"/v2 infer {figures['v2']:.0f} req/s, ratio {figures['v1'] / figures['v2']:.2f}")  # fmt: skip
        finally:
            for proc in servers.values():
                proc.stop()


if __name__ == "__main__":
    main()
