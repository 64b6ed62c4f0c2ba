"""The built-in ONNX Runtime backend on real models written by the onnx package."""

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from onnx import TensorProto, helper

from plugserve.registry.backends.onnxruntime import OnnxRuntimeRunner, create_runner
from plugserve.registry.backends.refusals import ort_refusal, trimmed
from plugserve.registry.errors import InvalidInput, PluginLoadError
from plugserve.registry.types import PluginInfo
from tests.helpers import ONNX_TYPES, _save, add_model, identity_model


def info(tmp_path: Path) -> PluginInfo:
    return PluginInfo("m", "1.0.0", "runner", tmp_path, structlog.get_logger())


def runner(tmp_path: Path, model: Path, **table: Any) -> OnnxRuntimeRunner:
    return create_runner(info(tmp_path), table, model)


ALL_TYPES = ONNX_TYPES
V2 = {
    "bool": "BOOL", "u8": "UINT8", "u16": "UINT16", "u32": "UINT32", "u64": "UINT64",
    "i8": "INT8", "i16": "INT16", "i32": "INT32", "i64": "INT64", "f16": "FP16", "f32": "FP32",
    "f64": "FP64", "str": "BYTES",
}  # fmt: skip


def test_every_onnx_type_maps_to_its_v2_datatype_and_runs(tmp_path: Path) -> None:
    r = runner(tmp_path, identity_model(tmp_path / "id.onnx", ALL_TYPES))
    meta = r.metadata()
    assert {i["name"]: i["datatype"] for i in meta["inputs"]} == {
        f"in_{k}": v for k, v in V2.items()
    }
    assert {o["name"]: o["datatype"] for o in meta["outputs"]} == {
        f"out_{k}": v for k, v in V2.items()
    }
    from plugserve.registry.tensors.datatypes import numpy_dtype

    inputs = {}
    for key, datatype in V2.items():
        if datatype == "BYTES":
            inputs[f"in_{key}"] = np.array([[b"a", b"b"]], dtype=object)
        else:
            inputs[f"in_{key}"] = np.ones((1, 2), dtype=numpy_dtype(datatype))
    out = r.infer(inputs)
    for key, datatype in V2.items():
        if datatype == "BYTES":
            assert out[f"out_{key}"].tolist() == [["a", "b"]]
        else:
            assert out[f"out_{key}"].dtype == numpy_dtype(datatype)
            np.testing.assert_array_equal(out[f"out_{key}"], inputs[f"in_{key}"])


