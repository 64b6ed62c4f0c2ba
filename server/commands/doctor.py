"""``plugserve doctor``: what this machine can serve, and the command that fixes what it cannot.

Each check is ``ok``, ``warning`` (serving works, something is missing: a GPU
library on a CPU-only machine, say) or ``error`` (serving would fail). The GPU
libraries checked are the ones the installed ONNX Runtime's providers link to,
read from their ELF headers, and cuDNN's, which ONNX Runtime opens at run time.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.metadata
import json
import platform
import site
import socket
import struct
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from plugserve.registry.backends import cpu_share
from plugserve.registry.backends.cpu_share import CpuShare
from plugserve.registry.backends.ort_gpu import RUNTIMES, installed_runtimes
from plugserve.registry.backends.ort_gpu import install_command as extra_command
from plugserve.registry.errors import PlugserveError
from plugserve.registry.fleet.etcd_store import EtcdLocation
from plugserve.server import __version__
from plugserve.server.config import Settings, load_settings
from plugserve.server.runtime.cores import affinity_cores, bounded, cpu_quota, usable_cores

ETCD_TIMEOUT_S = 2.0
SYSTEM_LIBRARIES = (
    "libc.",
    "libm.",
    "libdl.",
    "librt.",
    "libpthread.",
    "libstdc++.",
    "libgcc_s.",
    "ld-linux",
)
"""Sonames every Linux machine has: not worth a line."""
PROVIDER_FILES = {
    "CUDAExecutionProvider": "libonnxruntime_providers_cuda.so",
    "TensorrtExecutionProvider": "libonnxruntime_providers_tensorrt.so",
}

WHEELS_FIX = (
    "found in the TensorRT wheels only, which ONNX Runtime's TensorRT provider does not "
    "search: export LD_LIBRARY_PATH={folders}"
)
WHEELS_PRELOADED = (
    "{detail}; from the NVIDIA wheels, which plugserve loads (onnxruntime.preload_dlls)"
)


@dataclasses.dataclass
class Check:
    """One line of the report: what was checked, how it went, and how to fix it."""

    name: str
    status: str  # ok | warning | error
    detail: str
    fix: str | None = None
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


def run_doctor(config: Path | None, as_json: bool) -> int:
    """Print the report; 0 when serving would work (warnings allowed), else 1."""
    checks = diagnose(config)
    code = 1 if any(c.status == "error" for c in checks) else 0
    if as_json:
        doc = {"ok": code == 0, "checks": [dataclasses.asdict(c) for c in checks]}
        print(json.dumps(doc, indent=2))
    else:
        print(render(checks))
    return code


def render(checks: list[Check]) -> str:
    """The human report: one line a check, its fix indented below it."""
    marks = {"ok": "ok  ", "warning": "warn", "error": "FAIL"}
    lines = []
    for check in checks:
        lines.append(f"[{marks[check.status]}] {check.name}: {check.detail}")
        if check.fix:
            lines.append(f"       fix: {check.fix}")
    verdict = "would not serve" if any(c.status == "error" for c in checks) else "can serve"
    lines.append(f"plugserve {verdict} on this machine")
    return "\n".join(lines)


def diagnose(config: Path | None) -> list[Check]:
    """Every check, in the order a reader needs them."""
    checks = [_python(), Check("plugserve", "ok", __version__), _cores()]
    checks += _onnxruntime()
    settings_check, settings = _settings(config)
    checks.append(settings_check)
    if settings is not None:
        checks.append(_threads(settings))
        checks.append(_plugins_dir(settings))
        checks.append(_port(settings))
        if settings.registry != "local":
            checks.append(etcd_check(settings.registry, settings.etcd_password))
    return checks


def _python() -> Check:
    return Check("python", "ok", f"{platform.python_version()} ({sys.executable})")


def _cores() -> Check:
    """The cores ``workers = "auto"`` counts, and where the count comes from."""
    affinity, quota = affinity_cores(), cpu_quota()
    usable = bounded(affinity, quota)
    shown = "none" if quota is None else f"{quota:g} cores"
    detail = f"{usable} usable (affinity {affinity}, cgroup CPU quota {shown})"
    return Check("cpu", "ok", detail, data={"usable": usable, "affinity": affinity, "quota": quota})


def _threads(settings: Settings) -> Check:
    """The processes and backend threads ``plugserve serve`` would choose for these cores."""
    usable, workers = usable_cores(), settings.worker_count
    choice = cpu_share.choose(CpuShare(usable, workers))
    why = "auto: one per usable core" if settings.workers == "auto" else "set"
    detail = (
        f"{workers} worker process{'es' if workers != 1 else ''} ({why}); ONNX Runtime "
        f"sessions {choice.threads} intra-op thread{'s' if choice.threads != 1 else ''} each, "
        f"spinning {'on' if choice.spinning else 'off'} ({choice.reason}), unless a runner "
        "sets intra_op_threads"
    )
    data = {"workers": workers, "workers_chosen": settings.workers == "auto", **choice.as_json()}
    if workers > 2 * usable:  # each worker holds every in-worker model, and takes turns
        fix = f'workers = {usable} (or "auto"); isolation = "process" for large models'
        return Check("threads", "warning", f"{detail}: more than twice the cores", fix, data)
    return Check("threads", "ok", detail, data=data)


def _onnxruntime() -> list[Check]:
    """ONNX Runtime's version and providers, then the libraries its GPU providers need."""
    runtimes = installed_runtimes()
    conflict = runtime_conflict(runtimes)
    if conflict is not None:
        return [conflict]
    try:
        import onnxruntime
    except ImportError as exc:
        fix = f"{extra_command('cpu')}  (NVIDIA GPUs: {extra_command('gpu')})"
        return [Check("onnxruntime", "error", f"cannot be imported: {exc}", fix)]
    build = _build_info()
    providers = onnxruntime.get_available_providers()
    package = build.get("package_name", "onnxruntime")
    cuda = build.get("cuda_version") or None
    detail = f"{package} {onnxruntime.__version__}" + (f", built for CUDA {cuda}" if cuda else "")
    checks = [
        Check("onnxruntime", "ok", detail, data={"package": package, "cuda_version": cuda}),
        Check(
            "providers",
            "ok" if "CPUExecutionProvider" in providers else "error",
            ", ".join(providers),
            data={"available": providers},
        ),
    ]
    if cuda is None:
        fix = extra_command("gpu", replace=runtimes or [package])
        checks.append(Check("gpu", "warning", "a CPU-only ONNX Runtime: no CUDA provider", fix))
        return checks
    return checks + gpu_checks(Path(onnxruntime.__file__).parent / "capi", cuda, package)


