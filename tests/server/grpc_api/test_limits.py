"""gRPC's bounds in count and time: the call limit with room kept for health, idle streams
ended (or closed to make room), and a client that reads nothing dropped from its routes."""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from plugserve.server.grpc_api.admission import Ended, end_with
from plugserve.server.grpc_api.generated import health_pb2, health_pb2_grpc
from tests.helpers import (
    ServerProcess,
    grpc_engine,
    write_add_runner,
    write_plugin,
    write_streaming_runner,
)

pytestmark = pytest.mark.slow

Server = Callable[..., ServerProcess]


def start(server: Server, tmp_path: Path, plugins_dir: Path, **settings: object) -> ServerProcess:
    path = tmp_path / "plugserve.toml"
    path.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items()))
    (tmp_path / "models").mkdir(exist_ok=True)
    return server(
        "--plugins-dir",
        str(plugins_dir),
        "--models-dir",
        str(tmp_path / "models"),
        "--config",
        str(path),
    )


def add_request(request_id: str = "") -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name="add", id=request_id)
    message.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    message.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
    return message


def count_request(route: str, n: int, request_id: str = "") -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name=route, id=request_id)
    message.inputs.add(name="n", datatype="INT64", shape=[1])
    message.raw_input_contents.append(np.array([n], np.int64).tobytes())
    return message


def healthy(url: str) -> tuple[bool, str, bool]:
    """ServerLive, grpc.health.v1 Check and ServerReady on a channel of their own."""
    with grpc.insecure_channel(url) as channel:
        inference = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        live = inference.ServerLive(service_pb2.ServerLiveRequest(), timeout=10).live
        check = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        ready = inference.ServerReady(service_pb2.ServerReadyRequest(), timeout=10).ready
    return live, health_pb2.HealthCheckResponse.ServingStatus.Name(check.status), ready


class IdleStream:
    """A ModelStreamInfer call that sends ``first`` (if any), then nothing until closed; its
    answers and its end are queued as they come."""

    def __init__(self, channel: grpc.Channel, first: list[Any]) -> None:
        self.stop = threading.Event()
        self.answers: queue.Queue[Any] = queue.Queue()
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        self.call = stub.ModelStreamInfer(self._requests(first), timeout=60)
        threading.Thread(target=self._read, daemon=True).start()

    def _requests(self, first: list[Any]) -> Iterator[Any]:
        yield from first
        self.stop.wait()

    def _read(self) -> None:
        try:
            for answer in self.call:
                self.answers.put(answer)
            self.answers.put(None)
        except grpc.RpcError as exc:
            self.answers.put(exc)

    def close(self) -> None:
        self.stop.set()
        self.call.cancel()

    def end(self, timeout: float = 20) -> grpc.RpcError:
        """The error that ended the call, the answers before it skipped."""
        deadline = time.monotonic() + timeout
        while True:
            item = self.answers.get(timeout=max(0.01, deadline - time.monotonic()))
            if isinstance(item, grpc.RpcError):
                return item
            assert item is not None, "the call ended OK"