def test_dynamic_and_fixed_dimensions_in_metadata(tmp_path: Path) -> None:
    dynamic = runner(tmp_path, add_model(tmp_path / "a.onnx"))
    assert dynamic.metadata()["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    fixed = runner(tmp_path, identity_model(tmp_path / "f.onnx", {"a": TensorProto.FLOAT}, [2, 3]))
    assert fixed.metadata()["inputs"] == [{"name": "in_a", "datatype": "FP32", "shape": [2, 3]}]
    with pytest.raises(InvalidInput, match=r"has shape \[1, 3\], the model takes \[2, 3\]"):
        fixed.infer({"in_a": np.zeros((1, 3), np.float32)})


def test_inputs_are_converted_within_their_kind(tmp_path: Path) -> None:
    r = runner(tmp_path, add_model(tmp_path / "a.onnx", amount=0.5))
    out = r.infer({"x": np.ones((2, 4), np.float64)})
    assert out["y"].dtype == np.float32
    np.testing.assert_allclose(out["y"], 1.5)
    out = r.infer({"x": np.ones((2, 4), np.int64)})
    np.testing.assert_allclose(out["y"], 1.5)
    with pytest.raises(InvalidInput, match="cannot be converted"):
        r.infer({"x": np.array([["a"] * 4], dtype=object)})


def test_missing_unknown_and_misshaped_inputs(tmp_path: Path) -> None:
    r = runner(tmp_path, add_model(tmp_path / "a.onnx"))
    with pytest.raises(InvalidInput, match="missing input 'x'"):
        r.infer({})
    with pytest.raises(InvalidInput, match=r"unknown input\(s\) \['z'\]"):
        r.infer({"x": np.zeros((1, 4), np.float32), "z": np.zeros(1)})
    with pytest.raises(InvalidInput, match=r"has shape \[1, 3\]"):
        r.infer({"x": np.zeros((1, 3), np.float32)})


def test_unavailable_providers_fall_back_with_a_warning(tmp_path: Path) -> None:
    r = runner(tmp_path, add_model(tmp_path / "a.onnx"), providers=["NoSuchExecutionProvider"])
    assert r.metadata()["providers"] == ["CPUExecutionProvider"]


def test_needs_a_model_and_a_valid_file(tmp_path: Path) -> None:
    with pytest.raises(PluginLoadError, match="needs \\[runner\\] model"):
        create_runner(info(tmp_path), {}, None)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    with pytest.raises(Exception, match="(?i)protobuf|invalid|load"):
        create_runner(info(tmp_path), {}, bad)


def test_session_threads_are_configurable(tmp_path: Path) -> None:
    r = runner(tmp_path, add_model(tmp_path / "a.onnx"), intra_op_threads=1, inter_op_threads=1)
    np.testing.assert_allclose(r.infer({"x": np.zeros((3, 4), np.float32)})["y"], 1.0)
    r.close()


def test_providers_fall_back_along_the_list_and_say_so(tmp_path: Path) -> None:
    r = runner(
        tmp_path,
        add_model(tmp_path / "a.onnx"),
        providers=[{"name": "NoSuchExecutionProvider", "device_id": 3}, "CPUExecutionProvider"],
    )
    meta = r.metadata()
    assert meta["requested_providers"] == ["NoSuchExecutionProvider", "CPUExecutionProvider"]
    assert meta["providers"] == ["CPUExecutionProvider"]
    assert meta["device"] == "cpu"


def test_a_required_provider_that_is_missing_fails_the_load(tmp_path: Path) -> None:
    with pytest.raises(
        PluginLoadError, match="NoSuchExecutionProvider is required but not available"
    ):
        runner(
            tmp_path,
            add_model(tmp_path / "a.onnx"),
            providers=["NoSuchExecutionProvider"],
            require=True,
        )


def test_a_required_provider_the_session_falls_back_from_fails_the_load(tmp_path: Path) -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this ONNX Runtime build has no CUDA provider")
    model = add_model(tmp_path / "a.onnx")
    plain = runner(tmp_path, model, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    if plain.metadata()["providers"][0] == "CUDAExecutionProvider":
        pytest.skip("a GPU is present: CUDA really serves here")
    assert plain.metadata()["device"] == "cpu"  # fell back, and says so
    with pytest.raises(
        PluginLoadError, match="CUDAExecutionProvider is required but the session fell back"
    ):
        runner(
            tmp_path,
            model,
            providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
            require=True,
        )


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"providers": [7]}, r"runner.providers\[0\]: must be a provider name"),
        ({"graph_optimization_level": "max"}, "graph_optimization_level: must be one of"),
        ({"require": "yes"}, "require: must be true or false"),
        (
            {"providers": [{"name": "CUDAExecutionProvider", "enable_cuda_graph": True}]},
            r"providers\[0\].enable_cuda_graph: CUDA graphs need inputs and outputs kept at fixed",
        ),
        ({"intra_op_threads": -1}, "intra_op_threads: must be an integer"),
        ({"warmup": {"runs": 0}}, "runs and batch_size must be integers >= 1"),
        (
            {"warmup": {"inputs": {"x": {"shape": [1, 4], "datatype": "FP99"}}}},
            "datatype: must be one of",
        ),
        ({"session_config": "x"}, "session_config: must be a table"),
    ],
)
def test_invalid_backend_options_name_the_field(
    tmp_path: Path, table: dict[str, Any], message: str
) -> None:
    with pytest.raises(PluginLoadError, match=message):
        runner(tmp_path, add_model(tmp_path / "a.onnx"), **table)


