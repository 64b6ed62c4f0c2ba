"""Streaming routes (Triton's decoupled models) over gRPC ModelStreamInfer, with tritonclient."""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.fixtures.triton_models.build import build
from tests.helpers import (
    ServerProcess,
    write_add_runner,
    write_plugin,
    write_streaming_runner,
)

pytestmark = pytest.mark.slow

KINDS = ("steps", "generator", "async")
"""The runners served, one route each, named for their kind."""


@pytest.fixture
def steps_log(tmp_path: Path) -> Path:
    return tmp_path / "steps.log"


@pytest.fixture
def streaming_server(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess], steps_log: Path
) -> ServerProcess:
    for kind in KINDS:
        config = "step_s = 0.05\n" + (f'log = "{steps_log}"\n' if kind == "steps" else "")
        runner = "max_batch_size = 4\n" if kind == "steps" else ""
        write_streaming_runner(plugins_dir, kind, kind, runner=runner, config=config)
    write_add_runner(plugins_dir, "add", "1.0.0")
    return server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))


class Stream:
    """One gRPC stream of the sync tritonclient, its answers queued as they arrive."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.answers.put((result, error)))

    def send(self, route: str, n: int, request_id: str, **options: Any) -> None:
        count = grpcclient.InferInput("n", [1], "INT64")
        count.set_data_from_numpy(np.array([n], np.int64))
        self.client.async_stream_infer(route, [count], request_id=request_id, **options)

    def take(self, count: int, timeout: float = 15) -> list[tuple[Any, Any]]:
        return [self.answers.get(timeout=timeout) for _ in range(count)]

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


@pytest.fixture
def stream(streaming_server: ServerProcess) -> Iterator[Stream]:
    opened = Stream(streaming_server.grpc_url)
    yield opened
    opened.close(cancel=True)


def _final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def _by_id(answers: list[tuple[Any, Any]]) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = {}
    for result, error in answers:
        assert error is None, error
        grouped.setdefault(result.get_response().id, []).append(result)
    return grouped


@pytest.mark.workers(1, 2)
def test_each_kind_streams_its_responses_in_order(stream: Stream) -> None:
    for kind in KINDS:
        stream.send(kind, 3, f"{kind}-final", enable_empty_final_response=True)
        only_i = [grpcclient.InferRequestedOutput("i")]
        stream.send(kind, 2, f"{kind}-plain", outputs=only_i)
    got = _by_id(stream.take(len(KINDS) * (3 + 1 + 2)))
    for kind in KINDS:
        *responses, empty = got[f"{kind}-final"]
        assert [r.as_numpy("i").tolist() for r in responses] == [[1], [2], [3]]
        assert [r.as_numpy("text_output").tolist() for r in responses] == [
            [b"t1 "],
            [b"t2 "],
            [b"t3 "],
        ]
        assert not any(_final(r) for r in responses)
        head = empty.get_response()
        assert (head.model_name, head.model_version, list(head.outputs)) == (kind, "1.0.0", [])
        assert _final(empty)
        plain = got[f"{kind}-plain"]  # no empty final response asked for: none sent
        assert [r.as_numpy("i").tolist() for r in plain] == [[1], [2]]
        assert all(r.as_numpy("text_output") is None for r in plain)  # the outputs asked for
        assert not any(_final(r) for r in plain)
    assert stream.answers.empty()


def test_a_route_that_answers_once_sends_one_final_response(stream: Stream) -> None:
    x = grpcclient.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.ones((1, 4), np.float32))
    stream.client.async_stream_infer(
        "add", [x], request_id="once", enable_empty_final_response=True
    )
    [(result, error)] = stream.take(1)
    assert error is None and _final(result)
    np.testing.assert_array_equal(result.as_numpy("y"), np.full((1, 4), 2, np.float32))
    time.sleep(0.3)
    assert stream.answers.empty()  # as Triton: no empty final response for such a model


def test_errors_answer_their_request_and_the_stream_goes_on(stream: Stream) -> None:
    stream.send("steps", -1, "refused")  # start() raises
    [(result, error)] = stream.take(1)
    assert result is None and "a negative count" in error.message()
    stream.send("steps", 1000, "late", timeout=300_000)  # µs, as Triton's parameter
    answers = []
    while True:
        result, error = stream.answers.get(timeout=15)
        if error is not None:
            break
        answers.append(result.as_numpy("i")[0])
    assert 2 <= len(answers) < 20 and answers == list(range(1, len(answers) + 1))
    assert "deadline of 0.3 s passed" in error.message()
    stream.send("generator", 2, "after")
    assert [r.as_numpy("i")[0] for r, _ in stream.take(2)] == [1, 2]


def test_two_requests_on_one_stream_interleave_and_batch(stream: Stream) -> None:
    stream.send("steps", 6, "a")
    stream.send("steps", 6, "b")
    answers = stream.take(12)
    order = [r.get_response().id for r, _ in answers]
    assert order != sorted(order)  # b's responses came before a's ended
    got = _by_id(answers)
    assert [r.as_numpy("i")[0] for r in got["a"]] == [1, 2, 3, 4, 5, 6]
    assert [r.as_numpy("i")[0] for r in got["b"]] == [1, 2, 3, 4, 5, 6]
    assert max(r.as_numpy("batch")[0] for r in got["b"]) == 2  # one step advanced both


def _steps(log: Path) -> int:
    return sum(line.startswith("step") for line in log.read_text().splitlines())


@pytest.mark.workers(1, 2)
def test_cancelling_the_stream_stops_its_runner(
    streaming_server: ServerProcess, steps_log: Path
) -> None:
    stream = Stream(streaming_server.grpc_url)
    stream.send("steps", 1000, "long")
    stream.take(3)
    stream.close(cancel=True)
    time.sleep(0.4)
    stopped_at = _steps(steps_log)
    time.sleep(0.4)
    assert _steps(steps_log) == stopped_at < 20
    assert steps_log.read_text().splitlines().count("stop") == 1


def test_grpc_deadline_of_the_stream_bounds_its_requests(
    streaming_server: ServerProcess, steps_log: Path
) -> None:
    client = grpcclient.InferenceServerClient(streaming_server.grpc_url)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(
        callback=lambda result, error: answers.put((result, error)), stream_timeout=0.5
    )
    count = grpcclient.InferInput("n", [1], "INT64")
    count.set_data_from_numpy(np.array([1000], np.int64))
    client.async_stream_infer("steps", [count], request_id="bounded")
    while (answer := answers.get(timeout=15))[1] is None:
        pass
    assert "deadline" in answer[1].message().lower()
    client.stop_stream()
    client.close()
    time.sleep(0.3)
    stopped_at = _steps(steps_log)
    time.sleep(0.3)
    assert _steps(steps_log) == stopped_at < 20
    assert "stop" in steps_log.read_text().splitlines()


def test_unary_infer_on_a_streaming_route_and_its_config(
    streaming_server: ServerProcess,
) -> None:
    client = grpcclient.InferenceServerClient(streaming_server.grpc_url)
    count = grpcclient.InferInput("n", [1], "INT64")
    count.set_data_from_numpy(np.array([3], np.int64))
    with pytest.raises(InferenceServerException) as info:
        client.infer("generator", [count])
    assert info.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    assert info.value.message().startswith(
        "ModelInfer RPC doesn't support models with decoupled transaction policy"
    )
    assert "ModelStreamInfer" in info.value.message()
    config = client.get_model_config("steps", as_json=True)["config"]
    assert config["model_transaction_policy"] == {"decoupled": True}
    assert "model_transaction_policy" not in client.get_model_config("add", as_json=True)["config"]
    client.load_model("steps", config=json.dumps(config))  # what it answered loads back
    assert client.get_model_config("steps", as_json=True)["config"] == config
    client.close()
    status, _, body = streaming_server.request("GET", "/v2/models/async/config")
    assert status == 200 and json.loads(body)["model_transaction_policy"] == {"decoupled": True}


def test_tritons_repeat_model(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """The fixture ``repeat_int32`` as Triton's repeat backend answers its example."""
    plugins, _ = build(tmp_path / "triton", runners=["repeat_int32"])
    served = server("--plugins-dir", str(plugins), "--models-dir", str(models_dir))
    client = grpcclient.InferenceServerClient(served.grpc_url)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))

    def repeat(request_id: str, values: list[int], delays: list[int], wait: int = 0) -> None:
        tensors = [
            ("IN", np.array(values, np.int32), "INT32"),
            ("DELAY", np.array(delays, np.uint32), "UINT32"),
            ("WAIT", np.array([wait], np.uint32), "UINT32"),
        ]
        inputs = []
        for name, array, datatype in tensors:
            inputs.append(grpcclient.InferInput(name, list(array.shape), datatype))
            inputs[-1].set_data_from_numpy(array)
        client.async_stream_infer(
            "repeat_int32", inputs, request_id=request_id, enable_empty_final_response=True
        )

    try:
        repeat("a", [10, 11, 12], [100, 100, 100])
        repeat("b", [20, 21, 22], [100, 100, 100])  # WAIT 0: both run at once
        repeat("none", [], [])
        repeat("odd", [1, 2], [1])
        got = [answers.get(timeout=15) for _ in range(3 + 1 + 3 + 1 + 1 + 1)]
    finally:
        client.stop_stream()
        client.close()
    errors = [e.message() for r, e in got if e is not None]
    assert errors == [
        "runner/repeat_int32@1.0.0: expected IN and DELAY shape to match, got [2] and [1]"
    ]
    by_id = _by_id([(r, e) for r, e in got if e is None])
    assert [r.get_response().outputs for r in by_id["none"]] == [[]]  # only the final one
    for request_id, first in (("a", 10), ("b", 20)):
        *responses, final = by_id[request_id]
        assert [(r.as_numpy("OUT").tolist(), r.as_numpy("IDX").tolist()) for r in responses] == [
            ([first + k], [k]) for k in range(3)
        ]
        assert responses[0].as_numpy("IDX").dtype == np.uint32 and _final(final)
    order = [r.get_response().id for r, e in got if e is None and r.get_response().outputs]
    assert order[:2] in (["a", "b"], ["b", "a"])  # intermixed: neither waited for the other


