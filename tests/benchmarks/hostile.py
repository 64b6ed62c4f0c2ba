"""The soak's hostile mix: clients that try to stall, exhaust or crash the server beside good traffic.

Each kind runs in its own thread, on loopback, bounded in count and paced, and
stops when the soak's stop event is set. What each attempt got is counted by
kind and outcome (a status, ``timeout``, ``reset``, how long the server held a
connection before closing it, ...). :func:`start` needs the soak's routes:
``add`` (FP32 ``x`` ``[N, 4]``), ``strings`` (an ONNX STRING input ``in_s``
``[N, 1]``), ``slow`` (a runner that takes its time, with a bounded queue), the bundled
``chat`` and ``embed`` routes (OpenAI's and Triton's generate) and ``matmul`` (inputs ``a``
``[N, k]`` and ``b`` ``[N, j]`` whose ``k`` and ``j`` the model requires equal: ONNX Runtime
refuses other shapes at run time).
"""

from __future__ import annotations

import gzip
import http.client
import json
import select
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

HOST = "127.0.0.1"
BOMB_ELEMENTS = 15_000_000  # empty BYTES elements: 4 zero bytes each, ~57 MiB inflated
HUGE_JSON_NUMBERS = 24_000_000  # ~46 MiB of JSON numbers
BIG_JSON_NUMBERS = 8_000_000  # ~15 MiB: under max_json_bytes
PARTIAL_HEADERS = b"POST /v2/models/add/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty"


@dataclass
class Outcomes:
    """What every hostile attempt got, by kind and outcome; shared by the hostile threads."""

    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.counts[(kind, outcome)] += 1

    def by_kind(self) -> dict[str, dict[str, int]]:
        table: dict[str, dict[str, int]] = {}
        with self.lock:
            for (kind, outcome), n in sorted(self.counts.items()):
                table.setdefault(kind, {})[outcome] = n
        return table


@dataclass(frozen=True)
class Mix:
    """How hard the hostile mix pushes; every number is a bound."""

    half_open: int = 200  # connections held with unfinished headers at any time
    slow_bodies: int = 20  # connections sending their body one byte a second
    abandon_burst: int = 8  # requests sent to the slow queue and hung up on, each second
    bomb_every_s: float = 3.0
    huge_json_every_s: float = 10.0
    bad_bytes_every_s: float = 0.5
    bad_header_every_s: float = 0.3
    big_prompt_every_s: float = 2.0
    big_prompt_mib: int = 24  # one message, prompt or text of this size
    bad_tensor_every_s: float = 0.2
    max_attempts: int = 100_000  # per kind, whatever the duration


def start(port: int, stop: threading.Event, outcomes: Outcomes, mix: Mix) -> list[threading.Thread]:
    """Start one thread per hostile kind; they end soon after ``stop`` is set."""
    kinds: list[Callable[[int, threading.Event, Outcomes, Mix], None]] = [
        gzip_bombs,
        half_open,
        slow_bodies,
        abandon_queue,
        bad_bytes,
        bad_binary_headers,
        huge_json,
        big_prompts,
        bad_tensors,
    ]
    threads = [
        threading.Thread(target=kind, args=(port, stop, outcomes, mix), name=kind.__name__,
                         daemon=True)
        for kind in kinds
    ]  # fmt: skip
    for thread in threads:
        thread.start()
    return threads


# -- one-shot requests ------------------------------------------------------------------


