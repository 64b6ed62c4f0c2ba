"""The unchanged tritonclient[http] package against a real plugserve subprocess."""

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto
from tritonclient.utils import InferenceServerException

from tests.helpers import (
    ServerProcess,
    fake_distribution,
    identity_model,
    write_add_runner,
    write_plugin,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def triton_server(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> ServerProcess:
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
    identity_model(
        folder / "model.onnx",
        {"s": TensorProto.STRING, "h": TensorProto.FLOAT16, "b": TensorProto.BOOL},
    )
    return server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))


@pytest.fixture
def triton(triton_server: ServerProcess) -> httpclient.InferenceServerClient:
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{triton_server.port}")
    yield client
    client.close()


def test_health_and_metadata(triton: httpclient.InferenceServerClient) -> None:
    assert triton.is_server_live()
    assert triton.is_server_ready()
    assert triton.is_model_ready("add")
    assert triton.is_model_ready("add", model_version="1.0.0")
    assert not triton.is_model_ready("nope")
    meta = triton.get_model_metadata("add")
    assert meta["versions"] == ["2.0.0", "1.0.0"]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert triton.get_server_metadata()["name"] == "plugserve"


@pytest.mark.parametrize("binary", [False, True])
def test_infer_json_and_binary(triton: httpclient.InferenceServerClient, binary: bool) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    inp = httpclient.InferInput("x", [2, 4], "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("y", binary_data=binary)
    result = triton.infer("add", [inp], outputs=[out], request_id="req-1")
    np.testing.assert_array_equal(result.as_numpy("y"), x + 2)
    assert result.get_response()["id"] == "req-1"
    assert result.get_response()["model_version"] == "2.0.0"
    pinned = triton.infer("add", [inp], model_version="1.0.0")
    np.testing.assert_array_equal(pinned.as_numpy("y"), x + 1)


@pytest.mark.parametrize("binary", [False, True])
def test_bytes_fp16_and_bool(triton: httpclient.InferenceServerClient, binary: bool) -> None:
    data = {
        "s": np.array([[b"alpha", b"\xce\xb2"], [b"", b"d"]], dtype=object),
        "h": np.array([[0.5, -1.25], [3.0, 65504.0]], dtype=np.float16),
        "b": np.array([[True, False], [False, True]]),
    }
    types = {"s": "BYTES", "h": "FP16", "b": "BOOL"}
    inputs = []
    for name, array in data.items():
        inp = httpclient.InferInput(f"in_{name}", list(array.shape), types[name])
        inp.set_data_from_numpy(array, binary_data=binary)
        inputs.append(inp)
    outputs = [httpclient.InferRequestedOutput(f"out_{n}", binary_data=binary) for n in data]
    result = triton.infer("ident", inputs, outputs=outputs)
    for name, array in data.items():
        got = result.as_numpy(f"out_{name}")
        if name == "s":
            # JSON carries BYTES as strings (as Triton does); binary keeps the bytes.
            want = array if binary else np.vectorize(bytes.decode, otypes=[object])(array)
            assert got.tolist() == want.tolist()
        else:
            assert got.dtype == array.dtype
            np.testing.assert_array_equal(got, array)


def test_errors_reach_the_client_with_status(triton: httpclient.InferenceServerClient) -> None:
    inp = httpclient.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
    with pytest.raises(InferenceServerException) as info:
        triton.infer("nope", [inp])
    assert info.value.status() == "404"
    assert info.value.message() == "Request for unknown model: 'nope' is not found"
    bad = httpclient.InferInput("x", [1, 3], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 3), np.float32))
    with pytest.raises(InferenceServerException) as info:
        triton.infer("add", [bad])
    assert info.value.status() == "400"
    assert "has shape [1, 3]" in info.value.message()


@pytest.mark.parametrize("binary", [False, True])
def test_a_datatype_mismatch_is_400_naming_both(
    triton: httpclient.InferenceServerClient, binary: bool
) -> None:
    """issue 12, finding 16: numpy's default FP64 sent to an FP32 input was cast silently."""
    wrong = httpclient.InferInput("x", [1, 4], "FP64")
    wrong.set_data_from_numpy(np.zeros((1, 4), np.float64), binary_data=binary)
    with pytest.raises(InferenceServerException) as info:
        triton.infer("add", [wrong])
    assert info.value.status() == "400"
    assert info.value.message() == "input 'x' is FP32; the request sent FP64"


