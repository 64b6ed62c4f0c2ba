"""One request never breaks an isolated runner's link for the requests beside it.

Each worker has one connection to each runner process; every request it sends there
shares it. A request whose frame cannot be sent or read (a name of megabytes, an answer
too large for a frame) fails alone: the others on the connection are answered, and the
runner process goes on (the same pid). End to end with real processes and real clients.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.helpers import ServerProcess, until, write_plugin

pytestmark = pytest.mark.slow

HUGE = 12 * 1024 * 1024
"""Characters of a name: as JSON (``\\u0001`` each), 72 MiB, over a frame's 64 MiB."""

SLOW = """
    import asyncio
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Slow:
        async def infer(self, inputs):
            x = inputs["x"]
            await asyncio.sleep(float(x[0, 0]))  # x[:, 0]: seconds; x[:, 1]: what to do
            if float(x[0, 1]) == 1:  # an output whose name no frame can carry
                return {"\\x01" * HUGE: x}
            outputs = {"y": x}
            if "text" in inputs:  # BYTES elements: how long each arrived
                lengths = [len(t) for t in inputs["text"].reshape(-1)]
                outputs["length"] = np.array(lengths, np.int64).reshape(x.shape[0], -1)
            return outputs

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Slow()
""".replace("HUGE", str(HUGE))

RENAME = """
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Rename:  # runs in the worker: the name reaches the wire without any decoder
        def process(self, data, ctx):
            x = data.get("x")
            if x is not None and float(x[0, 1]) == 2:
                return {"\\x01" * HUGE: x}
            return data

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Rename()
""".replace("HUGE", str(HUGE))


def slow_server(server: Callable[..., ServerProcess], tmp_path: Path) -> ServerProcess:
    """Route ``slow``: the worker's ``rename`` preprocessor, then the isolated ``slow``
    runner (one process, one connection from the worker); bodies up to 128 MiB."""
    plugins = tmp_path / "plugins"
    write_plugin(plugins, "preprocessor", "rename", "1.0.0", "", {"plugin.py": RENAME})
    manifest = '[runner]\nisolation = "process"\nmax_batch_size = 8\n'
    manifest += '[route]\npreprocess = ["rename"]\n'
    write_plugin(plugins, "runner", "slow", "1.0.0", manifest, {"plugin.py": SLOW})
    config = tmp_path / "plugserve.toml"
    config.write_text(
        f"max_body_bytes = {128 * 1024 * 1024}\nmax_json_bytes = {128 * 1024 * 1024}\n"
    )
    return server("--plugins-dir", str(plugins), "--models-dir", str(tmp_path / "models"),
                  "--config", str(config))  # fmt: skip


def slow_row(srv: ServerProcess) -> dict[str, Any]:
    _, _, raw = srv.request("GET", "/admin/plugins")
    return next(p for p in json.loads(raw)["plugins"] if p["name"] == "slow")


def http(srv: ServerProcess, seconds: float, action: float = 0, **extra: Any) -> tuple[int, Any]:
    """v2 JSON: ``x`` = [[seconds, action]], and ``extra`` inputs as given."""
    inputs = [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [seconds, action]}]
    inputs += extra.get("inputs", [])
    code, _, raw = srv.request("POST", "/v2/models/slow/infer", {"inputs": inputs})
    return code, json.loads(raw)


def wait_in_flight(srv: ServerProcess, count: int, timeout: float = 30.0) -> None:
    """Until ``count`` requests are in the runner's stage (sent on the connection)."""
    until(lambda: slow_row(srv)["in_flight"] >= count, timeout, f"{count} requests in flight")


