"""What careless or hostile clients of the ``/v1`` routes find (attack16): a client that stops
reading, streams that fail midway, refused bodies, long stop sequences, split characters."""

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from plugserve.server.openai_api import requests
from plugserve.server.openai_api.requests import Refused
from plugserve.server.openai_api.routes import Stops
from tests.helpers import ServerProcess, metric, write_plugin, write_streaming_runner
from tests.server.openai_api.plugins import write_openai_plugins

pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "hi"}]

# A chat runner whose tokens are bytes, and a character's bytes come in two tokens (as a
# byte-level tokenizer's do): "é" is b"\xc3\xa9", "😀" is b"\xf0\x9f\x98\x80".
SPLIT_BYTES = """
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")
    PIECES = [b"caf", b"\\xc3", b"\\xa9 ", b"\\xf0\\x9f", b"\\x98\\x80"]

    class Split:
        def metadata(self):
            return {"inputs": [{"name": "n", "datatype": "INT64", "shape": [1]}]}

        def infer(self, inputs):
            for piece in PIECES:
                yield {"text_output": np.array([piece], object)}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Split()
"""


def client(proc: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.mark.parametrize("choices", [1, 3])
def test_a_client_that_stops_reading_holds_its_runner_back(
    choices: int, plugins_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_openai_plugins(plugins_dir)
    proc = server("--plugins-dir", str(plugins_dir))
    asked = {"model": "talk", "messages": USER, "max_tokens": 1_000_000, "n": choices}
    body = json.dumps({**asked, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", proc.port))
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    try:
        # Wait until the socket's buffers are full: no more tokens reach the client.
        sent, deadline = -1.0, time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = metric(proc, "plugserve_generated_tokens_total", route="talk")
            if now == sent:
                break
            sent = now
        steps = metric(proc, "plugserve_executions_total", name="talk")
        time.sleep(2.0)
        ahead = metric(proc, "plugserve_executions_total", name="talk") - steps
        # A bounded buffer lets a few steps run ahead of the client, not thousands.
        assert ahead < 100, f"{ahead:.0f} steps ran for a client that read nothing"
    finally:
        sock.close()


def test_a_stream_that_fails_midway_is_counted_with_its_error_status(
    plugins_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_openai_plugins(plugins_dir)
    write_streaming_runner(
        plugins_dir,
        "failing",
        "generator",
        runner='[route]\nopenai = "chat"\npreprocess = ["prompt"]\n',
        config="fail_at = 3\n",
    )
    proc = server("--plugins-dir", str(plugins_dir))
    stream = client(proc).chat.completions.create(
        model="failing", messages=USER, max_tokens=6, stream=True
    )
    chunks = [next(stream)]
    with pytest.raises(openai.APIError, match="failed at step 3"):
        chunks.extend(stream)
    assert chunks  # the stream had begun: the error came as its last event
    assert metric(proc, "plugserve_requests_total", route="failing", status="500") == 1
    assert metric(proc, "plugserve_requests_total", route="failing", status="200") == 0


def test_a_refused_openai_body_is_counted(
    plugins_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_openai_plugins(plugins_dir)
    proc = server("--plugins-dir", str(plugins_dir))
    with pytest.raises(openai.BadRequestError):
        client(proc).chat.completions.create(model="talk", messages=USER, max_tokens=0)
    openai_400 = {"protocol": "openai", "status": "400"}
    assert metric(proc, "plugserve_requests_total", route="talk", **openai_400) == 1
    status, _, _ = proc.request("POST", "/v1/embeddings", b"{not json")
    assert status == 400
    assert metric(proc, "plugserve_requests_total", route="_unknown", **openai_400) == 1


def test_a_character_split_over_two_tokens_reaches_the_client_whole(
    plugins_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_openai_plugins(plugins_dir)
    write_plugin(
        plugins_dir,
        "runner",
        "split",
        "1.0.0",
        '[route]\nopenai = "chat"\npreprocess = ["prompt"]\n',
        {"plugin.py": SPLIT_BYTES},
    )
    proc = server("--plugins-dir", str(plugins_dir))
    api = client(proc)
    whole = api.chat.completions.create(model="split", messages=USER)
    assert whole.choices[0].message.content == "café 😀"
    streamed = api.chat.completions.create(model="split", messages=USER, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "café 😀"


def test_a_long_stop_sequence_is_refused_and_a_long_partial_match_costs_little() -> None:
    body = {"model": "talk", "messages": USER}
    with pytest.raises(Refused) as refused:
        requests.chat({**body, "stop": ["x", "a" * (requests.MAX_STOP_CHARS + 1)]})
    assert refused.value.param == "stop"
    stop = "a" * requests.MAX_STOP_CHARS
    assert requests.chat({**body, "stop": stop}).stop == (stop,)
    # The longest allowed, matched in part by every token and then broken: cheap each time.
    stops = Stops((stop[:-1] + "b",))
    started = time.perf_counter()
    for _ in range(1000):
        assert stops.feed("a" * (len(stop) - 1)) == ("", False)  # it may begin the stop
        assert stops.feed("c") == ("a" * (len(stop) - 1) + "c", False)
    took = time.perf_counter() - started
    assert took < 2.0, f"2000 tokens took {took:.2f} s of the event loop"
