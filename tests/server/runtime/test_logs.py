"""Logging never stops or breaks serving, and never holds request data."""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog

from plugserve.server.runtime.logs import configure_logging
from plugserve.server.runtime.stdio import SafeStream
from tests.helpers import (
    ROOT,
    ServerProcess,
    free_ports,
    wait_until_ok,
    write_plugin,
)

RUNNER = """
    import numpy as np
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Runner:
        def infer(self, inputs):
            api_key = "sekrit-local-4242"
            if "token" in inputs:
                raise ValueError("cannot handle this input")
            print("PRINTED BY THE PLUGIN")
            return {"y": np.asarray(inputs["x"])}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Runner()
"""


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    configure_logging("console", "warning")


def _write_runner(plugins_dir: Path) -> None:
    write_plugin(plugins_dir, "runner", "leaky", "1.0.0", files={"plugin.py": RUNNER})


def _call(url: str, body: dict[str, object] | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_closed_pipe_is_swallowed_and_what_follows_goes_nowhere() -> None:
    """issue 12, finding 5: writing a log line to a pipe whose reader has gone raised
    BrokenPipeError in request handlers and signal handlers."""
    read_end, write_end = os.pipe()
    stream = SafeStream(io.TextIOWrapper(os.fdopen(write_end, "wb", 0), write_through=True))
    stream.write("seen\n")
    assert os.read(read_end, 100) == b"seen\n"
    os.close(read_end)
    stream.write("lost\n")  # EPIPE: swallowed
    stream.flush()
    stream.write("lost too\n")
    assert stream.dropped >= 1
    assert os.readlink(f"/proc/self/fd/{write_end}") == os.devnull
    stream.stream.close()


def test_a_reader_that_stops_reading_costs_lines_never_a_blocked_writer() -> None:
    """Found after the fixes (issue 12, class "logging can never stop serving"): with the
    pipe full (``plugserve serve | less``, not scrolled) every log write blocked the loop."""
    read_end, write_end = os.pipe()
    stream = SafeStream(io.TextIOWrapper(os.fdopen(write_end, "wb", 0), write_through=True))
    started = time.monotonic()
    for number in range(20_000):  # 20 MB against a 64 KiB pipe nobody reads
        stream.write(f"{number:09d} {'x' * 989}\n")
    assert time.monotonic() - started < 5
    assert stream.dropped > 10_000
    received = bytearray()
    reader = threading.Thread(target=lambda: received.extend(_read_all(read_end)))
    reader.start()
    assert stream.drain(10)
    stream.stream.close()
    reader.join(10)
    numbers = [int(line[:9]) for line in received.decode().splitlines()]
    assert numbers[:3] == [0, 1, 2]
    assert numbers == sorted(numbers)  # what is written keeps its order
    assert all(len(line) == 999 for line in received.decode().splitlines())  # whole lines


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_a_log_call_never_raises(log_format: str) -> None:
    """issue 12, class "logging can never stop or break serving": a closed sink, a value that
    cannot be rendered."""

    class Unprintable:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

        __str__ = __repr__

    read_end, write_end = os.pipe()
    sink = io.TextIOWrapper(os.fdopen(write_end, "wb", 0), write_through=True)
    saved = sys.stderr
    sys.stderr = SafeStream(sink)  # type: ignore[assignment]
    try:
        configure_logging(log_format, "info")
        log = structlog.get_logger("test.never_raises")
        log.info("fine", value=1)
        log.info("odd", value=Unprintable())
        written = os.read(read_end, 10000).decode()
        assert "fine" in written
        assert "log_line_unrenderable" in written and "odd" in written
        os.close(read_end)
        log.error("after_the_reader_left", value=2)
        try:
            raise ValueError("x")
        except ValueError:
            log.exception("with_a_traceback")
    finally:
        sys.stderr = saved
        sink.close()


def test_a_reader_that_goes_away_neither_breaks_serving_nor_holds_sigterm(
    plugins_dir: Path, models_dir: Path, tmp_path: Path
) -> None:
    """issue 12, finding 5: started as ``plugserve serve 2>&1 | head -5``, the server answered
    readiness and inference with a plain-text 500 once the reader left, and SIGTERM, even
    twice, no longer stopped it."""
    _write_runner(plugins_dir)
    config = tmp_path / "piped.toml"
    config.write_text("access_log = true\ndrain_timeout_s = 2\n")
    port, grpc_port = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "plugserve", "serve", "--port", str(port),
               "--grpc-port", str(grpc_port), "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
               "--config", str(config), "--workers", "1"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert proc.stdout is not None
    try:
        wait_until_ok(proc, url + "/v2/health/ready", 30, lambda: "")
        head = [proc.stdout.readline() for _ in range(3)]
        assert all(head)
        proc.stdout.close()  # what `head -3` does once it has its lines
        for _ in range(5):
            assert _call(url + "/v2/health/ready")[0] == 200
            assert _call(url + "/predict/leaky", {"x": [1.0]})[0] == 200
        status, body = _call(url + "/predict/leaky", {"token": ["t"]})
        assert status == 500
        assert "cannot handle this input" in json.loads(body)["error"]  # JSON: the middleware's
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert time.monotonic() - started < 2 + 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_reader_that_stops_reading_does_not_stall_the_server(
    plugins_dir: Path, models_dir: Path, tmp_path: Path
) -> None:
    """Found after the fixes (issue 12, class "logging can never stop serving"): started as
    ``plugserve serve | less`` and left unscrolled, the server stopped answering once the
    pipe was full (about 300 access-log lines)."""
    _write_runner(plugins_dir)
    config = tmp_path / "stalled.toml"
    config.write_text("access_log = true\ndrain_timeout_s = 2\n")
    port, grpc_port = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "plugserve", "serve", "--port", str(port),
               "--grpc-port", str(grpc_port), "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
               "--config", str(config), "--workers", "1"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until_ok(proc, url + "/v2/health/ready", 30, lambda: "")
        for _ in range(1500):  # ~250 KB of access log against a 64 KiB pipe nobody reads
            assert _call(url + "/v2/health/ready")[0] == 200
        assert _call(url + "/predict/leaky", {"x": [1.0]})[0] == 200
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert time.monotonic() - started < 2 + 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.workers(1, 2)
@pytest.mark.parametrize("log_format", ["console", "json"])
def test_tracebacks_in_the_log_show_no_local_variables(
    plugins_dir: Path,
    models_dir: Path,
    server: Callable[..., ServerProcess],
    log_format: str,
) -> None:
    """issue 12, finding 10: console tracebacks printed local variables (rich's show_locals),
    request bodies included. rich is installed here, as with the test extras."""
    pytest.importorskip("rich")
    _write_runner(plugins_dir)
    srv = server(
        "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
        "--log-format", log_format,
    )  # fmt: skip
    status, _, _ = srv.request("POST", "/predict/leaky", {"token": ["sekrit-body-7777"]})
    assert status == 500
    srv.stop()
    log = srv.log()
    assert "plugin_raised" in log
    assert "Traceback" in log and "cannot handle this input" in log
    assert "sekrit-local-4242" not in log
    assert "sekrit-body-7777" not in log


@pytest.mark.workers(1, 2)  # it reads every line as JSON
def test_refusals_log_below_error_and_plugin_failures_at_error(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """issue 12, finding 18: every 503 during an unload was logged at error level; only
    server faults (500) are errors."""
    _write_runner(plugins_dir)
    srv = server(
        "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
        "--log-format", "json", "--log-level", "debug",
    )  # fmt: skip
    assert srv.request("POST", "/predict/leaky", {"token": ["t"]})[0] == 500
    assert srv.request("POST", "/admin/plugins/runner/leaky/1.0.0/unload")[0] == 200
    for _ in range(3):
        assert srv.request("POST", "/predict/leaky", {"x": [1.0]})[0] == 503
    srv.stop()
    events = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
    refused = [e for e in events if e.get("event") == "request_failed" and e["status"] == 503]
    assert len(refused) == 3
    assert {e["level"] for e in refused} == {"debug"}
    raised = [e for e in events if e.get("event") == "plugin_raised"]
    assert [e["level"] for e in raised] == ["error"]


@pytest.mark.workers(1, 2)
def test_a_request_that_is_not_valid_http_leaves_no_traceback_nor_its_bytes_in_the_log(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """Attack round after issue 12: aiohttp's parser logged every malformed request at error
    level with a traceback quoting the offending header line, so an unauthenticated client
    could fill the log, and an Authorization header with a stray control byte put its
    token there."""
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    bad = [
        b"GET /v2 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekrit-token-4242\x01\r\n\r\n",
        b"POST /v2 HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nsekrit-chunk\r\n",
        b"GET /v2 HTTP/1.1\r\nHost: x\r\nContent-Length: -4242\r\n\r\n",
    ]
    for raw in bad:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
            sock.sendall(raw)
            assert sock.recv(4096).startswith(b"HTTP/1.0 400 "), raw
    assert srv.request("GET", "/v2")[0] == 200  # still serving
    log = srv.log()
    assert "Traceback" not in log
    assert "sekrit" not in log and "4242" not in log


@pytest.mark.workers(1, 2)
def test_every_json_log_line_parses_while_every_process_logs_at_once(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """One JSON object a line, whichever process wrote it (an access line a request here)."""
    config = tmp_path / "access.toml"
    config.write_text("access_log = true\n")
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--log-format", "json", "--config", str(config))  # fmt: skip

    def calls() -> None:
        for _ in range(300):
            assert _call(srv.url + "/v2/health/live")[0] == 200

    threads = [threading.Thread(target=calls) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    srv.stop()
    lines = [line for line in srv.log().splitlines() if line.startswith("{")]
    broken = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            broken.append(line)
    assert broken == [], f"{len(broken)} of {len(lines)} lines: {broken[0][:400]}"
    assert sum('"path": "/v2/health/live"' in line for line in lines) == 2400
