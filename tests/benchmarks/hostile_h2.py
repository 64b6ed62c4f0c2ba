"""The soak's protocol attacks: what ``tests/server/grpc_api/test_attacks.py`` asserts one at a
time against a bare server, run in turn beside the soak's good traffic.

The attacks speak HTTP/2 frame by frame to the gRPC port through the independent peer of
``tests/h2peer.py`` (floods of pings, settings, resets, empty frames and CONTINUATION frames,
MadeYouReset, SETTINGS storms over many silent calls, one-byte window updates over answers
waiting for window, oversized and malformed headers, a message of millions of empty inputs,
gzip bombs, unfinished 60 MiB messages), and one HTTP/1.1 connection pipelines requests far
ahead of reading its answers. They run one at a time, a pause between two, each bounded in
connections, frames and seconds (:class:`H2Mix`), in a process of their own (spawned, so that
their Python work does not take the GIL from the soak's clients, whose latency is measured);
what the server did with each (a GOAWAY and its code, a call's gRPC status, answers in order)
comes back to the soak's :class:`~tests.benchmarks.hostile.Outcomes` through a queue. The
calls go to ``add`` (FP32 ``x`` ``[N, 4]``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import queue
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import BinaryIO

import grpc
from hyperframe.frame import ContinuationFrame, DataFrame, Frame, HeadersFrame, SettingsFrame

from tests.benchmarks.hostile import HOST, Outcomes, _seconds
from tests.benchmarks.hostile_grpc import infer_request
from tests.h2peer import (
    INITIAL_WINDOW_SIZE,
    Attacker,
    call_block,
    data_frames,
    grpc_headers,
    message,
    raw_frame,
    repeated_block,
    silent_calls,
    upload,
    wait,
    whole_call,
)

MIB = 1 << 20
CODES = {code.value[0]: code.name for code in grpc.StatusCode}


@dataclass(frozen=True)
class H2Mix:
    """How hard the protocol attacks push; every number is a bound."""

    pause_s: float = 2.0  # between two attacks: one runs at a time, the kinds in turn
    flood_frames: int = 10_000  # frames (or calls) of a flood, in one write
    flood_connections: int = 2  # connections each flood round, one after the other
    madeyoureset_s: float = 1.0  # MadeYouReset calls on one connection for this long
    silent_calls: int = 200  # calls held silent under the SETTINGS storm
    storm_frames: int = 4  # SETTINGS frames of ``storm_entries`` INITIAL_WINDOW_SIZE entries
    storm_entries: int = 2600
    waiting_answers: int = 200  # calls whose answers wait for a window kept at 0
    dribble_updates: int = 300  # one-byte connection WINDOW_UPDATEs, 300 a second
    empty_inputs: int = 4_000_000  # empty ``inputs`` entries of one message (8 MiB)
    bombs: int = 6  # gzip bombs a round: 64 KiB inflating to 64 MiB of zeros each
    unfinished: int = 8  # 60 MiB messages declared over 2 connections, 52 MiB of each sent
    unfinished_s: float = 10.0  # the bound on their upload
    pipelined: int = 1000  # HTTP/1.1 requests of 16 KiB sent before any answer is read
    rounds: int = 1000  # rounds of all the kinds, at most


@dataclass(frozen=True)
class Target:
    """Where the attacks go, and where their outcomes go (``add(kind, outcome)``)."""

    grpc_port: int
    http_port: int
    add: Callable[[str, str], None]


def add_message() -> bytes:
    """A good ``ModelInfer`` of one ``[1, 4]`` row to ``add``, serialized."""
    return bytes(infer_request([1.0, 2.0, 3.0, 4.0]).SerializeToString())


@contextlib.contextmanager
def attacking(port: int, settings: dict[int, int] | None = None) -> Iterator[Attacker]:
    attacker = Attacker(port, settings)
    try:
        yield attacker
    finally:
        attacker.close()


def ending(attacker: Attacker, seconds: float = 5.0) -> str:
    """How the server ended the attacker's connection, waited for ``seconds``."""
    code = attacker.goaway(seconds)
    if code is not None:
        return f"GOAWAY {code}"
    return "closed without GOAWAY" if attacker.over else f"timeout: open after {seconds:g} s"