def runtime_conflict(runtimes: list[str]) -> Check | None:
    """An error when both ONNX Runtime builds are installed: one overwrote the other's files."""
    if len(runtimes) < 2:
        return None
    fix = (
        extra_command("gpu", replace=list(RUNTIMES))
        + f"  (CPU only: {extra_command('cpu', replace=list(RUNTIMES))})"
    )
    detail = "onnxruntime and onnxruntime-gpu are both installed: they share one module"
    return Check("onnxruntime", "error", detail, fix, data={"installed": runtimes})


def _build_info() -> dict[str, str]:
    """``package_name`` and ``cuda_version`` of the installed ONNX Runtime build."""
    try:
        from onnxruntime.capi import build_and_package_info as info
    except ImportError:
        return {}
    return {k: str(getattr(info, k)) for k in ("package_name", "cuda_version") if hasattr(info, k)}


def gpu_checks(capi: Path, cuda_version: str, package: str) -> list[Check]:
    """CUDA, cuDNN and TensorRT: is each library the providers need loadable, and from where."""
    major = cuda_version.split(".", 1)[0]
    groups: dict[str, list[str]] = {"cuda": [], "cudnn": ["libcudnn.so.9"], "tensorrt": []}
    for filename in PROVIDER_FILES.values():
        path = capi / filename
        if not path.is_file():
            continue
        for soname in needed_libraries(path):
            group = _group(soname)
            if not soname.startswith(SYSTEM_LIBRARIES) and soname not in groups[group]:
                groups[group].append(soname)
    checks = []
    for group, sonames in groups.items():
        found = {soname: find_library(soname) for soname in sonames}
        missing = [s for s, where in found.items() if where is None]
        wheels = sorted({where for where in found.values() if where not in (None, "system")})
        detail = ", ".join(f"{s} ({where or 'missing'})" for s, where in found.items())
        fix = install_command(group, missing, major, package) if missing else None
        preloaded = bool(wheels) and not missing and group != "tensorrt"
        if wheels and not missing and not preloaded:
            fix = WHEELS_FIX.format(folders=":".join(wheels))
        if preloaded:
            detail = WHEELS_PRELOADED.format(detail=detail)
        checks.append(
            Check(
                group,
                "warning" if missing or (wheels and not preloaded) else "ok",
                detail or "nothing needed",
                fix,
                data={"libraries": found, "missing": missing},
            )
        )
    return checks


