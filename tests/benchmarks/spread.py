"""Load spread over N worker processes on one port: one inherited socket against SO_REUSEPORT.

    python -m tests.benchmarks.spread [--workers 2] [--connections 8 64] [--duration 5]
                                      [--loop uvloop] [--modes inherit reuseport]

To choose how plugserve's workers share the data port. N worker processes serve
the same tiny aiohttp app (read the body, answer ``ok``) on one port, in each of
two modes:

- ``inherit``: the parent creates one listening socket and every worker gets it
  (``subprocess.Popen(pass_fds=...)``); the workers race to accept(2) on it.
- ``reuseport``: every worker binds a socket of its own with SO_REUSEPORT; the
  kernel hashes each new connection to one of the listening sockets.

Both go through the same ``loop.create_server(sock=..., backlog=1024)`` as
plugserve (server/http/connections.py), on uvloop (plugserve's default where it is
installed) or asyncio's loop. For each mode and each ``--connections`` c, the
workers are started afresh (all listening before the load starts) and
``wrk -t1 -c<c> -d<duration>s`` drives them. Each worker counts its requests
and its connections (distinct client addresses) and prints them as a JSON line
when SIGTERM stops it. The table gives requests/s, per-worker requests and
connections, and the busiest worker's share of the requests (1/N is even).
wrk opens its connections at the start and keeps them, so the connection
spread decides the request spread. Not run by CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]
BACKLOG = 1024  # as plugserve's listener


# -- a worker ------------------------------------------------------------------------------


async def serve(sock: socket.socket) -> None:
    """Serve on sock until SIGTERM, then print this worker's counts as one JSON line."""
    counts = {"requests": 0}
    peers: set[Any] = set()

    async def handle(request: web.Request) -> web.Response:
        counts["requests"] += 1
        if request.transport is not None:
            peers.add(request.transport.get_extra_info("peername"))
        await request.read()
        return web.Response(body=b"ok")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    assert runner.server is not None  # made by setup()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(runner.server, sock=sock, backlog=BACKLOG)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    server.close()
    print(json.dumps({"pid": os.getpid(), **counts, "connections": len(peers)}), flush=True)
    await runner.cleanup()


def worker(fd: int | None, port: int | None, loop_name: str) -> None:
    """A worker process: the inherited socket ``fd``, or a SO_REUSEPORT socket of its own."""
    if fd is not None:
        sock = socket.socket(fileno=fd)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port or 0))
    if loop_name == "uvloop":
        import uvloop

        uvloop.run(serve(sock))
    else:
        asyncio.run(serve(sock))


# -- the parent ----------------------------------------------------------------------------


@dataclass
class Run:
    mode: str
    connections: int
    rps: float
    errors: int
    workers: list[dict[str, int]]  # pid, requests, connections

    def busiest(self) -> float:
        total = sum(w["requests"] for w in self.workers) or 1
        return max(w["requests"] for w in self.workers) / total


def start_workers(mode: str, count: int, loop_name: str) -> tuple[list[subprocess.Popen[str]], int]:
    """N workers on one port, each listening before this returns; the port."""
    # inherit: the one listening socket; reuseport: only reserves the port (bound, never
    # listening, so the kernel hands it no connection) until the workers have bound it.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if mode == "reuseport":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    command = [sys.executable, "-m", "tests.benchmarks.spread", "--loop", loop_name]
    if mode == "inherit":
        sock.listen(BACKLOG)
        command += ["--worker-fd", str(sock.fileno())]
        fds: tuple[int, ...] = (sock.fileno(),)
    else:
        command += ["--worker-port", str(port)]
        fds = ()
    procs = [
        subprocess.Popen(command, cwd=ROOT, pass_fds=fds, stdout=subprocess.PIPE, text=True)
        for _ in range(count)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"worker {proc.pid} did not start")
    finally:
        sock.close()  # the workers hold their own copies
    return procs, port


def stop_workers(procs: list[subprocess.Popen[str]]) -> list[dict[str, int]]:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    counts = []
    for proc in procs:
        out, _ = proc.communicate(timeout=30)
        counts.append(json.loads(out.strip().splitlines()[-1]))
    return counts


def wrk(port: int, connections: int, duration: int) -> tuple[float, int]:
    """(requests/s, errors) of one wrk run."""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", f"http://127.0.0.1:{port}/"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Socket errors: (.*)", out)
    return rps, sum(int(n) for n in re.findall(r"\d+", errors.group(1))) if errors else 0


def measure(mode: str, workers: int, connections: int, duration: int, loop_name: str) -> Run:
    procs, port = start_workers(mode, workers, loop_name)
    try:
        rps, errors = wrk(port, connections, duration)
    finally:
        counts = stop_workers(procs)
    return Run(mode, connections, rps, errors, counts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--connections", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    parser.add_argument("--modes", nargs="+", default=["inherit", "reuseport"])
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--worker-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_fd is not None or args.worker_port is not None:
        worker(args.worker_fd, args.worker_port, args.loop)
        return
    runs = []
    for c in args.connections:
        for mode in args.modes:
            run = measure(mode, args.workers, c, args.duration, args.loop)
            runs.append(run)
            print(f"  {mode:9} c={c:<3} {run.rps:8.0f} req/s  busiest worker {run.busiest():.0%}",
                  flush=True)  # fmt: skip
            time.sleep(0.5)
    print(f"\n{args.workers} workers, {args.loop}, wrk -t1 -d{args.duration}s:\n")
    print("| mode | c | req/s | requests per worker | connections per worker | busiest |")
    print("| --- | --- | --- | --- | --- | --- |")
    for run in runs:
        requests = " / ".join(str(w["requests"]) for w in run.workers)
        conns = " / ".join(str(w["connections"]) for w in run.workers)
        print(f"| {run.mode} | {run.connections} | {run.rps:.0f} | {requests} | {conns} | "
              f"{run.busiest():.0%} |" + (f" {run.errors} socket errors" if run.errors else ""))  # fmt: skip


if __name__ == "__main__":
    main()