def status(attacker: Attacker, stream: int, pending: str = "timeout: no status") -> str:
    """How the server ended ``stream``: its gRPC status's name, a reset, a GOAWAY or
    ``pending``."""
    peer = attacker.peer
    code = peer.status(stream)
    if code is not None:
        return CODES.get(code, str(code))
    if stream in peer.resets:
        return f"RST_STREAM {peer.resets[stream]}"
    return pending if peer.goaway is None else f"GOAWAY {peer.goaway.error_code}"


# -- floods: frames that ask work and carry no call, in one write ----------------------------


def pings(attacker: Attacker, n: int) -> bytes:
    return b"".join(attacker.peer.ping(b"%08d" % i).serialize() for i in range(n))


def settings(attacker: Attacker, n: int) -> bytes:
    return SettingsFrame(0, settings={SettingsFrame.MAX_CONCURRENT_STREAMS: 100}).serialize() * n


def empty_data(attacker: Attacker, n: int) -> bytes:
    """Empty DATA frames (no END_STREAM) on an open call."""
    stream = attacker.peer.open()
    return attacker.peer.headers(stream).serialize() + DataFrame(stream, b"").serialize() * n


def reset_by_server(attacker: Attacker, n: int) -> bytes:
    """Calls opened and at once sent a WINDOW_UPDATE of 0: the server resets each."""
    peer = attacker.peer
    block = repeated_block(peer)
    return b"".join(
        HeadersFrame(s, block, flags=["END_HEADERS"]).serialize()
        + peer.window_update(s, 0).serialize()
        for s in (peer.open() for _ in range(n))
    )


def rapid_reset(attacker: Attacker, n: int) -> bytes:
    """Whole calls, each at once reset by the client."""
    peer, body = attacker.peer, message(add_message())
    block = repeated_block(peer)
    return b"".join(
        whole_call(s, block, body) + peer.rst(s).serialize()
        for s in (peer.open() for _ in range(n))
    )


def continuations(attacker: Attacker, n: int) -> bytes:
    """HEADERS without END_HEADERS, then one-byte CONTINUATION frames (an endless literal)."""
    stream = attacker.peer.open()
    head = HeadersFrame(stream, call_block(attacker.peer) + b"\x00\x05x-pad\x7f\xff\xff\x03")
    return head.serialize() + ContinuationFrame(stream, b"a").serialize() * (10 * n)


def flood(frames: Callable[[Attacker, int], bytes], kind: str, t: Target, mix: H2Mix) -> None:
    for _ in range(mix.flood_connections):
        with attacking(t.grpc_port) as attacker:
            attacker.send(frames(attacker, mix.flood_frames))
            t.add(kind, ending(attacker))


def madeyoureset(t: Target, mix: H2Mix) -> None:
    """Whole calls, each followed by a DATA frame on its half-closed stream, so that the
    server resets it (MadeYouReset, CVE-2025-8671), in batches of 1000 for
    ``mix.madeyoureset_s``."""
    with attacking(t.grpc_port) as attacker:
        peer = attacker.peer
        attacker.send(peer.window_update(0, 1 << 30))
        block, body = repeated_block(peer), message(add_message())
        began = time.monotonic()
        while time.monotonic() - began < mix.madeyoureset_s and not attacker.over:
            streams = [peer.open() for _ in range(1000)]
            calls = [whole_call(s, block, body) + DataFrame(s, b"x").serialize() for s in streams]
            if not attacker.send(b"".join(calls)):
                break
        t.add("MadeYouReset", ending(attacker))


# -- windows -------------------------------------------------------------------------------------


