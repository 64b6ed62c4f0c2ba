"""The unchanged tritonclient.grpc (sync, aio, streaming) against a real plugserve subprocess."""

from __future__ import annotations

import asyncio
import json
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from onnx import TensorProto
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from plugserve.registry.errors import DeadlineExceeded
from plugserve.server.grpc_api.service import InferenceService
from tests.helpers import ServerProcess, identity_model, metric, write_add_runner, write_plugin

pytestmark = pytest.mark.slow

SLEEPER = """
    import asyncio
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Sleeper:
        async def infer(self, inputs):
            seconds = float(np.asarray(inputs["seconds"]).reshape(-1)[0])
            if seconds < 0:
                raise RuntimeError("asked to fail")
            await asyncio.sleep(seconds)
            return {"slept": np.asarray(inputs["seconds"], dtype=np.float32)}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Sleeper()
"""

TYPES = {
    "b": (TensorProto.BOOL, "BOOL", np.bool_),
    "u8": (TensorProto.UINT8, "UINT8", np.uint8),
    "u16": (TensorProto.UINT16, "UINT16", np.uint16),
    "u32": (TensorProto.UINT32, "UINT32", np.uint32),
    "u64": (TensorProto.UINT64, "UINT64", np.uint64),
    "i8": (TensorProto.INT8, "INT8", np.int8),
    "i16": (TensorProto.INT16, "INT16", np.int16),
    "i32": (TensorProto.INT32, "INT32", np.int32),
    "i64": (TensorProto.INT64, "INT64", np.int64),
    "h": (TensorProto.FLOAT16, "FP16", np.float16),
    "f": (TensorProto.FLOAT, "FP32", np.float32),
    "d": (TensorProto.DOUBLE, "FP64", np.float64),
    "s": (TensorProto.STRING, "BYTES", np.object_),
}


def _write_plugins(plugins_dir: Path) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    write_add_runner(plugins_dir, "add", "2.0.0", amount=2)
    folder = write_plugin(
        plugins_dir,
        "runner",
        "ident",
        "1.0.0",
        '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\n',
        module=None,
    )
    identity_model(folder / "model.onnx", {k: v[0] for k, v in TYPES.items()})
    for key in ("i8", "i32", "u64", "d", "s"):  # one input each: for the typed contents
        folder = write_plugin(
            plugins_dir,
            "runner",
            f"ident_{key}",
            "1.0.0",
            '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\n',
            module=None,
        )
        identity_model(folder / "model.onnx", {key: TYPES[key][0]})
    write_plugin(
        plugins_dir,
        "runner",
        "sleeper",
        "1.0.0",
        "[runner]\ninstances = 8\n",
        {"plugin.py": SLEEPER},
    )


@pytest.fixture
def grpc_server(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> ServerProcess:
    _write_plugins(plugins_dir)
    return server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))


@pytest.fixture
def triton(grpc_server: ServerProcess) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(url=grpc_server.grpc_url)
    yield client
    client.close()


def _input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    inp = grpcclient.InferInput(name, list(array.shape), datatype)
    inp.set_data_from_numpy(array)
    return inp


def _x(rows: int = 2) -> np.ndarray:
    return np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)


@pytest.mark.workers(1, 2)
def test_health_metadata_and_inference(triton: grpcclient.InferenceServerClient) -> None:
    assert triton.is_server_live()
    assert triton.is_server_ready()
    assert triton.is_model_ready("add")
    assert triton.is_model_ready("add", model_version="1.0.0")
    assert not triton.is_model_ready("add", model_version="9.9.9")
    assert not triton.is_model_ready("nope")
    meta = triton.get_server_metadata(as_json=True)
    assert meta["name"] == "plugserve" and "binary_tensor_data" in meta["extensions"]
    model = triton.get_model_metadata("add", as_json=True)
    assert model["versions"] == ["2.0.0", "1.0.0"]
    assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "4"]}]
    result = triton.infer("add", [_input("x", _x(), "FP32")], request_id="req-1")
    np.testing.assert_array_equal(result.as_numpy("y"), _x() + 2)
    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == ("req-1", "add", "2.0.0")
    pinned = triton.infer("add", [_input("x", _x(), "FP32")], model_version="1.0.0")
    np.testing.assert_array_equal(pinned.as_numpy("y"), _x() + 1)


