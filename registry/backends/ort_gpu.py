"""ONNX Runtime on NVIDIA GPUs: loading CUDA and cuDNN from the NVIDIA wheels, and saying why not.

plugserve's ``[gpu]`` extra installs ``onnxruntime-gpu[cuda,cudnn]``: the CUDA and
cuDNN libraries come as NVIDIA wheels in site-packages, which the dynamic loader
does not search. ``onnxruntime.preload_dlls()`` (ONNX Runtime 1.21 and newer)
loads them from there; :func:`preload_gpu_libraries` calls it once a process,
only when a runner asks for a GPU provider. When a session still falls back to
the CPU, :func:`fallback_reason` names the library that could not be loaded and
:func:`install_command` the command that brings it.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.metadata
import io
import json
import re
import threading
from pathlib import Path
from typing import Any

GPU_PROVIDERS = {
    "CUDAExecutionProvider": "libonnxruntime_providers_cuda.so",
    "TensorrtExecutionProvider": "libonnxruntime_providers_tensorrt.so",
}
"""The GPU providers of ``onnxruntime-gpu`` and the library each is built into."""
TENSORRT_LIBRARIES = ("libnvinfer", "libnvonnxparser")
"""Sonames of TensorRT's own libraries (the ``[tensorrt]`` extra's), by prefix."""
RUNTIMES = ("onnxruntime", "onnxruntime-gpu")
"""The two distributions that both install the ``onnxruntime`` module: never both at once."""
_MISSING = re.compile(r"(lib[\w.+-]+?\.so[\w.]*): cannot open shared object file")
_lock = threading.Lock()
_preloaded: list[str] | None = None


def preload_gpu_libraries(ort: Any) -> list[str]:
    """Load CUDA and cuDNN from the NVIDIA wheels, once a process; the failures, as lines.

    A no-op on an ONNX Runtime without ``preload_dlls`` (before 1.21) or without
    CUDA (its CPU build). ``preload_dlls`` prints what it could not load; that
    goes into the returned lines, not onto the server's stdout.
    """
    global _preloaded
    with _lock:
        if _preloaded is not None:
            return _preloaded
        if not hasattr(ort, "preload_dlls"):
            _preloaded = []
            return _preloaded
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                ort.preload_dlls()
        except Exception as exc:  # its own checks raise RuntimeError; never fatal
            printed.write(f"preload_dlls failed: {exc}\n")
        _preloaded = [line.strip() for line in printed.getvalue().splitlines() if "ailed" in line]
        return _preloaded


def provider_load_error(ort: Any, provider: str) -> str | None:
    """Why ``provider``'s library does not load (the loader's message), or ``None`` if it does.

    ``None`` for a provider library that loads means the libraries are there and the
    failure is the GPU's itself (no device, no driver): ONNX Runtime's log says which.
    """
    filename = GPU_PROVIDERS.get(provider)
    if filename is None:
        return None
    path = Path(ort.__file__).parent / "capi" / filename
    if not path.is_file():
        return f"{path.name} is not in this ONNX Runtime build ({build_package(ort)})"
    try:
        ctypes.CDLL(str(path))
    except OSError as exc:
        return str(exc).removeprefix(f"{path}: ")
    return None


def missing_library(reason: str | None) -> str | None:
    """The library a loader message says could not be found (``libcublasLt.so.13``)."""
    found = _MISSING.search(reason or "")
    return found.group(1) if found else None


def build_package(ort: Any) -> str:
    """``onnxruntime-gpu`` or ``onnxruntime``: the build the imported module comes from."""
    try:
        info = importlib.import_module(f"{ort.__name__}.capi.build_and_package_info")
    except ImportError:
        return "onnxruntime"
    return str(getattr(info, "package_name", "onnxruntime"))


def installed_runtimes() -> list[str]:
    """Which of :data:`RUNTIMES` are installed (both at once: one overwrote the other's files)."""
    found = []
    for name in RUNTIMES:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def install_command(extra: str, replace: list[str] | None = None) -> str:
    """The command that installs plugserve's ``extra``, uninstalling ``replace`` first.

    From a clone (an editable install) it names the clone's folder; else the package.
    """
    target = f"plugserve[{extra}]"
    install = f"pip install '{target}'"
    folder = _editable_folder()
    if folder is not None:
        install = f"pip install -e '{folder}[{extra}]'"
    if replace:
        return f"pip uninstall -y {' '.join(replace)} && {install}"
    return install


def _editable_folder() -> str | None:
    """The clone plugserve is installed from with ``pip install -e``, if it is."""
    # Every record of plugserve: run from a clone, its plugserve.egg-info comes first.
    for dist in importlib.metadata.distributions(name="plugserve"):
        try:
            url = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        where = str(url.get("url", ""))
        if url.get("dir_info", {}).get("editable") and where.startswith("file://"):
            return where.removeprefix("file://")
    return None


def gpu_fix(ort: Any) -> str:
    """How to get a working CUDA provider from where this ONNX Runtime stands."""
    if build_package(ort) != "onnxruntime-gpu":
        return install_command("gpu", replace=installed_runtimes() or ["onnxruntime"])
    return install_command("gpu")