def settings_storm(t: Target, mix: H2Mix) -> None:
    """Silent calls held open, then SETTINGS frames of thousands of INITIAL_WINDOW_SIZE
    entries each: acknowledged promptly (no entry applied to every stream again)."""
    kind = f"SETTINGS window storm ({mix.silent_calls} silent calls)"
    entries = b"".join(
        (INITIAL_WINDOW_SIZE).to_bytes(2, "big") + (i % 2 << 16).to_bytes(4, "big")
        for i in range(mix.storm_entries)
    )
    with attacking(t.grpc_port) as attacker:

        def acks() -> int:
            frames = list(attacker.peer.frames)
            return sum(isinstance(f, SettingsFrame) and "ACK" in f.flags for f in frames)

        silent_calls(attacker, mix.silent_calls)
        time.sleep(0.5)
        before, began = acks(), time.monotonic()
        attacker.send(raw_frame(0x4, 0, 0, entries) * mix.storm_frames)
        if wait(lambda: acks() >= before + mix.storm_frames or attacker.over, 10):
            took = time.monotonic() - began
            t.add(kind, ending(attacker, 0) if attacker.over else f"acknowledged {_seconds(took)}")
        else:
            t.add(kind, "timeout: not acknowledged in 10 s")


def window_dribble(t: Target, mix: H2Mix) -> None:
    """Calls whose answers wait for a window the client keeps at 0, then one-byte
    WINDOW_UPDATEs to the connection, 300 a second, then one byte to each stream: the
    connection is kept and the well-behaved clients served meanwhile."""
    kind = f"window-update dribble ({mix.waiting_answers} calls)"
    with attacking(t.grpc_port, {INITIAL_WINDOW_SIZE: 0}) as attacker:
        peer = attacker.peer
        block, body = repeated_block(peer), message(add_message())
        streams = [peer.open() for _ in range(mix.waiting_answers)]
        attacker.send(*[whole_call(s, block, body) for s in streams])
        wait(lambda: all(s in peer.blocks or attacker.ended(s) for s in streams), 10)
        began = time.monotonic()
        for i in range(mix.dribble_updates):
            if not attacker.send(peer.window_update(0, 1)):
                break
            time.sleep(max(0.0, began + i / 300 - time.monotonic()))
        attacker.send(*[peer.window_update(s, 1) for s in streams])
        time.sleep(0.5)
        for stream in streams:
            t.add(f"{kind}: calls", status(attacker, stream, "answer waiting for window"))
        t.add(kind, ending(attacker, 0) if attacker.over else "connection kept")


# -- headers and messages ---------------------------------------------------------------------


MALFORMED: dict[str, tuple[list[tuple[str, str]], bool]] = {
    "17KB metadata": ([("x-big", "a" * 17_000)], True),
    "upper-case header name": ([("X-Upper", "1")], True),
    "no :scheme": ([], False),
}
"""A call's extra metadata, and whether it has ``:scheme``: each to be refused alone."""


def malformed(kind: str, t: Target, mix: H2Mix) -> None:
    """A malformed or oversized call, then a good one on the same connection: the first
    refused alone (no GOAWAY), the second answered."""
    extra, scheme = MALFORMED[kind]
    with attacking(t.grpc_port) as attacker:
        peer = attacker.peer
        headers = [h for h in grpc_headers() if scheme or h[0] != ":scheme"] + extra
        block, bad, good = peer.block(headers), peer.open(), peer.open()
        parts = [block[i : i + 16_384] for i in range(0, len(block), 16_384)]
        frames: list[Frame] = [HeadersFrame(bad, parts[0], flags=["END_HEADERS"][len(parts) - 1 :])]
        frames += [peer.continuation(bad, p, end=i == len(parts) - 2) for i, p in enumerate(parts[1:])]  # fmt: skip
        body = message(add_message())
        attacker.send(
            *frames,
            DataFrame(bad, body, flags=["END_STREAM"]),
            peer.headers(good),
            DataFrame(good, body, flags=["END_STREAM"]),
        )
        wait(lambda: attacker.ended(bad) and attacker.ended(good), 10)
        first, second = status(attacker, bad), status(attacker, good)
        if first != "OK" and second == "OK" and peer.goaway is None:
            t.add(kind, f"refused alone ({first}), the next call OK")
        else:
            t.add(kind, f"call {first}, the next call {second}")