def post(port: int, path: str, body: bytes, headers: dict[str, str], timeout: float) -> str:
    """One request on its own connection: its status, or what went wrong, as an outcome."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    started = time.monotonic()
    try:
        conn.request("POST", path, body, headers)
        response = conn.getresponse()
        response.read()
        return f"{response.status} ({_seconds(time.monotonic() - started)})"
    except TimeoutError:
        return "timeout"
    except ConnectionResetError:
        return "reset"
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__
    finally:
        conn.close()


def _seconds(elapsed: float) -> str:
    """A coarse latency bucket, so that outcomes stay few."""
    for bound in (0.1, 1, 5, 30):
        if elapsed < bound:
            return f"<{bound:g}s"
    return ">=30s"


def paced(stop: threading.Event, every_s: float, mix: Mix) -> Iterator[int]:
    """Attempt numbers, one every ``every_s``, until stopped or the bound is reached."""
    for attempt in range(mix.max_attempts):
        if stop.is_set():
            return
        yield attempt
        if stop.wait(every_s):
            return


def binary_request(inputs: list[dict[str, Any]], blob: bytes) -> tuple[bytes, dict[str, str]]:
    header = json.dumps({"inputs": inputs}).encode()
    return header + blob, {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }


def bytes_elements(*items: bytes) -> bytes:
    """The binary extension's BYTES layout: each element a 4-byte length, then its bytes."""
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def gzip_bombs(port: int, stop: threading.Event, outcomes: Outcomes, mix: Mix) -> None:
    """A ~60 KiB gzip body inflating to ~57 MiB of BYTES, to an unknown and a real route."""
    inputs = [{"name": "in_s", "datatype": "BYTES", "shape": [BOMB_ELEMENTS, 1],
               "parameters": {"binary_data_size": 4 * BOMB_ELEMENTS}}]  # fmt: skip
    body, headers = binary_request(inputs, bytes(4 * BOMB_ELEMENTS))
    bomb = gzip.compress(body, 9)
    del body
    headers["Content-Encoding"] = "gzip"
    for attempt in paced(stop, mix.bomb_every_s, mix):
        route = "nope" if attempt % 2 == 0 else "strings"
        outcome = post(port, f"/v2/models/{route}/infer", bomb, headers, timeout=60)
        outcomes.add(f"gzip bomb ({len(bomb) // 1024} KiB) to {route}", outcome)


def huge_json(port: int, stop: threading.Event, outcomes: Outcomes, mix: Mix) -> None:
    """JSON numbers for a ``[1, 4]`` input, in turn ~46 MiB (over ``max_json_bytes``: a 413
    before it is parsed) and ~15 MiB (within it: costly to parse, then a 400)."""
    bodies = []
    for numbers in (HUGE_JSON_NUMBERS, BIG_JSON_NUMBERS):
        data = b"0," * (numbers - 1) + b"0"
        bodies.append(b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":['
                      + data + b"]}]}")  # fmt: skip
        del data
    for attempt in paced(stop, mix.huge_json_every_s, mix):
        body = bodies[attempt % 2]
        outcome = post(port, "/v2/models/add/infer", body, {"Content-Type": "application/json"},
                       timeout=60)  # fmt: skip
        outcomes.add(f"huge JSON ({len(body) >> 20} MiB)", outcome)


def bad_bytes(port: int, stop: threading.Event, outcomes: Outcomes, mix: Mix) -> None:
    """Non-UTF-8 BYTES to an ONNX string input (beside good ones that batch with them)."""
    blob = bytes_elements(b"ok", b"\xff\xfe\xfd")
    inputs = [{"name": "in_s", "datatype": "BYTES", "shape": [2, 1],
               "parameters": {"binary_data_size": len(blob)}}]  # fmt: skip
    body, headers = binary_request(inputs, blob)
    for _ in paced(stop, mix.bad_bytes_every_s, mix):
        outcomes.add("non-UTF-8 BYTES", post(port, "/v2/models/strings/infer", body, headers, 30))


