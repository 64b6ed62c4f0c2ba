"""A fake ``tensorrt`` (TensorRT 10 Python API) and ``cuda.cudart`` for machines without a GPU.

It follows the real call signatures and return conventions the backend uses
(``(err, value)`` tuples from cudart, ``None`` from a failed build or
deserialize, ``execute_async_v3(stream) -> bool``), keeps "device" memory in a
dict of bytearrays reached through raw host pointers, and executes an engine by
running its ONNX model on ONNX Runtime, so outputs can be checked for real.
Mocked because TensorRT cannot be installed here and no GPU is attached.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import json
import types
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from plugserve.registry.backends.refusals import ort_refusal

# -- cuda.cudart -----------------------------------------------------------------------


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2


class FakeCudart:
    def __init__(self) -> None:
        self.memory: dict[int, bytearray] = {}
        self.streams: set[int] = set()
        self._next = itertools.count(0x1000, 0x1000)
        self.cudaError_t = cudaError_t
        self.cudaMemcpyKind = cudaMemcpyKind
        self.device = -1

    def cudaSetDevice(self, device: int) -> tuple[cudaError_t]:
        self.device = device
        return (cudaError_t.cudaSuccess,)

    def cudaGetDeviceProperties(self, device: int) -> tuple[cudaError_t, Any]:
        return cudaError_t.cudaSuccess, types.SimpleNamespace(name=b"Fake H200", major=9, minor=0)

    def cudaMalloc(self, size: int) -> tuple[cudaError_t, int]:
        pointer = next(self._next)
        self.memory[pointer] = bytearray(size)
        return cudaError_t.cudaSuccess, pointer

    def cudaFree(self, pointer: int) -> tuple[cudaError_t]:
        if self.memory.pop(pointer, None) is None:
            return (cudaError_t.cudaErrorInvalidValue,)
        return (cudaError_t.cudaSuccess,)

    def cudaStreamCreate(self) -> tuple[cudaError_t, int]:
        stream = next(self._next)
        self.streams.add(stream)
        return cudaError_t.cudaSuccess, stream

    def cudaStreamDestroy(self, stream: int) -> tuple[cudaError_t]:
        self.streams.discard(stream)
        return (cudaError_t.cudaSuccess,)

    def cudaStreamSynchronize(self, stream: int) -> tuple[cudaError_t]:
        return (
            cudaError_t.cudaSuccess
            if stream in self.streams
            else cudaError_t.cudaErrorInvalidValue,
        )

    def cudaMemcpyAsync(
        self, dst: int, src: int, count: int, kind: cudaMemcpyKind, stream: int
    ) -> tuple[cudaError_t]:
        if kind == cudaMemcpyKind.cudaMemcpyHostToDevice:
            self.memory[dst][:count] = ctypes.string_at(src, count)
        else:
            ctypes.memmove(dst, bytes(self.memory[src][:count]), count)
        return (cudaError_t.cudaSuccess,)

    def read(self, pointer: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape)) * dtype.itemsize
        return np.frombuffer(bytes(self.memory[pointer][:count]), dtype=dtype).reshape(shape)

    def write(self, pointer: int, array: np.ndarray) -> None:
        self.memory[pointer][: array.nbytes] = array.tobytes()


# -- tensorrt --------------------------------------------------------------------------


class DataType(enum.Enum):
    FLOAT = np.float32
    HALF = np.float16
    INT32 = np.int32
    INT64 = np.int64
    INT8 = np.int8
    BOOL = np.bool_


class TensorIOMode(enum.Enum):
    INPUT = 1
    OUTPUT = 2


class MemoryPoolType(enum.Enum):
    WORKSPACE = 0


class BuilderFlag(enum.Enum):
    FP16 = 0


_ONNX_TO_TRT = {
    onnx.TensorProto.FLOAT: DataType.FLOAT, onnx.TensorProto.FLOAT16: DataType.HALF,
    onnx.TensorProto.INT32: DataType.INT32, onnx.TensorProto.INT64: DataType.INT64,
    onnx.TensorProto.INT8: DataType.INT8, onnx.TensorProto.BOOL: DataType.BOOL,
}  # fmt: skip


class Logger:
    WARNING = 2
    INFO = 3

    def __init__(self, severity: int = 2) -> None:
        self.severity = severity


class _Tensor:
    def __init__(self, name: str, dtype: DataType, shape: list[int]) -> None:
        self.name, self.dtype, self.shape = name, dtype, shape


def _tensors(model: onnx.ModelProto, which: str) -> list[_Tensor]:
    out = []
    for value in getattr(model.graph, which):
        dims = [
            d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim
        ]
        out.append(_Tensor(value.name, _ONNX_TO_TRT[value.type.tensor_type.elem_type], dims))
    return out


class NetworkDefinition:
    def __init__(self) -> None:
        self.onnx: bytes | None = None
        self.inputs: list[_Tensor] = []

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    def get_input(self, index: int) -> _Tensor:
        return self.inputs[index]


class OnnxParser:
    def __init__(self, network: NetworkDefinition, logger: Logger) -> None:
        self.network = network
        self.errors: list[str] = []

    def parse(self, model: bytes) -> bool:
        try:
            parsed = onnx.load_from_string(model)
        except Exception as exc:
            self.errors.append(f"ModelImporter: {exc}")
            return False
        self.network.onnx = model
        self.network.inputs = _tensors(parsed, "input")
        return True

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, index: int) -> str:
        return self.errors[index]


class OptimizationProfile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple[list[int], list[int], list[int]]] = {}

    def set_shape(self, name: str, low: Any, opt: Any, high: Any) -> None:
        self.shapes[name] = (list(low), list(opt), list(high))


class BuilderConfig:
    def __init__(self) -> None:
        self.flags: set[BuilderFlag] = set()
        self.profiles: list[OptimizationProfile] = []
        self.pool: dict[MemoryPoolType, int] = {}

    def set_memory_pool_limit(self, pool: MemoryPoolType, size: int) -> None:
        self.pool[pool] = size

    def set_flag(self, flag: BuilderFlag) -> None:
        self.flags.add(flag)

    def add_optimization_profile(self, profile: OptimizationProfile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1


class HostMemory:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def __bytes__(self) -> bytes:
        return self.data


BUILDS: list[dict[str, Any]] = []  # every build_serialized_network call, for the tests


class Builder:
    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def create_network(self, flags: int = 0) -> NetworkDefinition:
        return NetworkDefinition()

    def create_builder_config(self) -> BuilderConfig:
        return BuilderConfig()

    def create_optimization_profile(self) -> OptimizationProfile:
        return OptimizationProfile()

    def build_serialized_network(
        self, network: NetworkDefinition, config: BuilderConfig
    ) -> HostMemory | None:
        shapes = config.profiles[0].shapes if config.profiles else {}
        if any(-1 in t.shape and t.name not in shapes for t in network.inputs):
            return None  # TensorRT refuses dynamic inputs without a profile
        assert network.onnx is not None
        BUILDS.append({"fp16": BuilderFlag.FP16 in config.flags, "profile": shapes})
        header = json.dumps({"profile": shapes}).encode()
        return HostMemory(b"FAKEPLAN" + len(header).to_bytes(4, "little") + header + network.onnx)


class ExecutionContext:
    def __init__(self, engine: CudaEngine) -> None:
        self.engine = engine
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def set_input_shape(self, name: str, shape: Any) -> bool:
        low, _, high = self.engine.profile.get(
            name, ([0] * len(shape), None, [1 << 30] * len(shape))
        )
        if not all(a <= s <= b for a, s, b in zip(low, shape, high, strict=True)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        self.addresses[name] = address
        return True

    def _inputs(self, cuda: FakeCudart | None) -> dict[str, np.ndarray]:
        feed = {}
        for t in self.engine.inputs:
            dtype = np.dtype(t.dtype.value)
            shape = self.shapes[t.name]
            feed[t.name] = (
                cuda.read(self.addresses[t.name], dtype, shape) if cuda else np.zeros(shape, dtype)
            )
        return feed

    def infer_shapes(self) -> list[str]:
        """TensorRT's: the inputs whose shapes are not set yet; a RuntimeError when the set
        shapes are inconsistent (ONNX Runtime on zeros of those shapes says whether they are)."""
        unset = [t.name for t in self.engine.inputs if t.name not in self.shapes]
        if unset:
            return unset
        try:
            self.engine.session.run(None, self._inputs(None))
        except Exception as exc:
            said = ort_refusal(exc) or type(exc).__name__
            raise RuntimeError(f"Error Code 4: Shape Error ({said})") from None
        return []

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        if name in self.shapes:
            return self.shapes[name]
        outputs = self.engine.session.run([name], self._inputs(None))
        return tuple(outputs[0].shape)

    def execute_async_v3(self, stream_handle: int) -> bool:
        cuda = CUDART
        if stream_handle not in cuda.streams:
            return False
        names = [t.name for t in self.engine.outputs]
        for name, value in zip(
            names, self.engine.session.run(names, self._inputs(cuda)), strict=True
        ):
            cuda.write(self.addresses[name], np.ascontiguousarray(value))
        self.engine.executions += 1
        return True


class CudaEngine:
    def __init__(self, profile: dict[str, Any], model: bytes) -> None:
        parsed = onnx.load_from_string(model)
        self.inputs, self.outputs = _tensors(parsed, "input"), _tensors(parsed, "output")
        self.profile = profile
        self.session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        self.executions = 0

    @property
    def num_io_tensors(self) -> int:
        return len(self.inputs) + len(self.outputs)

    def _all(self) -> list[_Tensor]:
        return self.inputs + self.outputs

    def get_tensor_name(self, index: int) -> str:
        return self._all()[index].name

    def _get(self, name: str) -> _Tensor:
        return next(t for t in self._all() if t.name == name)

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return TensorIOMode.INPUT if self._get(name) in self.inputs else TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name: str) -> DataType:
        return self._get(name).dtype

    def get_tensor_shape(self, name: str) -> list[int]:
        return list(self._get(name).shape)

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> tuple[list[int], ...]:
        return tuple(self.profile[name])

    def create_execution_context(self) -> ExecutionContext:
        return ExecutionContext(self)


class Runtime:
    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def deserialize_cuda_engine(self, data: bytes) -> CudaEngine | None:
        if not data.startswith(b"FAKEPLAN"):
            return None
        size = int.from_bytes(data[8:12], "little")
        header = json.loads(data[12 : 12 + size])
        return CudaEngine(header["profile"], data[12 + size :])


def nptype(dtype: DataType) -> type:
    return dtype.value


CUDART = FakeCudart()


def install(monkeypatch: Any) -> tuple[types.ModuleType, FakeCudart]:
    """Put the fakes in ``sys.modules`` as ``tensorrt`` and ``cuda.bindings.runtime``."""
    global CUDART
    CUDART = FakeCudart()
    BUILDS.clear()
    trt = types.ModuleType("tensorrt")
    for name in ("DataType", "TensorIOMode", "MemoryPoolType", "BuilderFlag", "Logger", "Builder",
                 "OnnxParser", "Runtime", "nptype"):  # fmt: skip
        setattr(trt, name, globals()[name])
    trt.__version__ = "10.0.1-fake"  # type: ignore[attr-defined]
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = CUDART  # type: ignore[attr-defined]
    cuda.bindings = bindings  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "tensorrt", trt)
    monkeypatch.setitem(__import__("sys").modules, "cuda", cuda)
    monkeypatch.setitem(__import__("sys").modules, "cuda.bindings", bindings)
    monkeypatch.setitem(__import__("sys").modules, "cuda.bindings.runtime", CUDART)
    return trt, CUDART