def empty_inputs(t: Target, mix: H2Mix) -> None:
    """One ``ModelInfer`` message of millions of empty ``inputs`` entries."""
    kind = f"message of {mix.empty_inputs / 1e6:g}M empty inputs"
    body = memoryview(message(b"\x0a\x03add" + b"\x2a\x00" * mix.empty_inputs))
    with attacking(t.grpc_port) as attacker:
        stream = silent_calls(attacker, 1)[0]
        upload(attacker, {stream: body}, True, time.monotonic() + 20)
        sent = time.monotonic()
        wait(lambda: attacker.ended(stream), 20)
        t.add(kind, f"{status(attacker, stream)} {_seconds(time.monotonic() - sent)}")


@functools.cache
def bomb() -> bytes:
    """A gzip-compressed message of 64 MiB of zeros (64 KiB)."""
    deflater = zlib.compressobj(9, zlib.DEFLATED, 31)
    return message(deflater.compress(bytes(64 * MIB - 1024)) + deflater.flush(), compressed=True)


def gzip_bombs(t: Target, mix: H2Mix) -> None:
    body = bomb()
    kind = f"gzip bomb ({len(body) >> 10} KiB to 64 MiB)"
    with attacking(t.grpc_port) as attacker:
        peer, streams = attacker.peer, []
        for _ in range(mix.bombs):
            stream = peer.open()
            head = HeadersFrame(stream, call_block(peer, extra=[("grpc-encoding", "gzip")]),
                                flags=["END_HEADERS"])  # fmt: skip
            attacker.send(head, *data_frames(stream, body))
            streams.append(stream)
        wait(lambda: all(attacker.ended(s) for s in streams), 20)
        for stream in streams:
            t.add(kind, status(attacker, stream))