def malformed_binary() -> list[tuple[str, bytes, dict[str, str]]]:
    """Binary requests whose header length or data is wrong: (name, body, headers)."""
    raw = struct.pack("<4f", 1, 2, 3, 4)
    inputs = [{"name": "x", "datatype": "FP32", "shape": [1, 4],
               "parameters": {"binary_data_size": len(raw)}}]  # fmt: skip
    body, headers = binary_request(inputs, raw)
    cases = [
        (name, body, {**headers, "Inference-Header-Content-Length": value})
        for name, value in [
            ("negative length", "-5"),
            ("huge length", "9" * 30),
            ("non-numeric length", "abc"),
            ("empty length", ""),
            ("length past the body", str(len(body) + 100)),
            ("length inside the JSON", "7"),
        ]
    ]
    truncated = body[: -len(raw) // 2]
    cases.append(("truncated binary data", truncated, headers))
    return cases


def bad_binary_headers(port: int, stop: threading.Event, outcomes: Outcomes, mix: Mix) -> None:
    cases = malformed_binary()
    for attempt in paced(stop, mix.bad_header_every_s, mix):
        name, body, headers = cases[attempt % len(cases)]
        outcome = post(port, "/v2/models/add/infer", body, headers, timeout=30)
        outcomes.add(f"binary header: {name}", outcome)


# -- connections that linger ------------------------------------------------------------


def _connect(port: int, first: bytes) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=5)
    sock.sendall(first)
    sock.setblocking(False)
    return sock


def _answered(sock: socket.socket) -> str | None:
    """What the server did with a held connection, or ``None`` while it still holds it."""
    try:
        data = sock.recv(4096)
    except BlockingIOError:
        return None
    except ConnectionResetError:
        return "reset by the server"
    except OSError as exc:
        return type(exc).__name__
    if not data:
        return "closed by the server"
    status = data.split(b" ", 2)[1].decode(errors="replace") if data.startswith(b"HTTP/") else "?"
    return f"answered {status}"


HELD_PAST_TIMEOUTS_S = 65.0
"""A connection the server still holds after this long has outlived every timeout."""


class Held:
    """Connections kept open by one hostile kind: topped up, watched, closed at the end."""

    def __init__(self, kind: str, port: int, outcomes: Outcomes, first: bytes) -> None:
        self.kind, self.port, self.outcomes, self.first = kind, port, outcomes, first
        self.socks: dict[socket.socket, float] = {}
        self.opened = 0

    def top_up(self, target: int, mix: Mix) -> None:
        while len(self.socks) < target and self.opened < mix.max_attempts:
            self.opened += 1
            try:
                self.socks[_connect(self.port, self.first)] = time.monotonic()
            except OSError as exc:
                self.outcomes.add(self.kind, f"connect failed: {type(exc).__name__}")
                return

    def reap(self) -> None:
        """Count and drop every connection the server answered, closed or reset."""
        if not self.socks:
            return
        poller = select.poll()
        by_fd = {sock.fileno(): sock for sock in self.socks}
        for fd in by_fd:
            poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        for fd, _ in poller.poll(0):
            sock = by_fd[fd]
            outcome = _answered(sock)
            if outcome is not None:
                held = time.monotonic() - self.socks.pop(sock)
                self.outcomes.add(self.kind, f"{outcome} after {_seconds(held)}")
                sock.close()

    def close(self) -> None:
        now = time.monotonic()
        for sock, opened in self.socks.items():
            # Within the server's longest timeout (body_timeout_s = 60 s, a 1 s sweep) a
            # held connection is expected; past it, the server failed to close it.
            late = now - opened > HELD_PAST_TIMEOUTS_S
            self.outcomes.add(
                self.kind,
                "still held past every timeout" if late else "open at the end, within its timeout",
            )
            sock.close()
        self.socks.clear()


def half_open(port: int, stop: threading.Event, outcomes: Outcomes, mix: Mix) -> None:
    """Connections that send part of their headers and then nothing."""
    held = Held("half-open (partial headers)", port, outcomes, PARTIAL_HEADERS)
    try:
        while not stop.is_set():
            held.top_up(mix.half_open, mix)
            held.reap()
            stop.wait(1.0)
    finally:
        held.close()


