"""The built-in ``onnxruntime`` backend, registered through ``plugserve_backends`` like any other.

A declarative runner::

    [runner]
    backend = "onnxruntime"
    model = "models:iris"                 # or "model.onnx" beside the manifest
    providers = ["CPUExecutionProvider"]  # preference order; default CPU
    intra_op_threads = 2                  # optional session options
    inter_op_threads = 1
    session_config = { "session.intra_op.allow_spinning" = "0" }
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from registry.datatypes import numpy_dtype
from registry.errors import InvalidInput, PluginLoadError
from registry.hookspecs import hookimpl
from registry.types import BackendFactory, PluginInfo

# ONNX tensor element types as ONNX Runtime names them, and their v2 datatypes.
ONNX_TO_V2 = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
    "tensor(bfloat16)": "BF16",
}

DEFAULT_PROVIDERS = ("CPUExecutionProvider",)


def _dims(shape: list[Any]) -> list[int]:
    # Symbolic or unknown dimensions are dynamic: -1, as in Triton's metadata.
    return [d if isinstance(d, int) and d >= 0 else -1 for d in shape]


class _TensorSpec:
    __slots__ = ("datatype", "dtype", "name", "shape")

    def __init__(self, name: str, onnx_type: str, shape: list[Any]) -> None:
        self.name = name
        self.datatype = ONNX_TO_V2.get(onnx_type, onnx_type)
        self.dtype = numpy_dtype(self.datatype) if self.datatype != "BF16" else None
        self.shape = _dims(shape)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": self.shape}


class OnnxRuntimeRunner:
    """A runner component over one ``onnxruntime.InferenceSession``."""

    def __init__(self, session: Any, plugin: PluginInfo) -> None:
        self._session = session
        self._label = plugin.label
        self._inputs = [_TensorSpec(i.name, i.type, i.shape) for i in session.get_inputs()]
        self._outputs = [_TensorSpec(o.name, o.type, o.shape) for o in session.get_outputs()]
        self._output_names = [o.name for o in self._outputs]
        self._input_names = {i.name for i in self._inputs}

    def metadata(self) -> dict[str, Any]:
        return {
            "inputs": [i.as_dict() for i in self._inputs],
            "outputs": [o.as_dict() for o in self._outputs],
            "providers": list(self._session.get_providers()),
        }

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        unknown = set(inputs) - self._input_names
        if unknown:
            raise InvalidInput(
                f"{self._label}: unknown input(s) {sorted(unknown)}; "
                f"the model takes {sorted(self._input_names)}"
            )
        feed = {spec.name: self._convert(spec, inputs) for spec in self._inputs}
        results = self._session.run(self._output_names, feed)
        return dict(zip(self._output_names, results, strict=True))

    def _convert(self, spec: _TensorSpec, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        array = inputs.get(spec.name)
        if array is None:
            raise InvalidInput(
                f"{self._label}: missing input {spec.name!r}; "
                f"the model takes {sorted(self._input_names)}"
            )
        if len(array.shape) != len(spec.shape) or any(
            want not in (-1, got) for want, got in zip(spec.shape, array.shape, strict=True)
        ):
            raise InvalidInput(
                f"{self._label}: input {spec.name!r} has shape {list(array.shape)}, "
                f"the model takes {spec.shape} (-1: any)"
            )
        if spec.datatype == "BYTES":
            # ONNX Runtime wants str elements; v2 BYTES arrive as bytes.
            return np.vectorize(_as_text, otypes=[object])(array) if array.size else array
        if spec.dtype is None or array.dtype == spec.dtype:
            return array
        if not np.can_cast(array.dtype, spec.dtype, casting="same_kind"):
            raise InvalidInput(
                f"{self._label}: input {spec.name!r} is {array.dtype}, "
                f"the model takes {spec.datatype} and it cannot be converted"
            )
        return array.astype(spec.dtype)

    def close(self) -> None:
        self._session = None


def _as_text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _providers(ort: Any, requested: list[str], plugin: PluginInfo) -> list[str]:
    available = set(ort.get_available_providers())
    chosen = [p for p in requested if p in available]
    missing = [p for p in requested if p not in available]
    if missing:
        plugin.logger.warning("providers_unavailable", missing=missing, using=chosen)
    return chosen or list(DEFAULT_PROVIDERS)


def create_runner(
    plugin: PluginInfo, runner: Mapping[str, Any], model_path: Path | None
) -> OnnxRuntimeRunner:
    """The ``onnxruntime`` backend factory."""
    import onnxruntime as ort  # imported on first use: importing plugserve stays light

    if model_path is None:
        raise PluginLoadError(f"{plugin.label}: the onnxruntime backend needs [runner] model")
    options = ort.SessionOptions()
    if "intra_op_threads" in runner:
        options.intra_op_num_threads = int(runner["intra_op_threads"])
    if "inter_op_threads" in runner:
        options.inter_op_num_threads = int(runner["inter_op_threads"])
    # ONNX Runtime's own session config keys, for example
    # session_config = { "session.intra_op.allow_spinning" = "0" }
    for key, value in dict(runner.get("session_config") or {}).items():
        options.add_session_config_entry(str(key), str(value))
    providers = _providers(ort, list(runner.get("providers") or DEFAULT_PROVIDERS), plugin)
    session = ort.InferenceSession(str(model_path), sess_options=options, providers=providers)
    used = session.get_providers()
    if used[:1] != providers[:1]:
        plugin.logger.warning("provider_fallback", requested=providers, using=used)
    plugin.logger.info("onnx_session_created", model=str(model_path), providers=used)
    return OnnxRuntimeRunner(session, plugin)


create_runner.model_filename = "model.onnx"  # type: ignore[attr-defined]  # factories may carry it


@hookimpl
def plugserve_backends() -> dict[str, BackendFactory]:
    return {"onnxruntime": create_runner}
