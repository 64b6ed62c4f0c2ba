"""The ``[runner]`` options of the ``onnxruntime`` backend, validated into one record.

```toml
[runner]
backend = "onnxruntime"
model = "models:resnet"
# Providers in preference order: a name, or a table with ONNX Runtime's own options.
providers = [
  { name = "TensorrtExecutionProvider", device_id = 0, trt_engine_cache_enable = true,
    trt_engine_cache_path = "/var/cache/plugserve/trt" },
  { name = "CUDAExecutionProvider", device_id = 0, cudnn_conv_algo_search = "HEURISTIC",
    enable_cuda_graph = false },
  "CPUExecutionProvider",
]
require = false                  # true: fail the load unless the first provider serves
device = "cuda:0"                # optional; else derived from the provider that serves
graph_optimization_level = "all" # disable | basic | extended | all
intra_op_threads = 1
inter_op_threads = 1
session_config = { "session.intra_op.allow_spinning" = "0" }
optimized_model_cache = true     # keep the optimized graph in the cache dir, reuse it
io_binding = false               # run through IOBinding (pays on GPUs: no extra copies)
warmup = { runs = 2, batch_size = 1 }   # or inputs = { x = { shape = [1, 4], datatype = "FP32" } }
```
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plugserve.registry.errors import PluginLoadError
from plugserve.registry.tensors.datatypes import V2_TO_NUMPY

RUNNER_KEYS = frozenset(
    {
        "providers",
        "require",
        "device",
        "graph_optimization_level",
        "intra_op_threads",
        "inter_op_threads",
        "session_config",
        "optimized_model_cache",
        "io_binding",
        "warmup",
    }
)
"""The ``[runner]`` keys this backend reads, declared as its factory's ``runner_keys``."""
DEFAULT_PROVIDERS = ("CPUExecutionProvider",)
LEVELS = ("disable", "basic", "extended", "all")
CACHE_ENV = "PLUGSERVE_CACHE_DIR"


@dataclass(frozen=True)
class Provider:
    name: str
    options: Mapping[str, str] = field(default_factory=dict)

    @property
    def device(self) -> str:
        if self.name in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
            return f"cuda:{self.options.get('device_id', '0')}"
        if self.name == "CPUExecutionProvider":
            return "cpu"
        return self.name.removesuffix("ExecutionProvider").lower()


@dataclass(frozen=True)
class WarmupInput:
    shape: tuple[int, ...]
    datatype: str


@dataclass(frozen=True)
class Warmup:
    runs: int = 1
    batch_size: int = 1
    inputs: Mapping[str, WarmupInput] = field(default_factory=dict)


@dataclass(frozen=True)
class OrtOptions:
    providers: tuple[Provider, ...] = tuple(Provider(p) for p in DEFAULT_PROVIDERS)
    require: bool = False
    device: str | None = None
    graph_optimization_level: str | None = None
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None
    session_config: Mapping[str, str] = field(default_factory=dict)
    optimized_model_cache: bool = False
    io_binding: bool = False
    warmup: Warmup | None = None


def parse_options(runner: Mapping[str, Any], label: str) -> OrtOptions:
    """Validate the backend's keys of a ``[runner]`` table; errors name the field."""

    def fail(key: str, message: str) -> PluginLoadError:
        return PluginLoadError(f"{label}: runner.{key}: {message}")

    providers = tuple(
        _provider(item, i, fail) for i, item in enumerate(runner.get("providers") or [])
    )
    level = runner.get("graph_optimization_level")
    if level is not None and level not in LEVELS:
        raise fail("graph_optimization_level", f"must be one of {', '.join(LEVELS)}")
    config = runner.get("session_config") or {}
    if not isinstance(config, dict):
        raise fail("session_config", "must be a table of ONNX Runtime config keys")
    device = runner.get("device")
    if device is not None and not isinstance(device, str):
        raise fail("device", "must be a string such as 'cpu' or 'cuda:0'")
    return OrtOptions(
        providers=providers or OrtOptions.providers,
        require=_flag(runner, "require", fail),
        device=device,
        graph_optimization_level=level,
        intra_op_threads=_count(runner, "intra_op_threads", fail),
        inter_op_threads=_count(runner, "inter_op_threads", fail),
        session_config={str(k): _text(v) for k, v in config.items()},
        optimized_model_cache=_flag(runner, "optimized_model_cache", fail),
        io_binding=_flag(runner, "io_binding", fail),
        warmup=_warmup(runner.get("warmup"), fail),
    )


def _provider(item: Any, index: int, fail: Any) -> Provider:
    if isinstance(item, str):
        return Provider(item)
    if isinstance(item, dict) and isinstance(item.get("name"), str):
        options = {str(k): _text(v) for k, v in item.items() if k != "name"}
        if options.get("enable_cuda_graph", "").lower() in ("true", "1"):
            # A captured graph replays on the device addresses of its first run; the
            # backend hands ONNX Runtime new buffers each batch (docs/gpu.md, CUDA graphs).
            raise fail(
                f"providers[{index}].enable_cuda_graph",
                "CUDA graphs need inputs and outputs kept at fixed device addresses, "
                "which this backend does not do yet (docs/gpu.md)",
            )
        return Provider(item["name"], options)
    raise fail(f"providers[{index}]", "must be a provider name or a table with a 'name'")


def _text(value: Any) -> str:
    # ONNX Runtime takes option values as strings; TOML booleans become "True"/"False".
    return str(value)


def _flag(runner: Mapping[str, Any], key: str, fail: Any) -> bool:
    value = runner.get(key, False)
    if not isinstance(value, bool):
        raise fail(key, "must be true or false")
    return value


def _count(runner: Mapping[str, Any], key: str, fail: Any) -> int | None:
    value = runner.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise fail(key, "must be an integer >= 0 (0: ONNX Runtime's default)")
    return value


def _warmup(raw: Any, fail: Any) -> Warmup | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise fail("warmup", "must be a table: { runs = 1, batch_size = 1, inputs = {...} }")
    runs, batch = raw.get("runs", 1), raw.get("batch_size", 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (runs, batch)):
        raise fail("warmup", "runs and batch_size must be integers >= 1")
    inputs = {}
    for name, spec in (raw.get("inputs") or {}).items():
        shape, datatype = (
            (spec.get("shape"), spec.get("datatype")) if isinstance(spec, dict) else (None, None)
        )
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise fail(f"warmup.inputs.{name}.shape", "must be a list of non-negative integers")
        if datatype not in V2_TO_NUMPY:
            raise fail(f"warmup.inputs.{name}.datatype", f"must be one of {', '.join(V2_TO_NUMPY)}")
        inputs[str(name)] = WarmupInput(tuple(shape), datatype)
    return Warmup(runs, batch, inputs)


def cache_dir() -> Path:
    """Where derived files (optimized models, engines) go: never the watched folders."""
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "plugserve")
    return Path(base)