def beside_three(srv: ServerProcess, odd: Callable[[], Any], first: bool = False) -> Any:
    """``odd()`` while three other requests are in flight on the same connection to the
    runner process (sent after ``odd`` when ``first``: queued behind its batch there).
    Asserts the three are answered 200 and the process did not change; returns what
    ``odd()`` returned."""
    pids = slow_row(srv)["pids"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        if first:
            answer = pool.submit(odd)
            wait_in_flight(srv, 1)
            time.sleep(0.5)  # counted in flight from its preprocessor on: let it reach the runner
        others = [pool.submit(http, srv, 2.0) for _ in range(3)]
        wait_in_flight(srv, 3 + first)
        if not first:
            answer = pool.submit(odd)
        result = answer.result(timeout=120)
        codes = [(code, body.get("error")) for code, body in (f.result(60) for f in others)]
    assert codes == [(200, None)] * 3, codes
    assert slow_row(srv)["pids"] == pids  # the runner process went on
    return result


def test_a_grpc_input_name_of_megabytes_fails_alone_and_the_connection_goes_on(
    server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """Issue 29 finding 6: a gRPC ModelInfer whose input name was 11.5 M "\\x01" characters
    became a 69 MB JSON frame (each escaped as "\\u0001"), over the 64 MiB a frame may
    hold: the runner process dropped the worker's connection, and the requests in flight
    beside it failed 500 "its runner process (pid N) ended during the request", though
    nothing ended. The name is refused at decode (400, gRPC INVALID_ARGUMENT); the three
    requests beside it are answered."""
    srv = slow_server(server, tmp_path)

    def odd() -> tuple[str, str]:
        client = grpcclient.InferenceServerClient(srv.grpc_url)
        tensor = grpcclient.InferInput("\x01" * (HUGE - HUGE // 16), [1, 2], "FP32")
        tensor.set_data_from_numpy(np.array([[0.0, 0.0]], np.float32))
        try:
            client.infer("slow", [tensor], client_timeout=60)
        except InferenceServerException as exc:
            return str(exc.status()), str(exc.message())
        finally:
            client.close()
        return "OK", ""

    status, message = beside_three(srv, odd)
    assert status == "StatusCode.INVALID_ARGUMENT", message
    assert "characters; at most 1024" in message
    assert len(message) < 1000  # the name is not echoed


@pytest.mark.parametrize("attack", ["http-name", "preprocessor-name", "output-name"])
def test_a_frame_too_large_for_the_link_fails_its_request_alone(
    server: Callable[..., ServerProcess], tmp_path: Path, attack: str
) -> None:
    """Issue 29 finding 6, other ways to a frame over 64 MiB: the name through v2 HTTP
    (bodies up to 128 MiB allowed here), a name a preprocessor made in the worker (no
    decoder sees it: the worker measures the frame), and an output name the runner's
    plugin made (the runner process measures its answer). Each fails its own request with
    a clear status; the three beside it are answered, by the same runner process."""
    srv = slow_server(server, tmp_path)
    if attack == "http-name":
        name = {"name": "\x01" * HUGE, "shape": [1], "datatype": "FP32", "data": [1.0]}
        code, body = beside_three(srv, lambda: http(srv, 0.0, inputs=[name]))
        assert code == 400, body
        assert "characters; at most 1024" in body["error"]
    elif attack == "preprocessor-name":
        code, body = beside_three(srv, lambda: http(srv, 0.0, 2))
        assert code == 413, body
        assert "cannot reach the runner process" in body["error"]
        assert "at most 67108864" in body["error"]
    else:
        code, body = beside_three(srv, lambda: http(srv, 2.0, 1), first=True)
        assert code == 500, body
        assert body["plugin"] == "runner/slow@1.0.0"
        assert "FrameTooLarge" in body["error"]
    assert http(srv, 0.0)[0] == 200
    assert len(body["error"]) < 1000


def test_bytes_elements_of_control_characters_cross_the_link_as_they_are(
    server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """Variant: BYTES elements travel in the frame's raw bytes, not its JSON, so 12 MiB of
    control characters (binary v2 HTTP) cross as 12 MiB, beside three other requests."""
    srv = slow_server(server, tmp_path)
    text = b"\x01" * HUGE
    header = {
        "inputs": [
            {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [0.0, 0.0]},
            {"name": "text", "shape": [1, 1], "datatype": "BYTES",
             "parameters": {"binary_data_size": 4 + len(text)}},
        ]
    }  # fmt: skip
    head = json.dumps(header).encode()
    body = head + len(text).to_bytes(4, "little") + text

    def odd() -> tuple[int, Any]:
        code, _, raw = srv.request(
            "POST", "/v2/models/slow/infer", body,
            {"Inference-Header-Content-Length": str(len(head)),
             "Content-Type": "application/octet-stream"},
        )  # fmt: skip
        return code, json.loads(raw)

    code, answer = beside_three(srv, odd)
    assert code == 200, answer
    outputs = {o["name"]: o["data"] for o in answer["outputs"]}
    assert outputs["length"] == [HUGE]
