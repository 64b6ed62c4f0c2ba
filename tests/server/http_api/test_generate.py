"""Triton's generate extension on a real server: generate, generate_stream (SSE), for the three
kinds of streaming runner, and what a client sees when a stream fails, times out or is left."""

import json
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ServerProcess, metric, until, write_add_runner, write_streaming_runner

pytestmark = pytest.mark.slow


def sse(raw: bytes) -> list[Any]:
    """The ``data:`` events of a Server-Sent Events body, parsed."""
    events = [e for e in raw.decode().split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), raw
    return [json.loads(e[len("data: ") :]) for e in events]


@pytest.fixture
def streams(plugins_dir: Path, server: Callable[..., ServerProcess]) -> ServerProcess:
    write_streaming_runner(plugins_dir, "steps", "steps", runner="max_batch_size = 8\n")
    write_streaming_runner(plugins_dir, "gen", "generator", config="fail_at = 0\n")
    write_streaming_runner(plugins_dir, "agen", "async")
    write_streaming_runner(plugins_dir, "failing", "generator", config="fail_at = 3\n")
    write_streaming_runner(plugins_dir, "slow", "generator", config="step_s = 0.2\n")
    write_streaming_runner(plugins_dir, "declared", "generator", config="declare_outputs = true\n")
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    return server("--plugins-dir", str(plugins_dir))


@pytest.mark.workers(1, 2)
def test_every_kind_of_streaming_runner_streams_and_generates(streams: ServerProcess) -> None:
    for route in ("steps", "gen", "agen"):
        status, headers, body = streams.request(
            "POST", f"/v2/models/{route}/generate_stream", {"n": [3]}
        )
        assert status == 200, body
        assert headers["Content-Type"].startswith("text/event-stream")
        events = sse(body)
        assert [e["i"] for e in events] == [1, 2, 3]
        assert all(e["model_name"] == route and e["model_version"] == "1.0.0" for e in events)
        status, _, body = streams.request("POST", f"/v2/models/{route}/generate", {"n": [3]})
        assert status == 200, body
        merged = json.loads(body)
        assert merged["text_output"] == "t1 t2 t3 "  # texts joined, arrays concatenated
        assert merged["i"] == [1, 2, 3]
    # A route that answers once answers once on both; parameters travel apart from inputs.
    request = {"x": [[1.0, 2.0, 3.0, 4.0]], "parameters": {"priority": 0}}
    status, _, body = streams.request("POST", "/v2/models/add/generate_stream", request)
    assert status == 200, body
    assert sse(body)[0]["y"] == [[2.0, 3.0, 4.0, 5.0]]
    status, _, body = streams.request("POST", "/v2/models/add/versions/1/generate", request)
    assert json.loads(body)["y"] == [[2.0, 3.0, 4.0, 5.0]], body


def test_a_generation_of_no_response_answers_its_outputs_empty(streams: ServerProcess) -> None:
    """A stream that sends nothing (a generation of no token) still answers each output
    field: ``generate`` once, ``generate_stream`` as one event. Without declared outputs,
    ``text_output``, as Triton's generation backends answer."""
    empty = {"declared": {"i": [], "text_output": ""}}
    for route in ("steps", "gen", "agen", "declared"):
        expected = {"model_name": route, "model_version": "1.0.0"}
        expected |= empty.get(route, {"text_output": ""})
        status, headers, body = streams.request(
            "POST", f"/v2/models/{route}/generate_stream", {"n": [0]}
        )
        assert status == 200, body
        assert headers["Content-Type"].startswith("text/event-stream")
        assert sse(body) == [expected]
        status, _, body = streams.request("POST", f"/v2/models/{route}/generate", {"n": [0]})
        assert status == 200, body
        assert json.loads(body) == expected
    # One response or more: only what the stream sent.
    status, _, body = streams.request("POST", "/v2/models/declared/generate", {"n": [1]})
    assert json.loads(body) == {"model_name": "declared", "model_version": "1.0.0",
                                "i": 1, "text_output": "t1 "}  # fmt: skip


def test_streaming_routes_refuse_single_answer_calls_and_bad_requests(
    streams: ServerProcess,
) -> None:
    infer = {"inputs": [{"name": "n", "datatype": "INT64", "shape": [1], "data": [2]}]}
    # Triton's words (the HTTP front ends word the core's protocol-neutral StreamingOnly).
    decoupled = b"HTTP end point doesn't support models with decoupled transaction policy"
    status, _, body = streams.request("POST", "/v2/models/steps/infer", infer)
    assert status == 400 and b"generate_stream" in body and decoupled in body, body
    status, _, body = streams.request("POST", "/predict/steps", {"n": [2]})
    assert status == 400 and decoupled in body, body
    for bad in (b"[1, 2]", b'{"n": [1], "parameters": [1]}', b"{"):
        status, _, body = streams.request(
            "POST", "/v2/models/steps/generate_stream", bad, {"Content-Type": "application/json"}
        )
        assert status == 400, body
    status, _, body = streams.request("POST", "/v2/models/nope/generate", {"n": [1]})
    assert status == 404, body
    # What fails before the first response is an HTTP error, with its status.
    status, _, body = streams.request("POST", "/v2/models/steps/generate_stream", {"n": [-1]})
    assert status == 500 and "negative" in json.loads(body)["error"], body
    status, _, body = streams.request("POST", "/v2/models/steps/generate_stream", {"n": ["x"]})
    assert status == 400, body
    # The runner's validate() runs before its stream starts.
    status, _, body = streams.request("POST", "/v2/models/steps/generate_stream", {"n": [10**6]})
    assert status == 400 and "at most 100000" in json.loads(body)["error"], body