BLOBS = """
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Blobs:  # responses of 4 MiB: a client that does not read soon holds a write
        def infer(self, inputs):
            for _ in range(int(inputs["n"][0])):
                yield {"blob": np.zeros(4 << 20, np.uint8)}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Blobs()
"""


def test_a_deadline_during_a_held_write_leaves_the_stream_writable(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_plugin(plugins_dir, "runner", "blobs", "1.0.0", "", {"plugin.py": BLOBS})
    write_add_runner(plugins_dir, "add", "1.0.0")
    served = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))

    def request(route: str, request_id: str, **inputs: np.ndarray) -> Any:
        message = service_pb2.ModelInferRequest(model_name=route, id=request_id)
        for name, array in inputs.items():
            datatype = "INT64" if array.dtype == np.int64 else "FP32"
            message.inputs.add(name=name, datatype=datatype, shape=array.shape)
            message.raw_input_contents.append(array.tobytes())
        if route == "blobs":
            message.parameters["timeout"].int64_param = 300_000  # µs
        return message

    def requests() -> Iterator[Any]:
        yield request("blobs", "big", n=np.array([50], np.int64))
        time.sleep(1.0)  # past big's deadline, its write still held: nothing read yet
        yield request("add", "small", x=np.ones((1, 4), np.float32))

    options = [("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(served.grpc_url, options=options) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answers = stub.ModelStreamInfer(requests(), timeout=20)
        time.sleep(1.5)
        got = []
        for answer in answers:
            got.append((answer.infer_response.id, answer.error_message))
            if {"small", "big:error"} <= {f"{i}:error" if e else i for i, e in got}:
                break
        answers.cancel()
    assert ("small", "") in got
    assert any(i == "big" and "deadline of 0.3 s passed" in e for i, e in got)
    assert got.count(("big", "")) < 5