def unfinished(t: Target, mix: H2Mix) -> None:
    """Calls over two connections, each declaring a 60 MiB message and sending 52 MiB of it
    within the server's windows, never finishing: what the server holds of them stays within
    its byte budget (past it, RESOURCE_EXHAUSTED); closed after ``mix.unfinished_s``."""
    kind = "unfinished 60 MiB messages"
    body = memoryview((60 * MIB).to_bytes(5, "big") + bytes(52 * MIB - 5))
    attackers = [Attacker(t.grpc_port) for _ in range(2)]
    try:
        streams = {a: silent_calls(a, mix.unfinished // 2) for a in attackers}
        deadline = time.monotonic() + mix.unfinished_s
        uploads = [
            threading.Thread(target=upload, args=(a, dict.fromkeys(s, body), False, deadline))
            for a, s in streams.items()
        ]
        for thread in uploads:
            thread.start()
        for thread in uploads:
            thread.join()
        time.sleep(0.5)
        for attacker, ss in streams.items():
            for stream in ss:
                t.add(kind, status(attacker, stream, "held unfinished until closed"))
    finally:
        for attacker in attackers:
            attacker.close()


# -- HTTP/1.1 ------------------------------------------------------------------------------------


def answer(reader: BinaryIO) -> tuple[int, bytes]:
    """One HTTP/1.1 answer read from ``reader`` (a socket's file): its status and body."""
    line = reader.readline()
    if not line:
        raise ConnectionError("closed by the server")
    code, length = int(line.split()[1]), 0
    while (header := reader.readline().strip()) != b"":
        name, _, value = header.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return code, reader.read(length)


def pipelined(t: Target, mix: H2Mix) -> None:
    """One connection sending ``mix.pipelined`` requests of 16 KiB at once, reading none of
    the answers for a second: all answered, in order."""
    kind = f"pipelined HTTP/1.1 ({mix.pipelined} requests ahead of answers)"
    pad = b" " * (16 * 1024)
    requests = []
    for i in range(mix.pipelined):
        doc = {"id": str(i), "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                         "data": [i, i, i, i]}]}  # fmt: skip
        body = json.dumps(doc).encode() + pad
        requests.append(
            b"POST /v2/models/add/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
    answered = in_order = 0
    with socket.create_connection((HOST, t.http_port), timeout=30) as sock:
        sender = threading.Thread(target=_send, args=(sock, b"".join(requests)), daemon=True)
        sender.start()
        time.sleep(1.0)  # nothing read meanwhile
        reader = sock.makefile("rb")
        try:
            for i in range(mix.pipelined):
                code, body = answer(reader)
                answered += code == 200
                in_order += code == 200 and json.loads(body)["id"] == str(i)
            outcome = f"{answered} of {mix.pipelined} answered 200, {in_order} in order"
        except TimeoutError:
            outcome = f"timeout after {answered} answers"
        except (OSError, ValueError, IndexError) as exc:
            outcome = f"reset: {type(exc).__name__} after {answered} answers"
        sock.shutdown(socket.SHUT_RDWR)
        sender.join(10)
    t.add(kind, outcome)


def _send(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)


# -- the runner ----------------------------------------------------------------------------------


KINDS: list[tuple[str, Callable[[Target, H2Mix], None]]] = [
    *(
        (kind, functools.partial(flood, frames, kind))
        for kind, frames in [
            ("h2 ping flood", pings),
            ("h2 settings flood", settings),
            ("h2 reset flood (server resets)", reset_by_server),
            ("h2 rapid reset", rapid_reset),
            ("h2 empty DATA flood", empty_data),
            ("h2 CONTINUATION flood", continuations),
        ]
    ),
    ("MadeYouReset", madeyoureset),
    ("SETTINGS window storm", settings_storm),
    ("window-update dribble", window_dribble),
    *((kind, functools.partial(malformed, kind)) for kind in MALFORMED),
    ("empty inputs", empty_inputs),
    ("gzip bombs", gzip_bombs),
    ("unfinished messages", unfinished),
    ("pipelined HTTP/1.1", pipelined),
]


def run(
    grpc_port: int, http_port: int, stop: Event, found: Queue[tuple[str, str]], mix: H2Mix
) -> None:
    """The attacks in turn until ``stop`` is set; each outcome put on ``found``."""
    t = Target(grpc_port, http_port, lambda kind, outcome: found.put((kind, outcome)))
    for _ in range(mix.rounds):
        for kind, attack in KINDS:
            if stop.is_set():
                return
            try:
                attack(t, mix)
            except Exception as exc:  # counted, and the next attack goes on
                t.add(kind, f"client error: {type(exc).__name__}: {exc}"[:100])
            if stop.wait(mix.pause_s):
                return


STOP_S = 40.0
"""The longest an attack may take to end once the soak stops (the slowest ends in about 25 s)."""


def start(
    grpc_port: int, http_port: int, stop: threading.Event, outcomes: Outcomes, mix: H2Mix
) -> list[threading.Thread]:
    """Start the attacks in a spawned process, and a thread that records their outcomes and,
    once ``stop`` is set, stops the process."""
    context = multiprocessing.get_context("spawn")
    stopping, found = context.Event(), context.Queue()
    process = context.Process(target=run, args=(grpc_port, http_port, stopping, found, mix),
                              name="h2 attacks", daemon=True)  # fmt: skip
    process.start()

    def collect() -> None:
        stopped = float("inf")
        while process.is_alive() or not found.empty():
            if stop.is_set() and not stopping.is_set():
                stopping.set()
                stopped = time.monotonic()
            if time.monotonic() - stopped > STOP_S:
                outcomes.add(
                    "protocol attacks", f"timeout: still running {STOP_S:g} s after the stop"
                )
                process.terminate()
                break
            with contextlib.suppress(queue.Empty):
                outcomes.add(*found.get(timeout=0.5))
        process.join(5)

    thread = threading.Thread(target=collect, name="h2 attacks", daemon=True)
    thread.start()
    return [thread]