def test_every_datatype_round_trips(triton: grpcclient.InferenceServerClient) -> None:
    rng = np.random.default_rng(7)
    inputs, expected = [], {}
    for key, (_, datatype, dtype) in TYPES.items():
        if datatype == "BYTES":
            array = np.array([[b"alpha", b"\xce\xb2"], [b"", b"\x00d"]], dtype=object)
        elif datatype == "BOOL":
            array = rng.integers(0, 2, (2, 2)).astype(bool)
        elif np.dtype(dtype).kind in "iu":
            info = np.iinfo(dtype)
            array = np.array([[info.min, info.max], [0, 1]], dtype=dtype)
        else:
            array = rng.standard_normal((2, 2)).astype(dtype)
        inputs.append(_input(f"in_{key}", array, datatype))
        expected[f"out_{key}"] = array
    outputs = [grpcclient.InferRequestedOutput(name) for name in expected]
    result = triton.infer("ident", inputs, outputs=outputs)
    for name, array in expected.items():
        got = result.as_numpy(name)
        assert got.dtype == array.dtype, name
        assert got.tolist() == array.tolist(), name


def test_typed_contents_are_read_and_checked(grpc_server: ServerProcess) -> None:
    """``contents`` instead of ``raw_input_contents``: what non-Python clients often send."""
    with grpc.insecure_channel(grpc_server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        def infer(datatype: str, field: str, values: list[Any], shape: list[int]) -> Any:
            request = service_pb2.ModelInferRequest(model_name=f"ident_{_key(datatype)}")
            tensor = request.inputs.add(name=f"in_{_key(datatype)}", datatype=datatype, shape=shape)
            getattr(tensor.contents, field).extend(values)
            request.outputs.add(name=f"out_{_key(datatype)}")
            return stub.ModelInfer(request)

        response = infer("INT32", "int_contents", [1, -2, 3, 4], [2, 2])
        assert np.frombuffer(response.raw_output_contents[0], "<i4").tolist() == [1, -2, 3, 4]
        response = infer("FP64", "fp64_contents", [0.5, 1.5, -2.0, 3.0], [2, 2])
        assert np.frombuffer(response.raw_output_contents[0], "<f8").tolist() == [0.5, 1.5, -2, 3]
        response = infer("BYTES", "bytes_contents", [b"a", b"bc", b"", b"d"], [2, 2])
        assert response.raw_output_contents[0] == b"".join(
            len(v).to_bytes(4, "little") + v for v in (b"a", b"bc", b"", b"d")
        )
        with pytest.raises(grpc.RpcError) as info:
            infer("INT8", "int_contents", [1, 300, 3, 4], [2, 2])  # 300 is no INT8
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not fit INT8" in info.value.details()
        request = service_pb2.ModelInferRequest(model_name="ident_i32")
        tensor = request.inputs.add(name="in_i32", datatype="INT32", shape=[1, 2])
        tensor.contents.int_contents.extend([1, 2])
        request.raw_input_contents.append(np.array([1, 2], np.int32).tobytes())
        with pytest.raises(grpc.RpcError) as info:  # both: Triton's words, its examples check
            stub.ModelInfer(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == (
            "contents field must not be specified when using raw_input_contents for "
            "'in_i32' for model 'ident_i32'"
        )
        # Found by attacking it: values above 2**63 beside small ones went through float64.
        response = infer("UINT64", "uint64_contents", [5, 2**63 + 3, 2**64 - 1, 0], [2, 2])
        got = np.frombuffer(response.raw_output_contents[0], "<u8").tolist()
        assert got == [5, 2**63 + 3, 2**64 - 1, 0]
        with pytest.raises(grpc.RpcError) as info:
            infer("INT32", "int_contents", [1, 2, 3], [2, 2])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "needs 4 elements" in info.value.details()


def _key(datatype: str) -> str:
    return next(k for k, v in TYPES.items() if v[1] == datatype)


def test_errors_are_grpc_status_codes(triton: grpcclient.InferenceServerClient) -> None:
    cases: list[tuple[Callable[[], Any], str, str]] = [
        (lambda: triton.infer("nope", [_input("x", _x(), "FP32")]), "NOT_FOUND", "nope"),
        (
            lambda: triton.infer("add", [_input("x", _x(), "FP32")], model_version="9.9.9"),
            "NOT_FOUND",
            "9.9.9",
        ),
        (
            lambda: triton.infer("add", [_input("x", np.zeros((1, 3), np.float32), "FP32")]),
            "INVALID_ARGUMENT",
            "has shape [1, 3]",
        ),
        (
            lambda: triton.infer("add", [_input("x", np.zeros((1, 4), np.float64), "FP64")]),
            "INVALID_ARGUMENT",
            "input 'x' is FP32; the request sent FP64",
        ),
        (
            lambda: triton.infer("add", [_input("x", _x(), "FP32")], outputs=[
                grpcclient.InferRequestedOutput("nope")
            ]),
            "INVALID_ARGUMENT",
            "unknown output(s) ['nope']",
        ),
        (
            lambda: triton.infer("sleeper", [_input("seconds", np.array([-1.0], np.float32), "FP32")]),
            "INTERNAL",
            "asked to fail",
        ),
        (
            lambda: triton.infer("add", [_input("x", _x(), "FP32")], priority=99),
            "INVALID_ARGUMENT",
            "priority",
        ),
    ]  # fmt: skip
    for call, code, text in cases:
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == f"StatusCode.{code}", info.value
        assert text in info.value.message(), info.value
    assert triton.is_server_ready()  # nothing above hurt the server


def test_typed_contents_are_bounded_and_long_names_keep_their_code(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """Found by attacking it: 62 million typed values were made into Python objects on the
    event loop (every client waited ~10 s), and an error repeating a 20,000-character model
    name arrived as RESOURCE_EXHAUSTED (gRPC's header limit) in place of NOT_FOUND."""
    _write_plugins(plugins_dir)
    config = tmp_path / "limits.toml"
    config.write_text("max_bytes_elements = 1000\n")
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--config", str(config))  # fmt: skip
    with grpc.insecure_channel(srv.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="ident_i32")
        tensor = request.inputs.add(name="in_i32", datatype="INT32", shape=[1000, 2])
        tensor.contents.int_contents.extend(range(2000))
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "send it as raw_input_contents" in info.value.details()
        request = service_pb2.ModelInferRequest(model_name="ident_i32")
        request.inputs.add(name="in_i32", datatype="INT32", shape=[1000, 2])
        request.raw_input_contents.append(np.arange(2000, dtype=np.int32).tobytes())
        assert len(stub.ModelInfer(request).raw_output_contents[0]) == 8000  # raw: no bound
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="m" * 20000))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert len(info.value.details()) <= 4096


def test_a_tensor_over_the_limits_is_refused_before_any_allocation(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    _write_plugins(plugins_dir)
    config = tmp_path / "limits.toml"
    config.write_text("max_tensor_elements = 1000\nmax_body_bytes = 65536\n")
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--config", str(config))  # fmt: skip
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    big = np.zeros((300, 4), np.float32)  # 1200 elements, 4800 bytes
    with pytest.raises(InferenceServerException) as info:
        client.infer("add", [_input("x", big, "FP32")])
    assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "max_tensor_elements" in info.value.message()
    huge = np.zeros((100_000,), np.float32)  # 400 KB message against 64 KiB
    with pytest.raises(InferenceServerException) as info:
        client.infer("sleeper", [_input("seconds", huge, "FP32")])
    assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert client.is_server_ready()


def test_deadline_from_the_client_timeout_and_the_parameter(
    triton: grpcclient.InferenceServerClient, grpc_server: ServerProcess
) -> None:
    one_second = [_input("seconds", np.array([1.0], np.float32), "FP32")]
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as info:
        triton.infer("sleeper", one_second, client_timeout=0.3)
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert time.monotonic() - started < 0.9
    with pytest.raises(InferenceServerException) as info:
        triton.infer("sleeper", one_second, timeout=200_000)  # µs, as Triton's parameter
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "deadline of 0.2 s" in info.value.message()
    fine = triton.infer("sleeper", [_input("seconds", np.array([0.01], np.float32), "FP32")])
    np.testing.assert_array_equal(fine.as_numpy("slept"), np.array([0.01], np.float32))


class EndingContext:
    """The parts of ``grpc.aio.ServicerContext`` that ``InferenceService._answer`` uses. A
    stand-in: the race it stands for (gRPC's core ending a call at its deadline just as the
    server's own timer for that deadline fires) happened 10 times in 15,000 expiries of an
    attack, and cannot be brought about on purpose through a real call."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining
        self.aborted: list[grpc.StatusCode] = []

    def time_remaining(self) -> float | None:
        return self.remaining

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted.append(code)
        raise grpc.aio.AbortError()


async def test_a_call_its_grpc_deadline_ended_is_not_aborted_again() -> None:
    """An abort racing gRPC's own end of the call failed in gRPC's core, which logged an
    ``ExecuteBatchError`` traceback for each (the client saw DEADLINE_EXCEEDED either way)."""
    service = InferenceService.__new__(InferenceService)  # _answer uses none of its state

    async def late() -> None:
        raise DeadlineExceeded("the request's deadline of 0.01 s passed")

    ended = EndingContext(remaining=-0.0005)
    with pytest.raises(asyncio.CancelledError):
        await service._answer(ended, "ModelInfer", late)
    assert ended.aborted == []
    for remaining in (5.0, None):  # a deadline of its own (``timeout``), or no gRPC deadline
        live = EndingContext(remaining)
        with pytest.raises(grpc.aio.AbortError):
            await service._answer(live, "ModelInfer", late)
        assert live.aborted == [grpc.StatusCode.DEADLINE_EXCEEDED]


def test_streaming_answers_each_request_and_an_error_does_not_end_the_stream(
    triton: grpcclient.InferenceServerClient,
) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for k in range(4):
            triton.async_stream_infer("add", [_input("x", _x() + k, "FP32")], request_id=f"r{k}")
        triton.async_stream_infer("nope", [_input("x", _x(), "FP32")], request_id="bad")
        triton.async_stream_infer("add", [_input("x", _x(), "FP32")], request_id="after")
        got = [answers.get(timeout=15) for _ in range(6)]
    finally:
        triton.stop_stream()
    ok = {r.get_response().id: r for r, e in got if e is None}
    assert sorted(ok) == ["after", "r0", "r1", "r2", "r3"]
    for k in range(4):
        np.testing.assert_array_equal(ok[f"r{k}"].as_numpy("y"), _x() + k + 2)
    errors = [e for _, e in got if e is not None]
    assert len(errors) == 1 and "nope" in errors[0].message()


def test_a_stream_runs_its_requests_together(triton: grpcclient.InferenceServerClient) -> None:
    """Eight requests of 0.5 s sent on one stream finish in about 0.5 s, not 4 s."""
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    triton.start_stream(callback=lambda result, error: answers.put((result, error)))
    half = [_input("seconds", np.array([0.5], np.float32), "FP32")]
    started = time.monotonic()
    try:
        for k in range(8):
            triton.async_stream_infer("sleeper", half, request_id=str(k))
        got = [answers.get(timeout=15) for _ in range(8)]
    finally:
        triton.stop_stream()
    assert all(e is None for _, e in got)
    assert time.monotonic() - started < 2.5


def test_aio_client_and_its_stream(grpc_server: ServerProcess) -> None:
    async def main() -> None:
        client = aioclient.InferenceServerClient(grpc_server.grpc_url)
        try:
            assert await client.is_server_ready()
            inp = aioclient.InferInput("x", [2, 4], "FP32")
            inp.set_data_from_numpy(_x())
            results = await asyncio.gather(*(client.infer("add", [inp]) for _ in range(16)))
            for result in results:
                np.testing.assert_array_equal(result.as_numpy("y"), _x() + 2)

            async def requests() -> AsyncIterator[dict[str, Any]]:
                for k in range(5):
                    yield {"model_name": "add", "inputs": [inp], "request_id": str(k)}

            ids = []
            async for result, error in client.stream_infer(requests()):
                assert error is None
                ids.append(result.get_response().id)
                if len(ids) == 5:
                    break
            assert sorted(ids) == ["0", "1", "2", "3", "4"]
        finally:
            await client.close()

    asyncio.run(main())


@pytest.mark.workers(1, 2)
def test_statistics_and_metrics_count_grpc_requests(
    triton: grpcclient.InferenceServerClient, grpc_server: ServerProcess, workers: int
) -> None:
    # New channels: with two workers the connections spread over both.
    for _ in range(6):
        client = grpcclient.InferenceServerClient(grpc_server.grpc_url)
        client.infer("add", [_input("x", _x(), "FP32")], model_version="1.0.0")
        client.close()
    stats = triton.get_inference_statistics("add", "1.0.0", as_json=True)
    (row,) = stats["model_stats"]
    assert (row["name"], row["version"]) == ("add", "1.0.0")
    assert int(row["inference_count"]) == 12  # rows
    assert int(row["inference_stats"]["success"]["count"]) == 6
    every = triton.get_inference_statistics(as_json=True)
    assert {(r["name"], r["version"]) for r in every["model_stats"]} >= {("add", "2.0.0")}
    _, _, body = grpc_server.request("GET", "/metrics")
    assert metric(body, "plugserve_requests_total", protocol="grpc", route="add", status="200") == 6


def test_the_inference_token_guards_grpc(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    _write_plugins(plugins_dir)
    config = tmp_path / "tokens.toml"
    config.write_text('inference_token = "data-s3cret"\nadmin_token = "admin-s3cret"\n')
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--config", str(config))  # fmt: skip
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    assert client.is_server_live()  # health stays open, as over HTTP
    with pytest.raises(InferenceServerException) as info:
        client.infer("add", [_input("x", _x(), "FP32")])
    assert info.value.status() == "StatusCode.UNAUTHENTICATED"
    assert "needs 'authorization: Bearer <inference token>'" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.infer("add", [_input("x", _x(), "FP32")], headers={"authorization": "Bearer no"})
    assert info.value.status() == "StatusCode.UNAUTHENTICATED"
    assert "is not the inference token" in info.value.message()  # issue 17: not "needs"
    for token in ("data-s3cret", "admin-s3cret"):
        result = client.infer(
            "add", [_input("x", _x(), "FP32")], headers={"authorization": f"Bearer {token}"}
        )
        np.testing.assert_array_equal(result.as_numpy("y"), _x() + 2)
    assert "s3cret" not in srv.log()


def test_sigterm_drains_an_in_flight_grpc_request(grpc_server: ServerProcess) -> None:
    client = grpcclient.InferenceServerClient(grpc_server.grpc_url)
    done: dict[str, Any] = {}

    def slow() -> None:
        try:
            result = client.infer(
                "sleeper", [_input("seconds", np.array([1.0], np.float32), "FP32")]
            )
            done["slept"] = result.as_numpy("slept").tolist()
        except InferenceServerException as exc:
            done["error"] = exc

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.3)
    grpc_server.proc.send_signal(signal.SIGTERM)
    thread.join(10)
    assert done == {"slept": [1.0]}
    assert grpc_server.proc.wait(15) == 0


@pytest.mark.workers(1, 2)
def test_a_grpc_port_in_use_stops_the_start_with_a_message(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                     "--grpc-port", str(port), ready=False)  # fmt: skip
        assert srv.proc.wait(30) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in srv.log()


def test_the_committed_generated_code_is_what_the_protos_give(tmp_path: Path) -> None:
    """server/grpc_api/generated is protoc's output for server/grpc_api/protos, unedited."""
    from plugserve.server.grpc_api import generate

    fresh = {p.name: p.read_text() for p in generate.generate(tmp_path)}
    committed = {
        p.name: p.read_text()
        for p in generate.GENERATED.iterdir()
        if p.suffix in (".py", ".pyi") and p.name != "__init__.py"
    }
    assert fresh.keys() == committed.keys()
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"run python -m plugserve.server.grpc_api.generate: {stale} differ"


def test_grpc_port_zero_turns_it_off(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    _write_plugins(plugins_dir)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--grpc-port", "0")  # fmt: skip
    assert "grpc_serving" not in srv.log()
    assert json.loads(srv.request("GET", "/v2/health/ready")[2])["ready"] is True


def test_the_response_cache_answers_grpc_and_counts_in_its_statistics(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_add_runner(plugins_dir, "cached", "1.0.0", amount=3, runner="response_cache = true")
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    for _ in range(3):
        result = client.infer("cached", [_input("x", _x(), "FP32")])
        np.testing.assert_array_equal(result.as_numpy("y"), _x() + 3)
    client.infer("cached", [_input("x", _x() + 1, "FP32")])  # another input: a miss
    (row,) = client.get_inference_statistics("cached", as_json=True)["model_stats"]
    stats = row["inference_stats"]
    assert int(stats["cache_hit"]["count"]) == 2
    assert int(stats["cache_miss"]["count"]) == 2
    assert int(row["execution_count"]) == 2


def test_model_config_and_classification(triton: grpcclient.InferenceServerClient) -> None:
    config = triton.get_model_config("add", as_json=True)["config"]
    assert (config["name"], config["platform"]) == ("add", "onnxruntime_onnx")
    assert [(i["name"], i["data_type"]) for i in config["input"]] == [("x", "TYPE_FP32")]
    assert triton.get_model_config("add", "1.0.0", as_json=True)["config"]["name"] == "add"
    with pytest.raises(InferenceServerException) as info:
        triton.get_model_config("nope")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert "Request for unknown model: 'nope' is not found" in info.value.message()
    x = np.array([[0.5, 3.0, -1.0, 2.0]], np.float32)
    result = triton.infer(
        "add", [_input("x", x, "FP32")], outputs=[grpcclient.InferRequestedOutput("y", 2)]
    )
    top = result.as_numpy("y").reshape(-1).tolist()
    assert top == [b"5.000000:1", b"4.000000:3"]  # x + 2, the two largest with their index


@pytest.mark.workers(1, 2)
def test_repository_index_unload_and_load_over_grpc(
    triton: grpcclient.InferenceServerClient,
) -> None:
    index = triton.get_model_repository_index(as_json=True)["models"]
    assert {(m["name"], m["version"], m["state"]) for m in index} >= {
        ("add", "1.0.0", "READY"),
        ("add", "2.0.0", "READY"),
    }
    triton.unload_model("add")
    assert not triton.is_model_ready("add")
    with pytest.raises(InferenceServerException):
        triton.infer("add", [_input("x", _x(), "FP32")])
    triton.load_model("add")
    assert triton.is_model_ready("add")
    np.testing.assert_array_equal(
        triton.infer("add", [_input("x", _x(), "FP32")]).as_numpy("y"), _x() + 2
    )
    triton.load_model("add", config=json.dumps({"max_batch_size": 4}))
    assert triton.get_model_config("add", as_json=True)["config"]["max_batch_size"] == 4
    with pytest.raises(InferenceServerException) as info:
        triton.load_model("nope")
    assert "failed to load 'nope'" in info.value.message()
    # A file override, as Triton's model-control example sends one: Triton's code and words.
    with pytest.raises(InferenceServerException) as info:
        triton.load_model("add", config="{}", files={"file:" + "A" * 256: b"a"})
    assert info.value.status() == "StatusCode.INTERNAL"
    assert "failed to poll from model repository" in info.value.message()
    assert triton.is_server_live() and triton.is_model_ready("add")


def test_repository_calls_over_grpc_follow_the_admin_rules(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    _write_plugins(plugins_dir)
    config = tmp_path / "tokens.toml"
    config.write_text('inference_token = "data-s3cret"\nadmin_token = "admin-s3cret"\n')
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--config", str(config))  # fmt: skip
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    for headers in (None, {"authorization": "Bearer data-s3cret"}):
        with pytest.raises(InferenceServerException) as info:
            client.unload_model("add", headers=headers)
        assert info.value.status() == "StatusCode.UNAUTHENTICATED"
    assert client.is_model_ready("add", headers={"authorization": "Bearer data-s3cret"})
    client.unload_model("add", headers={"authorization": "Bearer admin-s3cret"})
    assert not client.is_model_ready("add", headers={"authorization": "Bearer data-s3cret"})


def test_a_version_that_is_no_version_answers_tritons_words(
    triton: grpcclient.InferenceServerClient,
) -> None:
    """Triton's explicit-content examples look for these words to PASS."""
    with pytest.raises(InferenceServerException) as info:
        triton.infer("add", [_input("x", _x(), "FP32")], model_version="wrong_specification")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert (
        "failed to get model version from specified version string 'wrong_specification'"
        in info.value.message()
    )
    with pytest.raises(InferenceServerException) as info:  # a version, just not installed
        triton.infer("add", [_input("x", _x(), "FP32")], model_version="9.9.9")
    assert "failed to get" not in info.value.message()


def test_grpc_health_check(grpc_server: ServerProcess) -> None:
    from plugserve.server.grpc_api.generated import health_pb2

    with grpc.insecure_channel(grpc_server.grpc_url) as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        for service in ("", "inference.GRPCInferenceService"):
            answer = check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:  # the health protocol's answer
            check(health_pb2.HealthCheckRequest(service="nope"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_request_that_does_not_parse_is_invalid_and_leaves_no_traceback(
    grpc_server: ServerProcess,
) -> None:
    """Found by attacking it: bytes that are no ModelInferRequest ended UNKNOWN and logged a
    traceback each, before the token was checked."""
    with grpc.insecure_channel(grpc_server.grpc_url) as channel:
        raw = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda x: x
        )
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                raw(b"\xff\xff\xff\xff")
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid ModelInferRequest message" in info.value.details()
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer", request_serializer=lambda x: x
        )
        with pytest.raises(grpc.RpcError) as info:
            list(stream(iter([b"\xff\xff\xff\xff"])))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch", request_serializer=lambda x: x)
        with pytest.raises(grpc.RpcError) as info:
            list(watch(b""))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "Traceback" not in grpc_server.log()
