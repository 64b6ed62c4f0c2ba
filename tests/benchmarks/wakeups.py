"""What one more process on a request's path costs when nothing else is running: wake-ups.

    python -m tests.benchmarks.wakeups [--round-trips 5000]

Two processes send one small message back and forth over a Unix socket pair,
one at a time, as a worker and an isolated runner's process do at c=1: first
with blocking calls, then with an event loop on each side (uvloop where
installed, as the server runs). Prints the wall time and the CPU time (both
processes, user + system) per round trip: the floor under what an isolated
runner adds to a request when the server is otherwise idle. Not run by CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import time


def _event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def blocking(count: int) -> tuple[float, float]:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        for _ in range(count):
            theirs.recv(64)
            theirs.send(b"y")
        os._exit(0)
    theirs.close()
    wall, cpu = time.perf_counter(), _cpu()
    for _ in range(count):
        ours.send(b"x")
        ours.recv(64)
    os.waitpid(pid, 0)
    return time.perf_counter() - wall, _cpu() - cpu


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[attr-defined]


def event_loops(count: int) -> tuple[float, float]:
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        loop = _event_loop()
        done = loop.create_future()

        async def serve() -> None:
            await loop.connect_accepted_socket(_Echo, theirs)
            await done

        loop.call_later(600, done.cancel)
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            loop.run_until_complete(serve())
        os._exit(0)
    theirs.close()

    async def drive() -> tuple[float, float]:
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        wall, cpu = time.perf_counter(), _cpu()
        for _ in range(count):
            writer.write(b"x")
            await reader.read(64)
        took = time.perf_counter() - wall, _cpu() - cpu
        writer.close()
        return took

    loop = _event_loop()
    try:
        result = loop.run_until_complete(drive())
    finally:
        loop.close()
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=5000)
    args = parser.parse_args()
    for name, run in (("blocking calls", blocking), ("event loops", event_loops)):
        wall, cpu = run(args.round_trips)
        print(f"{name:15}: {wall / args.round_trips * 1e6:6.1f} us wall, "
              f"{cpu / args.round_trips * 1e6:6.1f} us CPU per round trip")  # fmt: skip


if __name__ == "__main__":
    main()