def test_graph_optimization_level_and_the_optimized_model_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLUGSERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = add_model(tmp_path / "a.onnx", amount=2)
    first = runner(tmp_path, model, graph_optimization_level="extended", optimized_model_cache=True)
    cached = list((tmp_path / "cache" / "onnxruntime").glob("*.onnx"))
    assert len(cached) == 1
    assert "-extended-CPU-" in cached[0].name
    second = runner(
        tmp_path, model, graph_optimization_level="extended", optimized_model_cache=True
    )
    x = {"x": np.arange(8, dtype=np.float32).reshape(2, 4)}
    np.testing.assert_array_equal(first.infer(x)["y"], second.infer(x)["y"])
    np.testing.assert_array_equal(second.infer(x)["y"], x["x"] + 2)
    assert not (tmp_path / "a.onnx.opt").exists()  # nothing written beside the model


def test_io_binding_gives_the_same_outputs_as_a_plain_run(tmp_path: Path) -> None:
    model = identity_model(tmp_path / "id.onnx", {"f": ONNX_TYPES["f32"], "i": ONNX_TYPES["i64"]})
    plain = runner(tmp_path, model)
    bound = runner(tmp_path, model, io_binding=True)
    rng = np.random.default_rng(0)
    for rows in (1, 3, 7):
        x = {"in_f": rng.standard_normal((rows, 2)).astype(np.float32),
             "in_i": rng.integers(-9, 9, (rows, 2))}  # fmt: skip
        a, b = plain.infer(x), bound.infer(x)
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype
            np.testing.assert_array_equal(a[name], b[name])


def test_warmup_runs_sample_batches_from_the_manifest(tmp_path: Path) -> None:
    model = add_model(tmp_path / "a.onnx")
    runner(tmp_path, model, warmup={"runs": 2, "batch_size": 3}).warmup()
    runner(
        tmp_path, model, warmup={"inputs": {"x": {"shape": [2, 4], "datatype": "FP64"}}}
    ).warmup()
    wrong = runner(tmp_path, model, warmup={"inputs": {"x": {"shape": [2, 5], "datatype": "FP32"}}})
    with pytest.raises(InvalidInput, match=r"has shape \[2, 5\]"):
        wrong.warmup()  # proves the sample really ran through the model


def test_explicit_device_is_reported(tmp_path: Path) -> None:
    r = runner(tmp_path, add_model(tmp_path / "a.onnx"), device="cpu:numa0")
    assert r.metadata()["device"] == "cpu:numa0"


def test_validate_refuses_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    """issue 12, finding 14: checked per request (before batching), a 400 naming the input."""
    r = runner(tmp_path, identity_model(tmp_path / "s.onnx", {"s": TensorProto.STRING}))
    r.validate({"in_s": np.array([[b"ok", "text"]], dtype=object)})
    bad = {"in_s": np.array([[b"ok", b"\xff"]], dtype=object)}
    with pytest.raises(InvalidInput, match="input 'in_s' element 1 is not UTF-8 text"):
        r.validate(bad)
    with pytest.raises(InvalidInput, match="input 'in_s' is not UTF-8 text"):
        r.infer(bad)  # called directly, without validate(): still a 400, never a 500


def test_a_conversion_that_would_change_a_value_is_refused(tmp_path: Path) -> None:
    """issue 12, finding 16: same-kind casts were silent (1e300 -> inf in FP32)."""
    r = runner(tmp_path, add_model(tmp_path / "a.onnx"))
    with pytest.raises(InvalidInput, match="does not fit FP32: outside its range"):
        r.infer({"x": np.full((1, 4), 1e300)})


