"""The built-in ``tensorrt`` backend (TensorRT 10 Python API, memory through cuda-python).

```toml
[runner]
backend = "tensorrt"
model = "models:resnet"        # a .plan engine is deserialized; a .onnx model is built
device_id = 0
fp16 = true                    # builder flag, when building from ONNX
workspace_mb = 1024
# One optimization profile: required for every input with a dynamic dimension.
profile = { x = { min = [1, 3, 224, 224], opt = [8, 3, 224, 224], max = [32, 3, 224, 224] } }
```

An engine built from ONNX is cached beside the model as a dot file
(``.model.<key>.plan``, which the watcher and fingerprints ignore, so writing it
reloads nothing), or in the cache dir when the model folder is read-only. The
key covers the model's bytes, the GPU (name and compute capability), the
TensorRT version, the profile and the builder flags.

Importing this module never imports TensorRT: only loading a ``tensorrt``
runner does, and without the ``plugserve[tensorrt]`` extra that load fails with
an error saying so. Verified here only through a fake ``tensorrt`` module that
follows the real API (``tests/registry/backends/fake_tensorrt.py``); the real
thing is checked by ``tests/gpu/check_tensorrt.py`` on a GPU machine.
"""

from __future__ import annotations

import hashlib
import json
import queue
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from plugserve.registry.backends.ort_options import cache_dir
from plugserve.registry.backends.refusals import trimmed
from plugserve.registry.errors import InvalidInput, PluginLoadError
from plugserve.registry.hookspecs import hookimpl
from plugserve.registry.tensors.datatypes import v2_datatype
from plugserve.registry.types import BackendFactory, PluginInfo

EXTRA = "pip install 'plugserve[tensorrt]'"


def import_tensorrt(label: str) -> tuple[Any, Any]:
    """``(tensorrt, cudart)``, or a :class:`PluginLoadError` naming the extra to install."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise PluginLoadError(
            f"{label}: the tensorrt backend needs TensorRT: {EXTRA} ({exc})"
        ) from None
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError as exc:
            raise PluginLoadError(
                f"{label}: the tensorrt backend needs cuda-python: {EXTRA} ({exc})"
            ) from None
    return trt, cudart


class Cuda:
    """The few CUDA runtime calls the backend makes, each checked."""

    def __init__(self, cudart: Any) -> None:
        self.rt = cudart

    def _ok(self, result: Any) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != self.rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"CUDA error {err}")
        return rest[0] if len(rest) == 1 else tuple(rest)

    def set_device(self, device: int) -> None:
        self._ok(self.rt.cudaSetDevice(device))

    def gpu_key(self, device: int) -> str:
        props = self._ok(self.rt.cudaGetDeviceProperties(device))
        name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
        return f"{name.strip()}-sm{props.major}{props.minor}"

    def malloc(self, nbytes: int) -> int:
        return int(self._ok(self.rt.cudaMalloc(max(nbytes, 1))))

    def free(self, pointer: int) -> None:
        self._ok(self.rt.cudaFree(pointer))

    def stream(self) -> Any:
        return self._ok(self.rt.cudaStreamCreate())

    def destroy(self, stream: Any) -> None:
        self._ok(self.rt.cudaStreamDestroy(stream))

    def to_device(self, pointer: int, array: np.ndarray, stream: Any) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._ok(self.rt.cudaMemcpyAsync(pointer, array.ctypes.data, array.nbytes, kind, stream))

    def to_host(self, array: np.ndarray, pointer: int, stream: Any) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._ok(self.rt.cudaMemcpyAsync(array.ctypes.data, pointer, array.nbytes, kind, stream))

    def sync(self, stream: Any) -> None:
        self._ok(self.rt.cudaStreamSynchronize(stream))


@dataclass(frozen=True)
class TrtOptions:
    KEYS: ClassVar[frozenset[str]] = frozenset({"device_id", "fp16", "workspace_mb", "profile"})
    """The ``[runner]`` keys this backend reads, declared as its factory's ``runner_keys``."""

    device_id: int = 0
    fp16: bool = False
    workspace_mb: int = 1024
    profile: Mapping[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=dict
    )

    @classmethod
    def parse(cls, runner: Mapping[str, Any], label: str) -> TrtOptions:
        def fail(key: str, message: str) -> PluginLoadError:
            return PluginLoadError(f"{label}: runner.{key}: {message}")

        profile = {}
        for name, spec in (runner.get("profile") or {}).items():
            try:
                shapes = tuple(tuple(int(d) for d in spec[k]) for k in ("min", "opt", "max"))
            except (KeyError, TypeError, ValueError):
                raise fail(f"profile.{name}", "needs min, opt and max shapes") from None
            low, opt, high = shapes
            if not len(low) == len(opt) == len(high) or not all(
                a <= b <= c for a, b, c in zip(low, opt, high, strict=True)
            ):
                raise fail(f"profile.{name}", "needs min <= opt <= max, of one rank")
            profile[str(name)] = (low, opt, high)
        device, workspace = runner.get("device_id", 0), runner.get("workspace_mb", 1024)
        if not isinstance(device, int) or device < 0:
            raise fail("device_id", "must be an integer >= 0")
        if not isinstance(workspace, int) or workspace < 1:
            raise fail("workspace_mb", "must be an integer >= 1")
        return cls(device, bool(runner.get("fp16", False)), workspace, profile)


