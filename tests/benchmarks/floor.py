"""The request path's floor: what an answer costs before plugserve's own work, and after.

    python -m tests.benchmarks.floor [--rounds 5] [--duration 4] [--connections 64]
                                     [--model mlp|identity] [--baseline OTHER_CHECKOUT]

One plugserve (``--workers 1``, the serving benchmark's MLP, tests/benchmarks/serving.py,
or with ``--model identity`` a model that returns its input: the server's cost alone)
and one bare aiohttp server on uvloop, both up for the whole run, take turns under
``wrk`` round after round:

- bare GET: aiohttp answers a fixed body, the floor of any aiohttp server here;
- bare POST, bare POST JSON: the same, reading the binary (or the JSON) request's body
  first: the floor the infer route's CPU is held against, body for body;
- plugserve GET ``/v2/health/live``: plugserve's middleware, request ids and
  connection bookkeeping around a handler that does nothing;
- plugserve infer, binary and JSON: the whole route (body, decode, chain,
  batching, the model on its thread, encode, metrics).

Prints the medians of req/s and the server's CPU per request (its process tree,
from /proc), and the steps between them: what the server adds to aiohttp, and
what the infer route adds to the server, each the median of the differences
within a round (the machine drifts between rounds). With ``--baseline`` (another
checkout, a git worktree of an earlier commit, say), a second plugserve from there
takes its turns beside this one, and the steps include this checkout against it. A case with failed requests
makes it exit non-zero. Not run by CI.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from tests.benchmarks.serving import (
    BARE,
    MODELS,
    Server,
    binary_body,
    cpu_tree,
    json_body,
    lua_script,
    write_mlp_runner,
    wrk,
)
from tests.helpers import free_port

BARE_UVLOOP = "import uvloop\nuvloop.install()\n" + BARE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=int, default=4, help="seconds per measurement")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plugserve-floor-"))
    plugins = write_mlp_runner(work, model=args.model)
    empty = work / "empty.lua"
    empty.write_text("")
    body, length = binary_body()
    binary = lua_script(work, body, {"Content-Type": "application/octet-stream",
                                     "Inference-Header-Content-Length": str(length)})  # fmt: skip
    as_json = lua_script(work, json_body(), {"Content-Type": "application/json"})

    port, bare_port = free_port(), free_port()
    command = [sys.executable, "-m", "plugserve", "serve", "--plugins-dir", str(plugins),
               "--models-dir", str(work / "models"), "--port", str(port),
               "--grpc-port", str(free_port()), "--log-level", "warning",
               "--workers", "1"]  # fmt: skip
    servers = [
        Server([sys.executable, "-c", BARE_UVLOOP, str(bare_port)], bare_port, work / "bare.log"),
        Server(command, port, work / "plugserve.log"),
    ]
    bare, plugserve = servers
    baseline = None
    if args.baseline is not None:
        other = free_port()
        baseline_command = [*command[:command.index("--port") + 1], str(other),
                            "--grpc-port", str(free_port()), "--log-level", "warning",
                            "--workers", "1"]  # fmt: skip
        baseline = Server(baseline_command, other, work / "baseline.log",
                          checkout=args.baseline.resolve())  # fmt: skip
        servers.append(baseline)
    base, infer = f"http://127.0.0.1:{bare_port}", f"http://127.0.0.1:{port}/v2/models/mlp/infer"
    cases = [
        ("bare GET", bare, f"{base}/health", empty),
        ("bare POST", bare, f"{base}/infer", binary),
        ("bare POST JSON", bare, f"{base}/infer", as_json),
        ("plugserve GET live", plugserve, f"http://127.0.0.1:{port}/v2/health/live", empty),
        ("plugserve infer binary", plugserve, infer, binary),
        ("plugserve infer JSON", plugserve, infer, as_json),
    ]
    if baseline is not None:
        other_infer = f"http://127.0.0.1:{baseline.port}/v2/models/mlp/infer"
        cases += [
            ("baseline GET live", baseline, f"http://127.0.0.1:{baseline.port}/v2/health/live",
             empty),
            ("baseline infer binary", baseline, other_infer, binary),
            ("baseline infer JSON", baseline, other_infer, as_json),
        ]  # fmt: skip
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in cases}
    errors: dict[str, int] = dict.fromkeys(samples, 0)
    try:
        bare.wait("/health", 30)
        plugserve.wait("/v2/health/ready", 120)
        if baseline is not None:
            baseline.wait("/v2/health/ready", 120)
        for _, _, url, script in cases:
            wrk(url, script, args.connections, 1)  # warm up
        for round_no in range(1, args.rounds + 1):
            for name, server, url, script in cases:
                before = sum(c for _, c in cpu_tree(server.proc.pid).values())
                result = wrk(url, script, args.connections, args.duration)
                used = sum(c for _, c in cpu_tree(server.proc.pid).values()) - before
                cpu_us = used / max(1, result.requests) * 1e6
                samples[name].append((result.rps, cpu_us))
                errors[name] += result.errors
                print(f"  round {round_no} {name:24} {result.rps:8.0f} req/s  CPU {cpu_us:6.1f} "
                      f"us/req  errors {result.errors}", flush=True)  # fmt: skip
    finally:
        for server in servers:
            server.stop()

    print(f"\nMedians over {args.rounds} rounds, c={args.connections}:\n")
    print("| case | req/s | CPU us/req | errors |\n| --- | --- | --- | --- |")
    for name, runs in samples.items():
        rps, cpu = statistics.median(r for r, _ in runs), statistics.median(c for _, c in runs)
        print(f"| {name} | {rps:.0f} | {cpu:.1f} | {errors[name]} |")
    print("\nSteps, CPU per request (the median of the per-round differences; each round's):")
    steps = [
        ("a body read by aiohttp", "bare POST", "bare GET"),
        ("plugserve's server around a handler", "plugserve GET live", "bare GET"),
        ("the infer route, binary", "plugserve infer binary", "plugserve GET live"),
        ("JSON over binary", "plugserve infer JSON", "plugserve infer binary"),
    ]
    if baseline is not None:
        steps += [
            ("this checkout over the baseline, live", "plugserve GET live", "baseline GET live"),
            ("this checkout over the baseline, binary", "plugserve infer binary",
             "baseline infer binary"),
            ("this checkout over the baseline, JSON", "plugserve infer JSON",
             "baseline infer JSON"),
        ]  # fmt: skip
    for label, top, bottom in steps:
        each = [a[1] - b[1] for a, b in zip(samples[top], samples[bottom], strict=True)]
        shown = ", ".join(f"{d:+.0f}" for d in each)
        print(f"  {label}: {statistics.median(each):+.1f} us ({top} - {bottom}; {shown})")
    print("\nServer CPU per request over the bare aiohttp POST of the same body (per round):")
    for label, case, bare_case, target in (
        ("binary", "plugserve infer binary", "bare POST", 2.0),
        ("JSON", "plugserve infer JSON", "bare POST JSON", 2.5),
    ):
        each = [a[1] / b[1] for a, b in zip(samples[case], samples[bare_case], strict=True)]
        x = statistics.median(each)
        shown = ", ".join(f"{r:.2f}" for r in each)
        verdict = "PASS" if x <= target else "MISS"
        note = "" if args.model == "identity" else " (the targets are stated with --model identity)"
        print(f"  {label}: {x:.2f}x ({shown}; target <= {target}){note}  {verdict}")
    if any(errors.values()):
        raise SystemExit(f"errors: {errors}: a case that failed requests has no figure")


if __name__ == "__main__":
    main()
