"""GPU providers on a machine that may have none: the fallback says why and how to fix it.

Real ONNX Runtime, real loader: with ``onnxruntime-gpu`` and no CUDA libraries (this
project's CI machines), asking for CUDA really fails to load ``libcublasLt``; with the
CPU build, the CUDA provider is really absent. Each case runs where it is true.
"""

import sys
from pathlib import Path

import onnxruntime as ort
import pytest
import structlog

from plugserve.registry.backends.onnxruntime import create_runner
from plugserve.registry.backends.ort_gpu import (
    build_package,
    install_command,
    installed_runtimes,
    missing_library,
    preload_gpu_libraries,
    provider_load_error,
)
from plugserve.registry.errors import PluginLoadError
from plugserve.registry.types import PluginInfo
from tests.helpers import ROOT, add_model

CUDA_FIRST = ["CUDAExecutionProvider", "CPUExecutionProvider"]
GPU_BUILD = build_package(ort) == "onnxruntime-gpu"


def info(tmp_path: Path) -> PluginInfo:
    return PluginInfo("m", "1.0.0", "runner", tmp_path, structlog.get_logger())


def test_one_onnx_runtime_is_installed_and_the_build_is_named() -> None:
    assert installed_runtimes() in (["onnxruntime"], ["onnxruntime-gpu"])
    assert build_package(ort) == installed_runtimes()[0]


@pytest.mark.skipif(not GPU_BUILD, reason="the CPU build of ONNX Runtime: no CUDA provider")
def test_a_cuda_fallback_names_the_missing_library_and_the_extra(tmp_path: Path) -> None:
    reason = provider_load_error(ort, "CUDAExecutionProvider")
    if reason is None:
        pytest.skip("the CUDA libraries load here (a GPU machine): nothing falls back for that")
    model = add_model(tmp_path / "a.onnx")
    with structlog.testing.capture_logs() as events:
        runner = create_runner(info(tmp_path), {"providers": CUDA_FIRST}, model)
    assert runner.metadata()["providers"] == ["CPUExecutionProvider"]
    (fallback,) = [e for e in events if e["event"] == "provider_fallback"]
    assert fallback["log_level"] == "warning"
    assert fallback["requested"] == "CUDAExecutionProvider"
    assert fallback["using"] == "CPUExecutionProvider"
    assert fallback["reason"] == reason
    library = fallback["missing_library"]
    assert library.startswith(("libcu", "libnv")) and ".so" in library
    assert library in reason and "cannot open shared object file" in reason
    assert "[gpu]" in fallback["fix"] and fallback["fix"].startswith("pip install")
    with pytest.raises(PluginLoadError) as failed:
        create_runner(info(tmp_path), {"providers": CUDA_FIRST, "require": True}, model)
    message = str(failed.value)
    assert "CUDAExecutionProvider is required but the session fell back" in message
    assert library in message and "[gpu]" in message


@pytest.mark.skipif(not GPU_BUILD, reason="the CPU build of ONNX Runtime: no TensorRT provider")
def test_a_tensorrt_fallback_says_which_library_too(tmp_path: Path) -> None:
    reason = provider_load_error(ort, "TensorrtExecutionProvider")
    if reason is None:
        pytest.skip("TensorRT's provider loads here: nothing falls back for that")
    model = add_model(tmp_path / "a.onnx")
    providers = ["TensorrtExecutionProvider", "CPUExecutionProvider"]
    with structlog.testing.capture_logs() as events:
        create_runner(info(tmp_path), {"providers": providers}, model)
    (fallback,) = [e for e in events if e["event"] == "provider_fallback"]
    assert fallback["requested"] == "TensorrtExecutionProvider"
    assert fallback["missing_library"] in reason
    trt = fallback["missing_library"].startswith(("libnvinfer", "libnvonnxparser"))
    assert ("[tensorrt]" if trt else "[gpu]") in fallback["fix"]


@pytest.mark.skipif(GPU_BUILD, reason="onnxruntime-gpu: the CUDA provider is there")
def test_the_cpu_build_says_how_to_get_the_gpu_one(tmp_path: Path) -> None:
    model = add_model(tmp_path / "a.onnx")
    with structlog.testing.capture_logs() as events:
        runner = create_runner(info(tmp_path), {"providers": CUDA_FIRST}, model)
    assert runner.metadata()["providers"] == ["CPUExecutionProvider"]
    (unavailable,) = [e for e in events if e["event"] == "providers_unavailable"]
    assert unavailable["missing"] == ["CUDAExecutionProvider"]
    assert unavailable["fix"].startswith("pip uninstall -y onnxruntime && pip install")
    assert "[gpu]" in unavailable["fix"]
    with pytest.raises(
        PluginLoadError, match=r"has no GPU providers: pip uninstall -y onnxruntime"
    ):
        create_runner(info(tmp_path), {"providers": CUDA_FIRST, "require": True}, model)


def test_preloading_is_once_and_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """``preload_dlls`` prints what it cannot load: that must not reach the server's stdout."""
    first = preload_gpu_libraries(ort)
    assert preload_gpu_libraries(ort) is first  # once a process
    assert capsys.readouterr().out == ""
    if GPU_BUILD and provider_load_error(ort, "CUDAExecutionProvider") is not None:
        assert any("libcublas" in line for line in first), first
    if not GPU_BUILD:
        assert first == []  # the CPU build has nothing to preload


def test_the_provider_library_is_opened_for_real() -> None:
    reason = provider_load_error(ort, "CUDAExecutionProvider")
    if not GPU_BUILD:
        assert reason is not None and "not in this ONNX Runtime build" in reason
    assert provider_load_error(ort, "CPUExecutionProvider") is None


def test_missing_library_reads_the_loaders_message() -> None:
    message = "libcublasLt.so.13: cannot open shared object file: No such file or directory"
    assert missing_library(message) == "libcublasLt.so.13"
    assert missing_library("libnvinfer.so.10: cannot open shared object file") == "libnvinfer.so.10"
    assert missing_library("CUDA driver version is insufficient") is None
    assert missing_library(None) is None


def test_install_commands_name_the_extra_and_the_clone() -> None:
    command = install_command("gpu")
    if str(ROOT) in command:  # installed with pip install -e from this clone
        assert command == f"pip install -e '{ROOT}[gpu]'"
    else:
        assert command == "pip install 'plugserve[gpu]'"
    replaced = install_command("cpu", replace=["onnxruntime-gpu"])
    assert replaced.startswith("pip uninstall -y onnxruntime-gpu && pip install")
    assert replaced.endswith("[cpu]'")


def test_without_onnx_runtime_a_runner_names_both_extras(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare ``pip install plugserve`` has no ONNX Runtime (a None entry in sys.modules is
    how Python spells "this import fails")."""
    model = add_model(tmp_path / "a.onnx")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(PluginLoadError, match="ONNX Runtime is not installed") as failed:
        create_runner(info(tmp_path), {}, model)
    assert "[cpu]" in str(failed.value) and "[gpu]" in str(failed.value)