def engine_bytes(
    trt: Any, cuda: Cuda, model: Path, options: TrtOptions, logger: Any, label: str
) -> bytes:
    """The serialized engine: the .plan itself, a cached build, or a fresh build (then cached)."""
    if model.suffix != ".onnx":
        return model.read_bytes()
    key_source = {
        "model": hashlib.sha256(model.read_bytes()).hexdigest(),
        "gpu": cuda.gpu_key(options.device_id),
        "tensorrt": trt.__version__,
        "profile": {k: list(map(list, v)) for k, v in sorted(options.profile.items())},
        "fp16": options.fp16,
        "workspace_mb": options.workspace_mb,
    }
    key = hashlib.sha256(json.dumps(key_source, sort_keys=True).encode()).hexdigest()[:16]
    beside = model.with_name(f".{model.stem}.{key}.plan")
    elsewhere = cache_dir() / "tensorrt" / f"{model.stem}.{key}.plan"
    for path in (beside, elsewhere):
        if path.is_file():
            return path.read_bytes()
    data = _build(trt, model, options, logger, label)
    for path in (beside, elsewhere):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.with_name(f".{path.name}.tmp")
            staging.write_bytes(data)
            staging.rename(path)
            break
        except OSError:
            continue
    return data


def _build(trt: Any, model: Path, options: TrtOptions, logger: Any, label: str) -> bytes:
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(model.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise PluginLoadError(f"{label}: TensorRT cannot parse {model.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mb << 20)
    if options.fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    dynamic = []
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        if any(d < 0 for d in tensor.shape):
            dynamic.append(tensor.name)
    missing = [name for name in dynamic if name not in options.profile]
    if missing:
        raise PluginLoadError(
            f"{label}: input(s) {missing} have dynamic dimensions: give runner.profile.<name> "
            "= { min = [...], opt = [...], max = [...] }"
        )
    if dynamic:
        profile = builder.create_optimization_profile()
        for name in dynamic:
            profile.set_shape(name, *options.profile[name])
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise PluginLoadError(f"{label}: TensorRT could not build an engine from {model.name}")
    return bytes(serialized)


@dataclass(frozen=True)
class _Tensor:
    name: str
    is_input: bool
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    low: tuple[int, ...] | None = None
    high: tuple[int, ...] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": v2_datatype(self.dtype), "shape": list(self.shape)}


class _Slot:
    """One execution context with its stream and device buffers (grown as needed)."""

    def __init__(self, engine: Any, cuda: Cuda) -> None:
        self.context = engine.create_execution_context()
        self.cuda = cuda
        self.stream = cuda.stream()
        self.buffers: dict[str, tuple[int, int]] = {}

    def buffer(self, name: str, nbytes: int) -> int:
        pointer, capacity = self.buffers.get(name, (0, -1))
        if capacity < nbytes:
            if capacity >= 0:
                self.cuda.free(pointer)
            pointer = self.cuda.malloc(nbytes)
            self.buffers[name] = (pointer, nbytes)
        return pointer

    def close(self) -> None:
        for pointer, _ in self.buffers.values():
            self.cuda.free(pointer)
        self.buffers.clear()
        self.cuda.destroy(self.stream)
        self.context = None


class TensorRTRunner:
    """A runner component over one TensorRT engine; ``instances`` contexts run concurrently."""

    def __init__(
        self, trt: Any, cuda: Cuda, engine: Any, options: TrtOptions, label: str, instances: int
    ) -> None:
        self._cuda = cuda
        self._engine = engine
        self._label = label
        self._device = f"cuda:{options.device_id}"
        self._version = trt.__version__
        tensors = []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
            shape = tuple(int(d) for d in engine.get_tensor_shape(name))
            low = high = None
            if is_input and any(d < 0 for d in shape):
                low, _, high = (
                    tuple(int(d) for d in s) for s in engine.get_tensor_profile_shape(name, 0)
                )
            tensors.append(_Tensor(name, is_input, dtype, shape, low, high))
        self._inputs = [t for t in tensors if t.is_input]
        self._outputs = [t for t in tensors if not t.is_input]
        self._slots: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        self._all_slots = [_Slot(engine, cuda) for _ in range(max(1, instances))]
        for slot in self._all_slots:
            self._slots.put(slot)

    def metadata(self) -> dict[str, Any]:
        return {
            "inputs": [t.as_dict() for t in self._inputs],
            "outputs": [t.as_dict() for t in self._outputs],
            "device": self._device,
            "tensorrt": self._version,
        }

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        unknown = set(inputs) - {t.name for t in self._inputs}
        if unknown:
            raise InvalidInput(f"{self._label}: unknown input(s) {sorted(unknown)}")
        arrays = {t.name: self._checked(t, inputs) for t in self._inputs}
        slot = self._slots.get()
        try:
            return self._run(slot, arrays)
        finally:
            self._slots.put(slot)

    def _checked(self, tensor: _Tensor, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        if tensor.name not in inputs:
            raise InvalidInput(f"{self._label}: missing input {tensor.name!r}")
        array = inputs[tensor.name]
        low = tensor.low or tuple(max(d, 0) for d in tensor.shape)
        high = tensor.high or tensor.shape
        if array.ndim != len(tensor.shape) or not all(
            lo <= got <= hi for lo, got, hi in zip(low, array.shape, high, strict=True)
        ):
            raise InvalidInput(
                f"{self._label}: input {tensor.name!r} has shape {list(array.shape)}; "
                f"the engine takes {list(low)} to {list(high)}"
            )
        if not np.can_cast(array.dtype, tensor.dtype, casting="same_kind"):
            taken = f"the engine takes {tensor.dtype}"
            raise InvalidInput(f"{self._label}: input {tensor.name!r} is {array.dtype}, {taken}")
        return np.ascontiguousarray(array, dtype=tensor.dtype)

    def _run(self, slot: _Slot, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        context, cuda, stream = slot.context, self._cuda, slot.stream
        self._shapes(context, arrays)
        for name, array in arrays.items():
            pointer = slot.buffer(name, array.nbytes)
            cuda.to_device(pointer, array, stream)
            context.set_tensor_address(name, pointer)
        outputs = {}
        for tensor in self._outputs:
            out = np.empty(tuple(context.get_tensor_shape(tensor.name)), dtype=tensor.dtype)
            pointer = slot.buffer(tensor.name, out.nbytes)
            context.set_tensor_address(tensor.name, pointer)
            outputs[tensor.name] = (out, pointer)
        if not context.execute_async_v3(stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        for out, pointer in outputs.values():
            cuda.to_host(out, pointer, stream)
        cuda.sync(stream)
        return {name: out for name, (out, _) in outputs.items()}

    def _shapes(self, context: Any, arrays: Mapping[str, np.ndarray]) -> None:
        """Give the context the inputs' shapes and let it infer the outputs'. The engine
        refusing a shape, or finding the shapes inconsistent (inner dimensions of a MatMul
        that differ, say), refuses the request's inputs: :class:`InvalidInput`."""
        for name, array in arrays.items():
            if not context.set_input_shape(name, array.shape):
                raise InvalidInput(
                    f"{self._label}: TensorRT refused shape {list(array.shape)} for input {name!r}"
                )
        try:
            unset = context.infer_shapes()
        except RuntimeError as exc:
            refusal = trimmed(" ".join(str(exc).split()))
            raise InvalidInput(
                f"{self._label}: TensorRT refused the input shapes: {refusal}"
            ) from None
        if unset:
            raise RuntimeError(f"TensorRT left the shapes of {sorted(unset)} unknown")

    def close(self) -> None:
        """Free every device buffer and stream, drop the contexts and the engine."""
        for slot in self._all_slots:
            slot.close()
        self._all_slots.clear()
        self._engine = None


def create_runner(
    plugin: PluginInfo, runner: Mapping[str, Any], model_path: Path | None
) -> TensorRTRunner:
    """The ``tensorrt`` backend factory."""
    trt, cudart = import_tensorrt(plugin.label)
    if model_path is None:
        raise PluginLoadError(f"{plugin.label}: the tensorrt backend needs [runner] model")
    options = TrtOptions.parse(runner, plugin.label)
    cuda = Cuda(cudart)
    cuda.set_device(options.device_id)
    logger = trt.Logger(trt.Logger.WARNING)
    data = engine_bytes(trt, cuda, model_path, options, logger, plugin.label)
    engine = trt.Runtime(logger).deserialize_cuda_engine(data)
    if engine is None:
        raise PluginLoadError(
            f"{plugin.label}: TensorRT could not deserialize the engine of {model_path.name}"
        )
    instances = int(runner.get("instances", 1))
    plugin.logger.info(
        "tensorrt_engine_ready", model=str(model_path), device=f"cuda:{options.device_id}"
    )
    return TensorRTRunner(trt, cuda, engine, options, plugin.label, instances)


create_runner.model_filename = "model.plan"  # type: ignore[attr-defined]  # factories may carry it
create_runner.runner_keys = TrtOptions.KEYS  # type: ignore[attr-defined]  # the [runner] keys it reads


@hookimpl
def plugserve_backends() -> dict[str, BackendFactory]:
    return {"tensorrt": create_runner}