def slow_bodies(port: int, stop: threading.Event, outcomes: Outcomes, mix: Mix) -> None:
    """Complete headers, then a 100 kB body sent one byte a second."""
    head = (
        b"POST /v2/models/add/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
    )
    held = Held("slow body (1 byte/s)", port, outcomes, head)
    try:
        while not stop.is_set():
            held.top_up(mix.slow_bodies, mix)
            for sock in list(held.socks):
                with suppress(OSError):
                    sock.send(b" ")
            held.reap()
            stop.wait(1.0)
    finally:
        held.close()


def abandon_queue(port: int, stop: threading.Event, outcomes: Outcomes, mix: Mix) -> None:
    """Requests to the slow route's queue, hung up on 50 ms later (before their answer)."""
    body = json.dumps({"x": [[0.0]]}).encode()
    request = (
        b"POST /predict/slow HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body
    for _ in paced(stop, 1.0, mix):
        socks = []
        for _ in range(mix.abandon_burst):
            try:
                socks.append(_connect(port, request))
            except OSError as exc:
                outcomes.add("hung up mid-queue", f"connect failed: {type(exc).__name__}")
        time.sleep(0.05)
        for sock in socks:
            outcome = _answered(sock)
            outcomes.add("hung up mid-queue", "hung up" if outcome is None else outcome)
            sock.close()


# -- requests that cost the server, then a 4xx ------------------------------------------


def big_prompt_bodies(mib: int) -> list[tuple[str, str, bytes]]:
    """(kind, path, body): one text of ``mib`` MiB to each text front end of the bundled
    routes, under the body limit: the preprocessors must refuse it without stalling."""
    text = ("lorem ipsum dolor sit amet " * (mib * 1024 * 1024 // 27 + 1))[: mib * 1024 * 1024]
    message = {"model": "chat", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    return [
        ("/v1/chat/completions", "/v1/chat/completions", json.dumps(message).encode()),
        ("/v1/completions", "/v1/completions",
         json.dumps({"model": "chat", "prompt": text, "max_tokens": 4}).encode()),
        ("generate", "/v2/models/chat/generate",
         json.dumps({"text_input": text, "max_tokens": 4}).encode()),
        ("/v1/embeddings", "/v1/embeddings", json.dumps({"model": "embed", "input": text}).encode()),
    ]  # fmt: skip


def big_prompts(port: int, stop: threading.Event, outcomes: Outcomes, mix: Mix) -> None:
    """A prompt of ``mix.big_prompt_mib`` MiB to chat, completions, generate and embeddings,
    in turn: a 400 for the prompt limit (embeddings: truncated, 200), never a stall."""
    cases = big_prompt_bodies(mix.big_prompt_mib)
    for attempt in paced(stop, mix.big_prompt_every_s, mix):
        kind, path, body = cases[attempt % len(cases)]
        outcome = post(port, path, body, {"Content-Type": "application/json"}, timeout=60)
        outcomes.add(f"big prompt ({mix.big_prompt_mib} MiB) to {kind}", outcome)


def matmul_request(k: int, j: int, values: list[float]) -> bytes:
    """A v2 JSON request to ``matmul``: ``a`` ``[1, k]``, ``b`` ``[1, j]``."""
    inputs = [
        {"name": "a", "datatype": "FP32", "shape": [1, k], "data": values[:k]},
        {"name": "b", "datatype": "FP32", "shape": [1, j], "data": values[:j]},
    ]
    return json.dumps({"inputs": inputs}).encode()


def bad_tensors(port: int, stop: threading.Event, outcomes: Outcomes, mix: Mix) -> None:
    """Shapes the declared inputs admit but ONNX Runtime refuses (``k`` != ``j``): a 400 for
    the sender alone, never a circuit opened for the good ``matmul`` clients."""
    for attempt in paced(stop, mix.bad_tensor_every_s, mix):
        k, j = (4, 3) if attempt % 2 else (2, 5)
        body = matmul_request(k, j, [1.0] * 5)
        outcome = post(port, "/v2/models/matmul/infer", body,
                       {"Content-Type": "application/json"}, timeout=30)  # fmt: skip
        outcomes.add("bad tensors (k != j) to matmul", outcome)