def test_idle_streams_leave_room_for_health_then_end(
    server: Server, tmp_path: Path, plugins_dir: Path
) -> None:
    """Issue 29 finding 2: idle ModelStreamInfer streams filling the gRPC call limit locked
    out ServerLive and grpc.health.v1 Check (RESOURCE_EXHAUSTED) for as long as they stayed
    open. Health is counted apart; at the limit an idle stream is closed to make room for a
    data call; the others end after grpc_idle_timeout_s, a busy one does not."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    write_streaming_runner(plugins_dir, "generator", "generator", config="step_s = 0.4")
    srv = start(server, tmp_path, plugins_dir, max_connections=4, grpc_idle_timeout_s=2)
    channel = grpc.insecure_channel(srv.grpc_url)
    busy = IdleStream(channel, [count_request("generator", 12, "busy")])  # ~5 s of answers
    idle = [IdleStream(channel, [add_request(f"idle{i}")]) for i in range(3)]
    try:
        firsts = [stream.answers.get(timeout=15) for stream in [busy, *idle]]
        assert [a.error_message for a in firsts] == [""] * 4  # each open on the server: 4 of 4
        assert healthy(srv.grpc_url) == (True, "SERVING", True)
        time.sleep(1.2)  # idle long enough to be closed for a new call
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answer = stub.ModelInfer(add_request(), timeout=10)
        assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [2.0] * 4
        ends = [stream.end() for stream in idle]
        codes = sorted(e.code().name for e in ends)
        assert codes == ["DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", "UNAVAILABLE"]
        messages = {e.code().name: e.details() for e in ends}
        assert "grpc_idle_timeout_s = 2 s" in messages["DEADLINE_EXCEEDED"]
        assert "max_connections" in messages["UNAVAILABLE"]
        # The busy stream sent nothing more either, but its request ran to its end; then
        # it was idle, and ended in its turn.
        answers = [firsts[0]] + [busy.answers.get(timeout=15) for _ in range(11)]
        counts = [
            np.frombuffer(a.infer_response.raw_output_contents[0], np.int64)[0] for a in answers
        ]
        assert counts == list(range(1, 13))
        assert busy.end().code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        for stream in [busy, *idle]:
            stream.close()
        channel.close()
    assert "Traceback" not in srv.log()


SLOW = """
    import time

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Slow:
        async def infer(self, inputs):
            import asyncio
            await asyncio.sleep(3)
            return {"y": np.asarray(inputs["x"])}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Slow()