def test_declarative_runner_on_a_backend_from_an_installed_package(
    tmp_path: Path, plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """A fake .dist-info on PYTHONPATH adds the "scaled" backend through the entry-point group."""
    site = tmp_path / "site"
    scaled = """
        import pluggy
        hookimpl = pluggy.HookimplMarker("plugserve")

        class Scaled:
            def __init__(self, factor):
                self.factor = factor
            def infer(self, inputs):
                return {"y": inputs["x"] * self.factor}

        def create(plugin, runner, model_path):
            return Scaled(runner["factor"])
        create.runner_keys = {"factor"}  # the [runner] keys this backend reads

        @hookimpl
        def plugserve_backends():
            return {"scaled": create}
    """
    fake_distribution(
        site, "plugserve_scaled", {"scaled": "plugserve_scaled"}, {"plugserve_scaled": scaled}
    )
    write_plugin(
        plugins_dir, "runner", "times", "1.0.0", '[runner]\nbackend = "scaled"\nfactor = 3\n',
        module=None,
    )  # fmt: skip
    srv = server(
        "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
        env={"PYTHONPATH": str(site)},
    )  # fmt: skip
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{srv.port}")
    inp = httpclient.InferInput("x", [2], "INT32")
    inp.set_data_from_numpy(np.array([1, 2], np.int32))
    assert client.infer("times", [inp]).as_numpy("y").tolist() == [3, 6]
    client.close()


@pytest.mark.workers(1, 2)
def test_tritonclient_reads_the_statistics_extension(
    triton: httpclient.InferenceServerClient,
) -> None:
    x = np.zeros((3, 4), np.float32)
    inp = httpclient.InferInput("x", [3, 4], "FP32")
    inp.set_data_from_numpy(x)
    for _ in range(5):
        triton.infer("add", [inp])
    stats = triton.get_inference_statistics("add")["model_stats"]
    latest = next(s for s in stats if s["version"] == "2.0.0")
    assert latest["name"] == "add"
    assert latest["inference_stats"]["success"]["count"] == 5
    assert latest["inference_count"] == 15  # rows
    assert latest["execution_count"] == 5
    assert latest["inference_stats"]["compute_infer"]["ns"] > 0
    assert latest["batch_stats"][0]["batch_size"] == 3
    everything = triton.get_inference_statistics()["model_stats"]
    assert {s["name"] for s in everything} >= {"add", "ident"}
    assert triton.get_server_metadata()["extensions"] == [
        "binary_tensor_data",
        "statistics",
        "classification",
        "model_repository",
        "model_configuration",
        "system_shared_memory",
    ]


@pytest.mark.workers(1, 2)
def test_a_canary_route_through_tritonclient_headers(
    triton: httpclient.InferenceServerClient, triton_server: ServerProcess
) -> None:
    """A weighted, sticky route set at runtime; tritonclient sends the sticky header and reads
    the version that served from the response's model_version."""
    entry = {"runner": {"add@1.0.0": 50, "add@2.0.0": 50}, "sticky": "x-user-id"}
    assert triton_server.request("PUT", "/admin/routes/add", entry)[0] == 200
    x = httpclient.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.zeros((1, 4), np.float32), binary_data=True)
    served = {}
    for i in range(60):
        result = triton.infer("add", [x], headers={"X-User-ID": f"user-{i}"})
        version = result.get_response()["model_version"]
        assert float(result.as_numpy("y")[0, 0]) == float(version[0])  # what ran is what it says
        served[f"user-{i}"] = version
    assert set(served.values()) == {"1.0.0", "2.0.0"}
    for user, version in list(served.items())[:10]:
        again = triton.infer("add", [x], headers={"X-User-ID": user}).get_response()[
            "model_version"
        ]
        assert again == version


def test_integer_model_versions_select_the_highest_release_of_that_major(
    triton: httpclient.InferenceServerClient,
) -> None:
    """Triton's clients name versions by integers: "1" serves add@1.0.0, "2" add@2.0.0."""
    inp = httpclient.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.float32), binary_data=True)
    for version in ("1", "2"):
        result = triton.infer("add", [inp], model_version=version)
        assert result.get_response()["model_version"] == f"{version}.0.0"
        assert float(result.as_numpy("y")[0, 0]) == float(version)
        assert triton.is_model_ready("add", model_version=version)
        meta = triton.get_model_metadata("add", model_version=version)
        assert meta["name"] == "add"
        stats = triton.get_inference_statistics("add", model_version=version)["model_stats"]
        assert [(s["version"], s["inference_count"]) for s in stats] == [(f"{version}.0.0", 1)]
    assert not triton.is_model_ready("add", model_version="7")
    with pytest.raises(InferenceServerException) as info:
        triton.infer("add", [inp], model_version="7")
    assert info.value.status() == "404"
    assert info.value.message() == "route 'add' has no runner version '7'"
