"""The TensorRT backend's logic, through a fake ``tensorrt`` and ``cudart`` that follow the real
API (TensorRT cannot be installed here and no GPU is attached; tests/gpu/ checks the real one)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from onnx import TensorProto

from plugserve.registry.backends import tensorrt as backend
from plugserve.registry.errors import InvalidInput, PluginLoadError
from plugserve.registry.types import PluginInfo
from tests.helpers import add_model, identity_model
from tests.registry.backends import fake_tensorrt

PROFILE = {"x": {"min": [1, 4], "opt": [4, 4], "max": [8, 4]}}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> fake_tensorrt.FakeCudart:
    monkeypatch.setenv("PLUGSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return fake_tensorrt.install(monkeypatch)[1]


def info(tmp_path: Path) -> PluginInfo:
    return PluginInfo("t", "1.0.0", "runner", tmp_path, structlog.get_logger())


def make(tmp_path: Path, model: Path, **runner: Any) -> backend.TensorRTRunner:
    return backend.create_runner(info(tmp_path), runner, model)


def test_without_tensorrt_the_load_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import fails, as on this machine
    with pytest.raises(
        PluginLoadError, match=r"needs TensorRT: pip install 'plugserve\[tensorrt\]'"
    ):
        make(tmp_path, add_model(tmp_path / "m.onnx"))


def test_importing_plugserve_never_needs_tensorrt() -> None:
    import subprocess

    code = ("import sys; sys.modules['tensorrt'] = None; import registry.backends.tensorrt, server.app; "
            "print('ok')")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_builds_from_onnx_with_the_profile_and_matches_onnxruntime(
    fake: fake_tensorrt.FakeCudart, tmp_path: Path
) -> None:
    model = add_model(tmp_path / "model.onnx", amount=3)
    runner = make(tmp_path, model, profile=PROFILE, fp16=True)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(runner.infer({"x": x})["y"], x + 3)
    assert fake_tensorrt.BUILDS == [{"fp16": True, "profile": {"x": ([1, 4], [4, 4], [8, 4])}}]
    meta = runner.metadata()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["device"] == "cuda:0"
    assert fake.device == 0


def test_built_engines_are_cached_beside_the_model_and_keyed(
    fake: fake_tensorrt.FakeCudart, tmp_path: Path
) -> None:
    model = add_model(tmp_path / "model.onnx")
    make(tmp_path, model, profile=PROFILE)
    plans = sorted(p.name for p in tmp_path.glob(".model.*.plan"))
    assert len(plans) == 1  # a dot name: the watcher and fingerprints ignore it
    make(tmp_path, model, profile=PROFILE)
    assert len(fake_tensorrt.BUILDS) == 1  # reused
    make(tmp_path, model, profile={"x": {"min": [1, 4], "opt": [2, 4], "max": [16, 4]}})
    assert len(fake_tensorrt.BUILDS) == 2  # another profile, another engine
    make(tmp_path, model, profile=PROFILE, fp16=True)
    assert len(fake_tensorrt.BUILDS) == 3
    assert len(list(tmp_path.glob(".model.*.plan"))) == 3


def test_a_read_only_model_folder_caches_in_the_cache_dir(
    fake: fake_tensorrt.FakeCudart, tmp_path: Path
) -> None:
    folder = tmp_path / "ro"
    model = add_model(folder / "model.onnx")
    folder.chmod(0o555)
    try:
        if (folder / "probe").exists() or _writable(folder):
            pytest.skip("running as a user that can write anywhere")
        make(tmp_path, model, profile=PROFILE)
        assert list((tmp_path / "cache" / "tensorrt").glob("model.*.plan"))
    finally:
        folder.chmod(0o755)


def _writable(folder: Path) -> bool:
    try:
        (folder / ".probe").write_text("x")
    except OSError:
        return False
    (folder / ".probe").unlink()
    return True


def test_a_plan_file_is_deserialized(fake: fake_tensorrt.FakeCudart, tmp_path: Path) -> None:
    model = add_model(tmp_path / "model.onnx", amount=1)
    make(tmp_path, model, profile=PROFILE)
    plan = next(tmp_path.glob(".model.*.plan"))
    engine_file = tmp_path / "model.plan"
    engine_file.write_bytes(plan.read_bytes())
    runner = make(tmp_path, engine_file)
    assert runner.infer({"x": np.ones((2, 4), np.float32)})["y"].tolist() == [[2.0] * 4] * 2
    bad = tmp_path / "broken.plan"
    bad.write_bytes(b"not an engine")
    with pytest.raises(PluginLoadError, match="could not deserialize"):
        make(tmp_path, bad)


def test_dynamic_inputs_need_a_profile(fake: fake_tensorrt.FakeCudart, tmp_path: Path) -> None:
    with pytest.raises(PluginLoadError, match=r"input\(s\) \['x'\] have dynamic dimensions"):
        make(tmp_path, add_model(tmp_path / "model.onnx"))
    with pytest.raises(PluginLoadError, match="min <= opt <= max"):
        make(
            tmp_path,
            add_model(tmp_path / "model.onnx"),
            profile={"x": {"min": [4, 4], "opt": [1, 4], "max": [8, 4]}},
        )


def test_shapes_outside_the_profile_are_400(fake: fake_tensorrt.FakeCudart, tmp_path: Path) -> None:
    runner = make(tmp_path, add_model(tmp_path / "model.onnx"), profile=PROFILE)
    with pytest.raises(
        InvalidInput, match=r"has shape \[9, 4\]; the engine takes \[1, 4\] to \[8, 4\]"
    ):
        runner.infer({"x": np.zeros((9, 4), np.float32)})
    with pytest.raises(InvalidInput, match="missing input 'x'"):
        runner.infer({})


def test_per_batch_shapes_and_buffers_grow_and_are_reused(
    fake: fake_tensorrt.FakeCudart, tmp_path: Path
) -> None:
    runner = make(tmp_path, add_model(tmp_path / "model.onnx"), profile=PROFILE)
    for rows in (1, 8, 3, 8):
        x = np.full((rows, 4), rows, np.float32)
        np.testing.assert_array_equal(runner.infer({"x": x})["y"], x + 1)
    assert len(fake.memory) == 2  # one input and one output buffer, grown once to 8 rows


def test_fixed_shape_engines_and_several_dtypes(
    fake: fake_tensorrt.FakeCudart, tmp_path: Path
) -> None:
    model = identity_model(
        tmp_path / "model.onnx", {"a": TensorProto.FLOAT16, "b": TensorProto.INT64}, [2, 3]
    )
    runner = make(tmp_path, model)
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    b = np.arange(6, dtype=np.int64).reshape(2, 3)
    out = runner.infer({"in_a": a, "in_b": b})
    assert out["out_a"].dtype == np.float16
    np.testing.assert_array_equal(out["out_a"], a)
    np.testing.assert_array_equal(out["out_b"], b)
    assert runner.metadata()["outputs"][0] == {"name": "out_a", "datatype": "FP16", "shape": [2, 3]}


def test_close_releases_device_memory_and_streams(
    fake: fake_tensorrt.FakeCudart, tmp_path: Path
) -> None:
    runner = make(tmp_path, add_model(tmp_path / "model.onnx"), profile=PROFILE, instances=2)
    runner.infer({"x": np.zeros((2, 4), np.float32)})
    assert fake.memory
    assert len(fake.streams) == 2
    runner.close()
    assert fake.memory == {}
    assert fake.streams == set()


async def test_tensorrt_runner_fails_clearly_in_the_server(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    from tests.helpers import write_plugin

    folder = write_plugin(
        plugins_dir,
        "runner",
        "trt",
        "1.0.0",
        '[runner]\nbackend = "tensorrt"\nmodel = "model.onnx"\n',
        module=None,
    )
    add_model(folder / "model.onnx")
    if "tensorrt" in sys.modules or _has_tensorrt():
        pytest.skip("TensorRT is installed here")
    cli = await client()
    rows = (await (await cli.get("/admin/plugins")).json())["plugins"]
    assert rows[0]["state"] == "failed"
    assert "pip install 'plugserve[tensorrt]'" in rows[0]["last_error"]
    ready = await cli.get("/v2/health/ready")  # strict: the route cannot serve, and says why
    assert ready.status == 503
    assert "pip install 'plugserve[tensorrt]'" in (await ready.json())["unserved"]["trt"]


def _has_tensorrt() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorrt") is not None


def test_shapes_the_engine_finds_inconsistent_are_invalid_input(
    fake: fake_tensorrt.FakeCudart, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 finding 5, TensorRT's side: inputs each within the profile but inconsistent
    together (a MatMul's inner dimensions 3 and 2: ``infer_shapes`` raises), or a shape
    ``set_input_shape`` refuses (False), refuse the request's inputs: InvalidInput, never
    the RuntimeError the circuit breaker counts. The engine then still serves."""
    from onnx import helper

    from tests.helpers import _save

    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", "K"])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["M", "P"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "P"])
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "mm", [a, b], [y])
    model = _save(graph, tmp_path / "model.onnx")
    shapes = {"min": [1, 1], "opt": [4, 4], "max": [8, 8]}
    runner = make(tmp_path, model, profile={"a": shapes, "b": shapes})
    with pytest.raises(InvalidInput, match=r"TensorRT refused the input shapes: .*MatMul"):
        runner.infer({"a": np.ones((2, 3), np.float32), "b": np.ones((2, 4), np.float32)})
    good = runner.infer({"a": np.ones((2, 3), np.float32), "b": np.ones((3, 4), np.float32)})
    np.testing.assert_array_equal(good["y"], np.full((2, 4), 3, np.float32))
    monkeypatch.setattr(fake_tensorrt.ExecutionContext, "set_input_shape", lambda *_: False)
    with pytest.raises(InvalidInput, match=r"TensorRT refused shape \[2, 3\] for input 'a'"):
        runner.infer({"a": np.ones((2, 3), np.float32), "b": np.ones((3, 4), np.float32)})
