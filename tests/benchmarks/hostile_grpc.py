"""The soak's gRPC clients: good ``ModelInfer`` traffic, health probes, and hostile streams.

Good traffic and probes use the sync ``grpc`` channel with Triton's generated stubs (what
``tritonclient.grpc`` sends). The hostile kinds hold many calls at once, so they run on a
``grpc.aio`` channel in an event loop of their own thread:

- **idle streams**: ``ModelStreamInfer`` calls that send nothing, topped up to a count
  above the server's call limit, each held until the server ends it;
- **unread streams**: ``ModelStreamInfer`` calls that ask the streaming ``chat`` route for
  many tokens over a small flow-control window and never read an answer.

What the server did with each (its gRPC status, and after how long) goes to the soak's
:class:`~tests.benchmarks.hostile.Outcomes`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.benchmarks.hostile import Outcomes, _seconds

HEALTH = "/grpc.health.v1.Health/Check"
HEALTH_REQUEST = b""  # HealthCheckRequest{service: ""}: the server as a whole


@dataclass(frozen=True)
class GrpcMix:
    """How hard the gRPC hostile kinds push; every number is a bound."""

    idle_streams: int = 600  # silent ModelStreamInfer calls held at any time
    unread_every_s: float = 2.0  # a new unread stream this often
    unread_requests: int = 64  # chat requests on each unread stream
    unread_held: int = 4  # unread streams open at once, at most
    window_bytes: int = 16 * 1024  # the unread streams' flow-control lookahead


def infer_request(x: list[float]) -> service_pb2.ModelInferRequest:
    """A ``ModelInfer`` of one ``[1, 4]`` FP32 row to ``add``, its data as raw contents."""
    request = service_pb2.ModelInferRequest(model_name="add")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    del tensor  # the raw contents carry the data
    request.raw_input_contents.append(np.array([x], np.float32).tobytes())
    return request


REFUSED: Counter[str] = Counter()
"""What the good clients' calls that failed were told, by status and message."""
REFUSED_LOCK = threading.Lock()


def good_client(
    grpc_port: int, stop: threading.Event, seed: int, add: Callable[[str, int, float], None]
) -> None:
    """Good ``ModelInfer`` calls on one channel until stopped; ``add(kind, status, s)``
    records each (200 for OK, else 1000 + the gRPC status code)."""
    rng = np.random.default_rng(seed)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        while not stop.is_set():
            request = infer_request(rng.random(4).tolist())
            started = time.perf_counter()
            try:
                stub.ModelInfer(request, timeout=30)
                status = 200
            except grpc.RpcError as exc:
                status = 1000 + exc.code().value[0]
                with REFUSED_LOCK:
                    REFUSED[f"{exc.code().name}: {(exc.details() or '')[:160]}"] += 1
            add("gRPC ModelInfer", status, time.perf_counter() - started)


def probe(channel: grpc.Channel) -> dict[str, tuple[str, float]]:
    """One round of the gRPC health probes, ``ServerLive`` and ``grpc.health.v1`` ``Check``:
    for each, ``ok`` or the status code's name, and the seconds it took."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    check = channel.unary_unary(HEALTH, request_serializer=None, response_deserializer=None)
    found = {}
    for name, call in (
        ("gRPC ServerLive", lambda: stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=2)),
        ("gRPC Health/Check", lambda: check(HEALTH_REQUEST, timeout=2)),
    ):
        started = time.perf_counter()
        try:
            call()
            outcome = "ok"
        except grpc.RpcError as exc:
            outcome = exc.code().name
        found[name] = (outcome, time.perf_counter() - started)
    return found


def start_hostile(
    grpc_port: int, stop: threading.Event, outcomes: Outcomes, mix: GrpcMix
) -> list[threading.Thread]:
    """Start the idle and the unread streams in one thread and its event loop (grpc.aio
    polls its completion queue for one loop per process)."""

    async def both() -> None:
        await asyncio.gather(
            idle_streams(grpc_port, stop, outcomes, mix),
            unread_streams(grpc_port, stop, outcomes, mix),
        )

    thread = threading.Thread(target=lambda: asyncio.run(both()), name="grpc streams", daemon=True)
    thread.start()
    return [thread]


async def _wait(stop: threading.Event, seconds: float) -> bool:
    """Sleep ``seconds`` on the loop; whether ``stop`` is set."""
    await asyncio.sleep(seconds)
    return stop.is_set()


async def _held(
    call: grpc.aio.StreamStreamCall, opened: float, kind: str, outcomes: Outcomes
) -> None:
    """Wait for the server to end ``call``; record its status and how long it was held."""
    try:
        code = await call.code()
    except asyncio.CancelledError:
        call.cancel()
        outcomes.add(kind, "open at the end")
        raise
    outcomes.add(kind, f"{code.name} after {_seconds(time.monotonic() - opened)}")


async def idle_streams(
    grpc_port: int, stop: threading.Event, outcomes: Outcomes, mix: GrpcMix
) -> None:
    """``ModelStreamInfer`` calls that send nothing: ``mix.idle_streams`` open at any time."""
    kind = f"idle ModelStreamInfer (held {mix.idle_streams})"
    silent = asyncio.Event()  # never set: the request iterators wait on it until cancelled

    async def nothing():  # type: ignore[no-untyped-def]
        await silent.wait()
        yield service_pb2.ModelInferRequest()

    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        held: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            while len(held) < mix.idle_streams:
                call = stub.ModelStreamInfer(nothing())
                task = asyncio.create_task(_held(call, time.monotonic(), kind, outcomes))
                held.add(task)
                task.add_done_callback(held.discard)
            if await _wait(stop, 1.0):
                break
        for task in list(held):
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)


def chat_request(n: int) -> service_pb2.ModelInferRequest:
    """A generation request to the bundled ``chat`` route: ``text_input`` and ``max_tokens``."""
    request = service_pb2.ModelInferRequest(model_name="chat", id=f"unread-{n}")
    request.inputs.add(
        name="text_input", datatype="BYTES", shape=[1]
    ).contents.bytes_contents.append(b"<|user|>\nsay something long<|end|>\n<|assistant|>\n")
    request.parameters["max_tokens"].int64_param = 256
    request.parameters["ignore_eos"].bool_param = True
    return request


async def unread_streams(
    grpc_port: int, stop: threading.Event, outcomes: Outcomes, mix: GrpcMix
) -> None:
    """Streams of ``mix.unread_requests`` chat requests, over a small window, never read."""
    kind = f"unread ModelStreamInfer ({mix.unread_requests} chat requests)"
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", mix.window_bytes)]
    held: set[asyncio.Task[None]] = set()
    n = 0
    while not stop.is_set():
        if len(held) < mix.unread_held:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options=options)
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            requests = [
                chat_request(n * mix.unread_requests + i) for i in range(mix.unread_requests)
            ]
            n += 1
            call = stub.ModelStreamInfer(iter(requests))
            task = asyncio.create_task(_unread(call, channel, kind, outcomes))
            held.add(task)
            task.add_done_callback(held.discard)
        if await _wait(stop, mix.unread_every_s):
            break
    for task in list(held):
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)


async def _unread(
    call: grpc.aio.StreamStreamCall, channel: grpc.aio.Channel, kind: str, outcomes: Outcomes
) -> None:
    try:
        await _held(call, time.monotonic(), kind, outcomes)
    finally:
        await channel.close()
