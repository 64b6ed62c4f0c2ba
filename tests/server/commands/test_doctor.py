"""``plugserve doctor``: the runtime, the GPU libraries with their install command, the
settings, and a fleet's etcd; exit 0 when serving would work."""

import importlib.metadata
import json
import os
import re
from pathlib import Path
from typing import Any

import onnxruntime
import pytest

from plugserve.server.commands.doctor import install_command, needed_libraries, runtime_conflict
from tests.etcd import EtcdProcess
from tests.helpers import free_port
from tests.server.test_cli import plugserve

pytestmark = pytest.mark.slow
CAPI = Path(onnxruntime.__file__).parent / "capi"


def doctor(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    result = plugserve("doctor", "--json", *args, cwd=tmp_path)
    doc = json.loads(result.stdout)
    return result.returncode, {check["name"]: check for check in doc["checks"]}


def test_doctor_reports_the_runtime_and_the_gpu_libraries(tmp_path: Path) -> None:
    code, checks = doctor(tmp_path)
    assert code == 0, checks
    assert checks["python"]["status"] == "ok"
    assert "CPUExecutionProvider" in checks["providers"]["data"]["available"]
    assert checks["settings"]["data"]["port"] == 8000
    cpu = checks["cpu"]["data"]  # what workers = "auto" counts, and from what
    assert 1 <= cpu["usable"] <= cpu["affinity"] == len(os.sched_getaffinity(0))
    assert checks["settings"]["data"]["workers"] == cpu["usable"]  # auto, the default
    threads = checks["threads"]["data"]
    assert threads["workers"] == cpu["usable"] and threads["workers_chosen"]
    assert threads["intra_op"] == 1
    assert not threads["spinning"]  # a worker per core: threads beside every loop
    if checks["onnxruntime"]["data"]["cuda_version"] is None:  # a CPU-only onnxruntime
        assert checks["gpu"]["status"] == "warning"
        assert checks["gpu"]["fix"].startswith("pip uninstall -y onnxruntime && pip install")
        assert checks["gpu"]["fix"].endswith("[gpu]'")
        return
    cuda = checks["cuda"]
    major = checks["onnxruntime"]["data"]["cuda_version"].split(".")[0]
    assert f"libcublasLt.so.{major}" in cuda["data"]["libraries"]
    if cuda["data"]["missing"]:  # no GPU libraries here: a warning and the command to get them
        assert cuda["status"] == "warning"
        assert cuda["fix"].startswith("pip install ") and "[gpu]'" in cuda["fix"]
        missing = " ".join(cuda["data"]["missing"])
        assert f"libcublasLt.so.{major}" in missing or "libcuda.so.1" in missing
    elif set(cuda["data"]["libraries"].values()) == {"system"}:
        assert cuda["status"] == "ok" and cuda["fix"] is None
    else:  # some only in the NVIDIA wheels' folders, which plugserve preloads from
        assert cuda["status"] == "ok" and "plugserve loads" in cuda["detail"]
    assert "libcudnn.so.9" in checks["cudnn"]["data"]["libraries"]


def test_doctor_shows_the_threads_one_worker_leaves_to_onnx_runtime(tmp_path: Path) -> None:
    config = tmp_path / "one.toml"
    config.write_text("workers = 1\n")
    code, checks = doctor(tmp_path, "--config", str(config))
    assert code == 0, checks
    usable = checks["cpu"]["data"]["usable"]
    threads = checks["threads"]["data"]
    assert threads["workers"] == 1 and not threads["workers_chosen"]
    assert threads["intra_op"] == max(1, usable - 1)  # every core but the loop's
    assert "1 event loop" in threads["reason"]


def test_doctor_warns_of_far_more_workers_than_cores(tmp_path: Path) -> None:
    """Each worker holds every in-worker model: 1,024 on a small machine would take its
    memory. A warning with the way out; serving would still start (exit 0)."""
    config = tmp_path / "many.toml"
    config.write_text("workers = 1024\n")
    code, checks = doctor(tmp_path, "--config", str(config))
    assert code == 0, checks
    usable = checks["cpu"]["data"]["usable"]
    assert usable < 512  # not a machine where 1,024 workers is the norm
    threads = checks["threads"]
    assert threads["status"] == "warning" and "more than twice the cores" in threads["detail"]
    assert f"workers = {usable}" in threads["fix"]


def test_the_install_command_names_the_wheels_the_extras_lack() -> None:
    """plugserve[gpu] is onnxruntime-gpu[cuda,cudnn], whose [cuda] names no cuBLAS (cuDNN's
    wheel brings it): the command adds nvidia-cublas anyway, by name."""
    command = install_command(
        "cuda", ["libcublasLt.so.13", "libcurand.so.10"], "13", "onnxruntime-gpu"
    )
    assert '"nvidia-cublas~=13.0"' in command
    try:
        extras = " ".join(importlib.metadata.requires("onnxruntime-gpu") or [])
    except importlib.metadata.PackageNotFoundError:
        extras = ""
    if "cudnn" in extras:
        assert re.match(r"pip install (-e '.*\[gpu\]'|'plugserve\[gpu\]') ", command), command
        assert "curand" not in command  # the [gpu] extra brings it
    else:  # no onnxruntime-gpu with its extras here (the CPU build): every wheel by name
        assert command == 'pip install "nvidia-cublas~=13.0" "nvidia-curand~=10.0"'

    assert "nvidia-cublas-cu12~=12.0" in install_command("cuda", ["libcublas.so.12"], "12", "none")
    assert install_command("tensorrt", ["libnvinfer.so.10"], "13", "onnxruntime-gpu") == (
        'pip install "tensorrt-cu13-libs>=10,<11"'
    )
    assert "NVIDIA driver" in install_command("cuda", ["libcuda.so.1"], "13", "onnxruntime-gpu")


def test_both_onnx_runtimes_installed_is_an_error_with_the_way_out() -> None:
    assert runtime_conflict(["onnxruntime-gpu"]) is None
    check = runtime_conflict(["onnxruntime", "onnxruntime-gpu"])
    assert check is not None and check.status == "error"
    assert check.fix is not None
    assert check.fix.startswith("pip uninstall -y onnxruntime onnxruntime-gpu && pip install")
    assert "[gpu]'" in check.fix and "[cpu]'" in check.fix


@pytest.mark.skipif(
    not (CAPI / "libonnxruntime_providers_cuda.so").is_file(), reason="a CPU-only onnxruntime"
)
def test_the_libraries_are_read_from_the_provider_itself() -> None:
    needed = needed_libraries(CAPI / "libonnxruntime_providers_cuda.so")
    assert any(name.startswith("libcublasLt.so.") for name in needed)
    assert needed_libraries(Path(__file__)) == []  # not an ELF file


def test_an_unreachable_etcd_fails_the_doctor(tmp_path: Path) -> None:
    config = tmp_path / "plugserve.toml"
    config.write_text(f'registry = "etcd://127.0.0.1:{free_port()}/fleet"\n')
    code, checks = doctor(tmp_path, "--config", str(config))
    assert code == 1
    assert checks["etcd"]["status"] == "error" and "unreachable" in checks["etcd"]["detail"]
    human = plugserve("doctor", "--config", str(config), cwd=tmp_path)
    assert human.returncode == 1
    assert "[FAIL] etcd: etcd://127.0.0.1:" in human.stdout and "fix: start etcd" in human.stdout
    assert human.stdout.rstrip().endswith("plugserve would not serve on this machine")


def test_a_reachable_etcd_and_a_bad_config(tmp_path: Path, etcd: EtcdProcess) -> None:
    config = tmp_path / "plugserve.toml"
    config.write_text(f'registry = "etcd://127.0.0.1:{etcd.port}/fleet"\n')
    code, checks = doctor(tmp_path, "--config", str(config))
    assert code == 0, checks
    assert checks["etcd"]["data"]["endpoints"] == {etcd.endpoint: "healthy"}
    config.write_text("port = 'abc'\n")
    code, checks = doctor(tmp_path, "--config", str(config))
    assert code == 1
    assert 'port must be an integer, not a string ("abc")' in checks["settings"]["detail"]