"""


def test_unary_calls_at_the_limit_leave_room_for_health(
    server: Server, tmp_path: Path, plugins_dir: Path
) -> None:
    """Issue 29 finding 2, with busy unary calls: ModelInfer calls filling the call limit
    leave health and readiness answering; one more data call is refused RESOURCE_EXHAUSTED
    at once (a busy call is never closed for it)."""
    write_plugin(plugins_dir, "runner", "slow", "1.0.0", "", {"plugin.py": SLOW})
    srv = start(server, tmp_path, plugins_dir, max_connections=2)
    message = service_pb2.ModelInferRequest(model_name="slow")
    message.inputs.add(name="x", datatype="FP32", shape=[1])
    message.raw_input_contents.append(np.ones(1, np.float32).tobytes())
    with grpc.insecure_channel(srv.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        calls = [stub.ModelInfer.future(message, timeout=30) for _ in range(2)]
        time.sleep(0.5)  # both admitted: each is answered only after 3 s
        assert not any(call.done() for call in calls)
        assert healthy(srv.grpc_url) == (True, "SERVING", True)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(message, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_connections" in (refused.value.details() or "")
        assert time.monotonic() - started < 2.5
        assert all(call.result().model_name == "slow" for call in calls)
        stub.ModelInfer(message, timeout=30)  # room again


@pytest.mark.workers(2)
def test_health_answers_on_every_worker_with_its_calls_full(
    server: Server, tmp_path: Path, plugins_dir: Path
) -> None:
    """Issue 29 finding 2, with the supervisor: every worker's call limit full of streams
    (some that sent nothing at all), health answers from whichever worker takes the call."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    srv = start(server, tmp_path, plugins_dir, max_connections=2, grpc_idle_timeout_s=30)
    channels = [grpc.insecure_channel(srv.grpc_url) for _ in range(12)]
    streams: list[IdleStream] = []
    try:
        for channel in channels:  # the kernel spreads connections over both workers
            silent = IdleStream(channel, [])
            answered = IdleStream(channel, [add_request()])
            streams += [silent, answered]
        first = [stream.answers.get(timeout=15) for stream in streams[1::2]]
        refused = [a for a in first if isinstance(a, grpc.RpcError)]
        assert refused, "no worker's limit was reached"
        assert {a.code() for a in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        for _ in range(12):
            assert healthy(srv.grpc_url) == (True, "SERVING", True)
    finally:
        for stream in streams:
            stream.close()
        for channel in channels:
            channel.close()


@pytest.mark.parametrize("kind", ["generator", "steps"])
def test_a_client_that_reads_nothing_frees_its_streams(
    server: Server, tmp_path: Path, plugins_dir: Path, kind: str
) -> None:
    """Issue 29 finding 3: one ModelStreamInfer call asking for max_streams streams, on a
    small flow-control window, that never reads, parked every slot of the streaming route:
    other clients' generate calls waited until their deadline. Its answers unread for
    body_timeout_s end the call, which closes its streams; the status waits behind them.
    (body_timeout_s is below UNREAD_LIMIT_S here: the call ends before its streams would
    give their places up.)"""
    write_streaming_runner(
        plugins_dir, "tokens", kind, runner="max_streams = 4\n", config="step_s = 0.005"
    )
    srv = start(server, tmp_path, plugins_dir, body_timeout_s=0.5)
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
    channel = grpc.insecure_channel(srv.grpc_url, options=options)
    stop = threading.Event()

    def requests() -> Iterator[Any]:
        for i in range(4):
            yield count_request("tokens", 100_000, f"unread{i}")
        stop.wait()

    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    unread = stub.ModelStreamInfer(requests(), timeout=60)  # never read until the end
    try:
        time.sleep(0.5)  # its 4 streams hold the 4 slots
        started = time.monotonic()
        status, _, body = srv.request(
            "POST", "/v2/models/tokens/generate", {"n": [3]}, {"X-Request-Timeout": "20"}
        )
        assert status == 200, body
        assert json.loads(body)["i"] == [1, 2, 3]
        assert time.monotonic() - started < 15
        with pytest.raises(grpc.RpcError) as ended:
            for _ in unread:  # what was sent before the call ended, then its status
                pass
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "body_timeout_s = 0.5 s" in (ended.value.details() or "")
    finally:
        stop.set()
        unread.cancel()
        channel.close()
    assert "Traceback" not in srv.log()


@pytest.mark.parametrize("kind", ["generator", "steps"])
def test_a_client_that_reads_nothing_gives_its_places_up_to_others_at_once(
    server: Server, tmp_path: Path, plugins_dir: Path, kind: str
) -> None:
    """Issue 29 finding 3, within body_timeout_s: the non-reader's streams held the route's
    places until its call ended (60 s by default), and clients with shorter timeouts gave
    up. A stream whose client has taken none of its responses for UNREAD_LIMIT_S (2 s)
    gives its place to a waiting one: other clients are answered within seconds, while the
    non-reader's call is still open."""
    write_streaming_runner(
        plugins_dir, "tokens", kind, runner="max_streams = 4\n", config="step_s = 0.005"
    )
    srv = start(server, tmp_path, plugins_dir)  # body_timeout_s = 60
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
    channel = grpc.insecure_channel(srv.grpc_url, options=options)
    stop = threading.Event()

    def requests() -> Iterator[Any]:
        for i in range(4):
            yield count_request("tokens", 100_000, f"unread{i}")
        stop.wait()

    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    unread = stub.ModelStreamInfer(requests(), timeout=60)
    try:
        time.sleep(0.5)
        for _ in range(3):  # three clients in turn, each on a place a non-reader gave up
            started = time.monotonic()
            status, _, body = srv.request(
                "POST", "/v2/models/tokens/generate", {"n": [3]}, {"X-Request-Timeout": "20"}
            )
            assert status == 200, body
            assert json.loads(body)["i"] == [1, 2, 3]
            assert time.monotonic() - started < 10
    finally:
        stop.set()
        unread.cancel()
        channel.close()
    assert "stream_evicted" in srv.log()
    assert "Traceback" not in srv.log()


def test_a_grpc_connection_that_sends_nothing_is_closed(
    server: Server, tmp_path: Path, plugins_dir: Path
) -> None:
    """Issue 29 finding 2, a connection with no call: one that never sends the HTTP/2
    preface is closed after header_timeout_s (gRPC's own default waits 120 s)."""
    srv = start(server, tmp_path, plugins_dir, header_timeout_s=1)
    with socket.create_connection(("127.0.0.1", srv.grpc_port)) as sock:
        sock.settimeout(0.5)
        started = time.monotonic()
        while time.monotonic() - started < 15:
            try:
                if not sock.recv(65536):  # the server's settings are read and dropped
                    break
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
        took = time.monotonic() - started
    assert took < 8
    assert healthy(srv.grpc_url) == (True, "SERVING", True)


class SilentUnary:
    """Unary calls to ``method`` whose request message never comes: each is opened as a
    stream-unary call over the unary method, its request iterator blocked until closed."""

    def __init__(self, url: str, method: str, count: int) -> None:
        self.gate = threading.Event()
        # A connection of its own: a channel shared with the test's probes would carry them.
        self.channel = grpc.insecure_channel(url, options=[("grpc.use_local_subchannel_pool", 1)])
        call = self.channel.stream_unary(
            method, request_serializer=lambda _: b"", response_deserializer=lambda b: b
        )
        self.futures = [call.future(self._never()) for _ in range(count)]

    def _never(self) -> Iterator[bytes]:
        self.gate.wait()
        yield from ()

    def ended(self) -> list[str]:
        return [f.exception().code().name for f in self.futures if f.done() and f.exception()]

    def close(self) -> None:
        self.gate.set()
        for future in self.futures:
            future.cancel()
        self.channel.close()


LIVE = "/inference.GRPCInferenceService/ServerLive"
INFER = "/inference.GRPCInferenceService/ModelInfer"


def test_health_calls_whose_request_never_comes_leave_room_for_health(
    server: Server, tmp_path: Path, plugins_dir: Path
) -> None:
    """Issue 29, a variant of finding 2 from the attack on its fix: 70 ServerLive calls that
    never send their request message filled health's own 64 calls, and ServerLive and
    Check answered RESOURCE_EXHAUSTED for as long as they stayed open (82 s seen). At the
    limit the call that waited longest for its message is ended to make room, and such a
    call ends once header_timeout_s has passed."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    srv = start(server, tmp_path, plugins_dir, header_timeout_s=4)
    silent = SilentUnary(srv.grpc_url, LIVE, 70)
    try:
        time.sleep(1.5)  # all 70 sent; the 64 admitted wait for their messages
        for _ in range(3):
            assert healthy(srv.grpc_url) == (True, "SERVING", True)
        deadline = time.monotonic() + 20
        while len(silent.ended()) < 70 and time.monotonic() < deadline:
            time.sleep(0.2)
        ended = silent.ended()
        assert len(ended) == 70, ended
        assert set(ended) <= {"RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED"}
        assert "DEADLINE_EXCEEDED" in ended  # header_timeout_s ended those left waiting
    finally:
        silent.close()


def test_data_calls_whose_request_never_comes_leave_room_for_good_calls(
    server: Server, tmp_path: Path, plugins_dir: Path
) -> None:
    """Issue 29, a variant of findings 2 and 3 from the attack on their fix: ModelInfer calls
    that never send their request message, never idle, never swept, filled max_connections
    and every good ModelInfer got RESOURCE_EXHAUSTED past every timeout. Now a good call
    makes room (the call waiting longest for its message is ended UNAVAILABLE), and those
    left end DEADLINE_EXCEEDED after body_timeout_s."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    srv = start(server, tmp_path, plugins_dir, max_connections=8, body_timeout_s=5)
    silent = SilentUnary(srv.grpc_url, INFER, 8)
    try:
        time.sleep(1.5)  # the 8 admitted, waiting for their messages, a second or more
        with grpc.insecure_channel(srv.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for i in range(4):
                answer = stub.ModelInfer(add_request(f"good{i}"), timeout=10)
                assert answer.id == f"good{i}"
        assert silent.ended() == ["UNAVAILABLE"]  # room for the first; the others reuse it
        deadline = time.monotonic() + 20
        while len(silent.ended()) < 8 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted(silent.ended()) == ["DEADLINE_EXCEEDED"] * 7 + ["UNAVAILABLE"]
    finally:
        silent.close()


def test_at_the_limit_a_stream_silent_since_it_opened_goes_first(
    server: Server, tmp_path: Path, plugins_dir: Path
) -> None:
    """Issue 29, from the hostile soak at --workers 2: streams opened and never used, as fast
    as they were ended, kept every stream of a full pool under a quarter second idle, and
    14 good ModelInfer calls got RESOURCE_EXHAUSTED. A stream that has sent nothing since it
    opened is ended first (after 50 ms), before streams that served requests and are idle
    longer."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    srv = start(server, tmp_path, plugins_dir, max_connections=4)
    channel = grpc.insecure_channel(srv.grpc_url)
    used = [IdleStream(channel, [add_request(f"used{i}")]) for i in range(3)]
    silent: IdleStream | None = None
    try:
        assert [stream.answers.get(timeout=15).error_message for stream in used] == [""] * 3
        time.sleep(0.5)
        silent = IdleStream(channel, [])
        time.sleep(0.3)  # the used streams idle 0.8 s, the silent one 0.3 s
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ModelInfer(add_request("good"), timeout=10).id == "good"
        assert silent.end().code() == grpc.StatusCode.UNAVAILABLE
        assert all(stream.answers.empty() for stream in used)  # none of them ended
    finally:
        for stream in [*used, *([silent] if silent else [])]:
            stream.close()
        channel.close()


def test_a_call_ended_for_unread_answers_stays_counted_until_it_ends(
    server: Server, tmp_path: Path, plugins_dir: Path
) -> None:
    """Issue 29, from the review of finding 3's fix: a stream ended for unread answers, its
    status waiting behind them, looked idle a second later and was dropped from the count
    to make room: each such stream let one more call past max_connections, for good. It
    stays counted (new calls refused) and is swept once, until its client reads or goes."""
    write_streaming_runner(
        plugins_dir, "tokens", "steps", runner="max_streams = 4\n", config="step_s = 0.005"
    )
    srv = start(server, tmp_path, plugins_dir, max_connections=1, body_timeout_s=2)
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384),
               ("grpc.use_local_subchannel_pool", 1)]  # fmt: skip
    channel = grpc.insecure_channel(srv.grpc_url, options=options)
    stop = threading.Event()

    def requests() -> Iterator[Any]:
        yield count_request("tokens", 100_000, "unread")
        stop.wait()

    unread = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
        requests(), timeout=60
    )
    try:
        time.sleep(4.5)  # ended after body_timeout_s
        with grpc.insecure_channel(srv.grpc_url) as other:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(other)
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.ModelInfer(count_request("tokens", 1), timeout=10)
                if grpc_engine() == "native":
                    # It sends nothing past the client's window: the ended call holds
                    # nothing, its status goes at once, and its place is free.
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert "ModelStreamInfer" in (refused.value.details() or "")
                    continue
                # grpcio's status waits behind the answers the client has not read.
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                time.sleep(1.2)
                assert not unread.done()
        timed_out = [line for line in srv.log().splitlines() if "grpc_calls_timed_out" in line]
        assert len(timed_out) == 1, timed_out  # swept once, not once a second
    finally:
        stop.set()
        unread.cancel()
        channel.close()


class UnsendableContext:
    """The part of ``grpc.aio.ServicerContext`` that ``end_with`` uses, whose ``abort`` fails
    as gRPC's core does when a call's status cannot be sent (its client reads nothing, or is
    gone): a stand-in, as which of the two happens first is a race in the core."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise self.error


async def test_a_status_that_cannot_be_sent_ends_the_handler_quietly() -> None:
    """From the hostile soak after issue 29 finding 3's fix: a stream the server ended for
    unread answers sometimes could not be sent its status, and gRPC logged an
    ExecuteBatchError traceback at error level. The handler ends with CancelledError
    (logged at debug by grpc.aio); a status that was sent still ends it with AbortError."""
    ended = Ended(grpc.StatusCode.DEADLINE_EXCEEDED, "the client read none of the answers")
    with pytest.raises(asyncio.CancelledError):
        await end_with(UnsendableContext(RuntimeError("execute_batch failed")), ended)
    with pytest.raises(grpc.aio.AbortError):
        await end_with(UnsendableContext(grpc.aio.AbortError()), ended)