def test_a_stream_that_fails_or_times_out_ends_with_an_error_event(streams: ServerProcess) -> None:
    status, _, body = streams.request("POST", "/v2/models/failing/generate_stream", {"n": [5]})
    assert status == 200
    events = sse(body)
    assert [e.get("i") for e in events[:2]] == [1, 2]
    assert "failed at step 3" in events[2]["error"] and len(events) == 3
    started = time.monotonic()
    status, _, body = streams.request(
        "POST", "/v2/models/slow/generate_stream", {"n": [20]}, {"X-Request-Timeout": "0.7"}
    )
    assert time.monotonic() - started < 2.5
    events = sse(body)
    assert 1 <= len(events) - 1 <= 4 and "deadline" in events[-1]["error"], events
    # generate answers once: its deadline is an ordinary 504.
    status, _, body = streams.request(
        "POST", "/v2/models/slow/generate", {"n": [20]}, {"X-Request-Timeout": "0.3"}
    )
    assert status == 504, body


def _read_events(sock: socket.socket, count: int) -> bytes:
    seen = b""
    while seen.count(b"data: ") < count:
        chunk = sock.recv(65536)
        assert chunk, seen
        seen += chunk
    return seen


@pytest.mark.parametrize("kind", ["steps", "generator", "async"])
def test_a_client_that_hangs_up_stops_the_runner_within_one_step(
    kind: str, plugins_dir: Path, tmp_path: Path, server: Callable[..., ServerProcess]
) -> None:
    log = tmp_path / "steps.log"
    write_streaming_runner(
        plugins_dir, "long", kind, runner="max_batch_size = 4\n",
        config=f'step_s = 0.1\nlog = "{log}"\n',
    )  # fmt: skip
    proc = server("--plugins-dir", str(plugins_dir))
    body = json.dumps({"n": [200]}).encode()
    with socket.create_connection(("127.0.0.1", proc.port)) as sock:
        sock.sendall(
            b"POST /v2/models/long/generate_stream HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        _read_events(sock, 3)
    left = time.monotonic()
    time.sleep(1.0)  # ten steps' time
    lines = log.read_text().splitlines()
    steps = [line for line in lines if line.startswith("step")]
    assert 3 <= len(steps) <= 5, lines  # the steps sent, and at most one in flight more
    if kind == "steps":
        assert lines[-1] == "stop"  # the runner was told
    time.sleep(0.3)
    assert log.read_text().splitlines() == lines  # and nothing ran since
    assert time.monotonic() - left < 3
    metrics = proc.request("GET", "/metrics")[2].decode()
    assert 'plugserve_streams_in_flight{route="long"} 0.0' in metrics
    assert 'plugserve_time_to_first_token_seconds_count{route="long"} 1.0' in metrics


@pytest.mark.workers(1, 2)
def test_a_stream_longer_than_the_drain_ends_with_an_error_event_at_shutdown(
    plugins_dir: Path, tmp_path: Path, server: Callable[..., ServerProcess]
) -> None:
    """Attack round after issue 16: at SIGTERM, a stream still running when the drain ran
    out was cut without a last event (the openai client raised APIConnectionError)."""
    write_streaming_runner(plugins_dir, "long", "steps", config="step_s = 0.1\n")
    config = tmp_path / "plugserve.toml"
    config.write_text("drain_timeout_s = 1\n")
    proc = server("--plugins-dir", str(plugins_dir), "--config", str(config))
    body = json.dumps({"n": [1000]}).encode()
    with socket.create_connection(("127.0.0.1", proc.port)) as sock:
        sock.sendall(
            b"POST /v2/models/long/generate_stream HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        seen = _read_events(sock, 2)
        proc.proc.send_signal(signal.SIGTERM)
        sock.settimeout(10)
        while chunk := sock.recv(65536):
            seen += chunk
    last = seen.rsplit(b"data: ", 1)[1]
    assert b"the server is shutting down" in last, seen[-500:]
    assert proc.proc.wait(10) == 0


def test_streams_waiting_for_a_place_are_queued_in_the_metrics(
    plugins_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """Attack round after issue 16: streams waiting for a place (max_streams) were not in
    plugserve_queued."""
    write_streaming_runner(plugins_dir, "one", "steps", runner="max_streams = 1\n",
                           config="step_s = 0.05\n")  # fmt: skip
    proc = server("--plugins-dir", str(plugins_dir))
    body = json.dumps({"n": [1000]}).encode()
    request = (
        b"POST /v2/models/one/generate_stream HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with socket.create_connection(("127.0.0.1", proc.port)) as first:
        first.sendall(request)
        _read_events(first, 1)
        with socket.create_connection(("127.0.0.1", proc.port)) as second:
            second.sendall(request)
            one = {"name": "one", "type": "runner", "version": "1.0.0"}
            until(lambda: metric(proc, "plugserve_queued", **one) == 1, 5, "the second queued")
    # both gone: the waiting one left the queue
    until(lambda: metric(proc, "plugserve_queued", **one) == 0, 5, "the queue empty again")