def kernel_model(
    path: Path, op: str, inputs: dict[str, tuple[int, list[Any]]], **attrs: Any
) -> Path:
    """One ``op`` node over ``inputs`` (name: element type, symbolic shape), output ``y``."""
    values = [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node(op, list(inputs), ["y"], **attrs)
    return _save(helper.make_graph([node], op.lower(), values, [y]), path)


F, I64 = TensorProto.FLOAT, TensorProto.INT64
REFUSED = [  # a model whose dimensions are symbolic, the inputs it refuses, what the 400 says
    ("MatMul", {"a": (F, ["N", "K"]), "b": (F, ["M", "P"])},
     {"a": np.ones((2, 3), np.float32), "b": np.ones((2, 4), np.float32)},
     "MatMul: MatMul dimension mismatch"),
    ("Add", {"a": (F, ["A"]), "b": (F, ["B"])},
     {"a": np.ones(3, np.float32), "b": np.ones(4, np.float32)},
     "Add: Attempting to broadcast an axis by a dimension other than 1. 3 by 4"),
    ("Reshape", {"a": (F, ["A"]), "s": (I64, [2])},
     {"a": np.ones(5, np.float32), "s": np.array([2, 2])},
     "Reshape: The input tensor cannot be reshaped to the requested shape."),
    ("Gather", {"a": (F, ["A"]), "i": (I64, ["I"])},
     {"a": np.ones(5, np.float32), "i": np.array([7])},
     "Gather: indices element out of data bounds, idx=7"),
    ("GatherElements", {"a": (F, ["N", 4]), "i": (I64, ["N", 4])},
     {"a": np.ones((1, 4), np.float32), "i": np.array([[0, 1, 2, 9]])},
     "GatherElements: GatherElements op: Out of range value in index tensor"),
]  # fmt: skip


@pytest.mark.parametrize("io_binding", [False, True], ids=["run", "io_binding"])
@pytest.mark.parametrize(("op", "spec", "feed", "said"), REFUSED, ids=[r[0] for r in REFUSED])
def test_inputs_a_kernel_refuses_at_run_time_are_invalid_input(
    tmp_path: Path,
    op: str,
    spec: dict[str, Any],
    feed: dict[str, np.ndarray],
    said: str,
    io_binding: bool,
) -> None:
    """Issue 29 finding 5: ONNX Runtime's Fail or InvalidArgument from a kernel's check of its
    inputs' shapes or values was a 500 that the circuit breaker counted. It is the request's:
    InvalidInput with ONNX Runtime's message, without its source paths and functions. Also an
    index out of range (GatherElements' Fail), and through IOBinding, whose failed run is a
    plain RuntimeError (both 500s until a duplicate helper's tests found them)."""
    model_path = kernel_model(tmp_path / "model.onnx", op, spec)
    model = (
        runner(tmp_path, model_path, io_binding=True)
        if io_binding
        else runner(tmp_path, model_path)
    )
    with pytest.raises(InvalidInput) as info:
        model.infer(feed)
    message = info.value.message
    assert message.startswith(f"runner/m@1.0.0: ONNX Runtime refused the inputs: {said}"), message
    assert "onnxruntime_src" not in message and "::" not in message and ".h:" not in message


def test_onnx_runtime_errors_about_the_runner_stay_its_own(tmp_path: Path) -> None:
    """Memory, provider or session failures are not the inputs' fault: no refusal, so the
    runner's exception goes on (a 500 its breaker counts). An allocation ONNX Runtime cannot
    make is raised for real (Expand to 2^40 elements)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

    spec = {"a": (F, [1]), "s": (I64, [2])}
    model = runner(tmp_path, kernel_model(tmp_path / "model.onnx", "Expand", spec))
    with pytest.raises(ort_errors.Fail) as info:
        model.infer({"a": np.ones(1, np.float32), "s": np.array([1 << 20, 1 << 20])})
    assert ort_refusal(info.value) is None
    for error in (
        ort_errors.RuntimeException("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : CUDA failure 2"),
        ort_errors.EPFail("[ONNXRuntimeError] : 11 : EP_FAIL : TensorRT EP failed to build"),
        ort_errors.Fail("[ONNXRuntimeError] : 1 : FAIL : Load model failed"),
        ValueError("dimension mismatch"),  # the words alone, not ONNX Runtime's
    ):
        assert ort_refusal(error) is None, error
    assert len(trimmed("x" * 1000)) == 300