def _group(soname: str) -> str:
    if soname.startswith("libcudnn"):
        return "cudnn"
    if soname.startswith(("libnvinfer", "libnvonnxparser")):
        return "tensorrt"
    return "cuda"


def needed_libraries(path: Path) -> list[str]:
    """The ``DT_NEEDED`` sonames of a 64-bit little-endian ELF shared library."""
    data = path.read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":
        return []
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    entsize, count = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * entsize) for i in range(count)]
    names = []
    for section in sections:
        if section[1] != 6:  # SHT_DYNAMIC
            continue
        strings = sections[section[6]][4]
        for offset in range(section[4], section[4] + section[5], 16):
            tag, value = struct.unpack_from("<qQ", data, offset)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                start = strings + value
                names.append(data[start : data.index(b"\0", start)].decode())
    return names


def find_library(soname: str) -> str | None:
    """Where ``soname`` loads from: ``system`` (the loader's path), a wheel's folder, or ``None``.

    A library found only in a wheel (``nvidia-*``, ``tensorrt-*``) is loaded by
    ONNX Runtime once ``onnxruntime.preload_dlls()`` has run.
    """
    try:
        ctypes.CDLL(soname, mode=ctypes.RTLD_GLOBAL)
        return "system"
    except OSError:
        pass
    for folder in _wheel_folders():
        candidate = folder / soname
        if candidate.is_file():
            try:
                ctypes.CDLL(str(candidate), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            return str(folder)
    return None


def _wheel_folders() -> list[Path]:
    """The folders the NVIDIA and TensorRT wheels put their libraries in."""
    roots = [Path(p) for p in [*site.getsitepackages(), site.getusersitepackages()]]
    folders = []
    for root in roots:
        folders += [*sorted(root.glob("nvidia/*/lib")), root / "tensorrt_libs"]
    return [f for f in folders if f.is_dir()]


def install_command(group: str, missing: list[str], major: str, package: str) -> str:
    """The command that installs ``missing`` libraries of ``group`` from the package index."""
    driver = "libcuda.so.1" in missing
    missing = [s for s in missing if s != "libcuda.so.1"]
    note = "the NVIDIA driver (libcuda.so.1) is not installed: a GPU machine needs it"
    if not missing:
        return note
    command = _pip_command(group, missing, major, package)
    return f"{command}; and {note}" if driver else command


def _pip_command(group: str, missing: list[str], major: str, package: str) -> str:
    if group == "tensorrt":
        trt = next((s.rsplit(".", 1)[-1] for s in missing if ".so." in s), "10")
        return f'pip install "tensorrt-cu{major}-libs>={trt},<{int(trt) + 1}"'
    extras = _extras(package)
    wanted = [_wheel(soname, major) for soname in missing]
    covered = set(extras.get("cuda", ())) | set(extras.get("cudnn", ()))
    rest = sorted({w for w in wanted if w.split("~=")[0] not in covered})
    if not extras:  # an onnxruntime-gpu without the cuda/cudnn extras: the wheels by name
        return "pip install " + " ".join(f'"{w}"' for w in rest)
    # plugserve[gpu] is onnxruntime-gpu[cuda,cudnn]; the installed one satisfies it.
    return " ".join([extra_command("gpu"), *(f'"{w}"' for w in rest)])


def _wheel(soname: str, major: str) -> str:
    """The NVIDIA wheel that ships ``soname`` (CUDA 13 dropped the ``-cuNN`` suffix but cuDNN's)."""
    suffix = "" if major.isdigit() and int(major) >= 13 else f"-cu{major}"
    if soname.startswith("libcudnn"):
        return f"nvidia-cudnn-cu{major}~=9.0"
    stem = soname.split(".so", 1)[0].removeprefix("lib")
    names = {
        "cublasLt": "cublas",
        "cublas": "cublas",
        "cudart": "cuda-runtime",
        "nvrtc": "cuda-nvrtc",
        "curand": "curand",
        "cufft": "cufft",
    }
    version = soname.rsplit(".", 1)[-1]
    return f"nvidia-{names.get(stem, stem)}{suffix}~={version}.0"


def _extras(package: str) -> dict[str, list[str]]:
    """The installed ONNX Runtime's extras (``cuda``, ``cudnn``) and the wheels each brings."""
    try:
        requires = importlib.metadata.requires(package) or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    extras: dict[str, list[str]] = {}
    for line in requires:
        requirement, _, marker = line.partition(";")
        if "extra ==" in marker:
            extra = marker.split("extra ==", 1)[1].strip().strip("'\"")
            name = requirement.split("~=")[0].split(">=")[0].split("==")[0].strip()
            extras.setdefault(extra, []).append(name)
    return {k: v for k, v in extras.items() if k in ("cuda", "cudnn")}


def _settings(config: Path | None) -> tuple[Check, Settings | None]:
    """The settings ``plugserve serve`` would use, from the config file and environment."""
    try:
        settings = load_settings(config)
    except PlugserveError as exc:
        return Check("settings", "error", exc.message), None
    shown = {
        "config": None if config is None else str(config),
        "host": settings.host,
        "port": settings.port,
        "grpc_port": settings.grpc_port,
        "admin_port": settings.admin_port,
        "plugins_dir": str(settings.plugins_dir),
        "models_dir": str(settings.models_dir),
        "workers": settings.worker_count,
        "registry": settings.registry
        if settings.registry == "local"
        else EtcdLocation.parse(settings.registry).shown,
        "admin_token": settings.admin_token is not None,
        "inference_token": settings.inference_token is not None,
    }
    detail = ", ".join(f"{k}={v}" for k, v in shown.items() if v is not None)
    return Check("settings", "ok", detail, data=shown), settings


def _plugins_dir(settings: Settings) -> Check:
    if not settings.plugins_dir.is_dir():
        fix = "plugserve new runner demo --dir <plugins_dir>, or set plugins_dir"
        return Check("plugins_dir", "error", f"{settings.plugins_dir}: no such folder", fix)
    return Check("plugins_dir", "ok", str(settings.plugins_dir))


def _port(settings: Settings) -> Check:
    """Whether the HTTP port is free now (a server already running holds it)."""
    where = f"{settings.host}:{settings.port}"
    try:
        with socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET) as sock:
            sock.bind((settings.host, settings.port))
    except OSError as exc:
        return Check("port", "warning", f"{where}: {exc.strerror} (a server running already?)")
    return Check("port", "ok", f"{where} is free")


def etcd_check(url: str, password: str | None = None) -> Check:
    """A fleet's etcd: ``GET /health`` on each endpoint, within :data:`ETCD_TIMEOUT_S`."""
    try:
        location = EtcdLocation.parse(url, password)
    except PlugserveError as exc:
        return Check("etcd", "error", exc.message)
    results = {}
    for endpoint in location.endpoints:
        try:
            with urllib.request.urlopen(endpoint + "/health", timeout=ETCD_TIMEOUT_S) as response:
                body = response.read(4096)
            healthy = json.loads(body).get("health") in ("true", True)
            results[endpoint] = "healthy" if healthy else f"unhealthy: {body[:200]!r}"
        except (OSError, ValueError, urllib.error.URLError) as exc:
            reason = getattr(exc, "reason", exc)
            results[endpoint] = f"unreachable: {reason}"
    status = "ok" if any(r == "healthy" for r in results.values()) else "error"
    detail = f"{location.shown}: " + "; ".join(f"{e} {r}" for e, r in results.items())
    fix = None if status == "ok" else "start etcd, or check the registry URL and the network"
    return Check("etcd", status, detail, fix, data={"endpoints": results})
