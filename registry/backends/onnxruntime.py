"""The built-in ``onnxruntime`` backend, registered through ``plugserve_backends`` like any other.

A declarative runner::

    [runner]
    backend = "onnxruntime"
    model = "models:iris"                 # or "model.onnx" beside the manifest
    providers = ["CPUExecutionProvider"]  # preference order; default CPU
    intra_op_threads = 2                  # optional; default: the server's choice (cpu_share.py)
    inter_op_threads = 1
    session_config = { "session.intra_op.allow_spinning" = "0" }
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.registry.backends import cpu_share
from plugserve.registry.backends.cpu_share import ThreadChoice
from plugserve.registry.backends.ort_batching import check_batch_axes
from plugserve.registry.backends.ort_gpu import (
    GPU_PROVIDERS,
    TENSORRT_LIBRARIES,
    build_package,
    gpu_fix,
    install_command,
    missing_library,
    preload_gpu_libraries,
    provider_load_error,
)
from plugserve.registry.backends.ort_options import (
    DEFAULT_PROVIDERS,
    RUNNER_KEYS,
    OrtOptions,
    Provider,
    cache_dir,
    parse_options,
)
from plugserve.registry.backends.refusals import ort_refusal
from plugserve.registry.errors import InvalidInput, PluginLoadError
from plugserve.registry.hookspecs import hookimpl
from plugserve.registry.tensors.datatypes import numpy_dtype
from plugserve.registry.tensors.values import cast_exact
from plugserve.registry.types import BackendFactory, PluginInfo

SPINNING = "session.intra_op.allow_spinning"
INTER_SPINNING = "session.inter_op.allow_spinning"

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

    def __init__(
        self,
        session: Any,
        plugin: PluginInfo,
        runtime: Mapping[str, Any] | None = None,
        options: OrtOptions | None = None,
    ) -> None:
        self._session = session
        self._label = plugin.label
        self._runtime = dict(runtime or {})
        self._options = options or OrtOptions()
        self._inputs = [_TensorSpec(i.name, i.type, i.shape) for i in session.get_inputs()]
        self._outputs = [_TensorSpec(o.name, o.type, o.shape) for o in session.get_outputs()]
        self._output_names = [o.name for o in self._outputs]
        self._input_names = {i.name for i in self._inputs}
        self._text_inputs = [i.name for i in self._inputs if i.datatype == "BYTES"]

    @property
    def inputs(self) -> list[_TensorSpec]:
        return self._inputs

    @property
    def outputs(self) -> list[_TensorSpec]:
        return self._outputs

    def metadata(self) -> dict[str, Any]:
        return {
            "inputs": [i.as_dict() for i in self._inputs],
            "outputs": [o.as_dict() for o in self._outputs],
            **self._runtime,
        }

    def warmup(self) -> None:
        """Run the manifest's sample batches (zeros) before taking traffic."""
        spec = self._options.warmup
        if spec is None:
            return
        feed = {}
        for tensor in self._inputs:
            given = spec.inputs.get(tensor.name)
            if given is not None:
                shape, dtype = given.shape, numpy_dtype(given.datatype)
            else:
                dims = [
                    spec.batch_size if i == 0 and d < 0 else max(d, 1)
                    for i, d in enumerate(tensor.shape)
                ]
                shape, dtype = tuple(dims), tensor.dtype or np.dtype(np.float32)
            feed[tensor.name] = (
                np.zeros(shape, dtype=dtype)
                if dtype.kind != "O"
                else np.full(shape, "", dtype=object)
            )
        for _ in range(spec.runs):
            self.infer(feed)

    def validate(self, inputs: Mapping[str, np.ndarray]) -> None:
        """Per request, before batching: ONNX string tensors need UTF-8 text."""
        for name in self._text_inputs:
            array = inputs.get(name)
            if array is None or array.dtype.kind != "O":
                continue
            elements = array.reshape(-1).tolist()
            if _all_utf8(elements):
                continue
            for index, value in enumerate(elements):
                if isinstance(value, bytes) and not _all_utf8([value]):
                    raise InvalidInput(
                        f"{self._label}: input {name!r} element {index} is not UTF-8 text, "
                        "which ONNX string tensors need"
                    )

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        unknown = set(inputs) - self._input_names
        if unknown:
            raise InvalidInput(
                f"{self._label}: unknown input(s) {sorted(unknown)}; "
                f"the model takes {sorted(self._input_names)}"
            )
        feed = {spec.name: self._convert(spec, inputs) for spec in self._inputs}
        try:
            if self._options.io_binding:
                return self._run_bound(feed)
            results = self._session.run(self._output_names, feed)
        except Exception as exc:
            refusal = ort_refusal(exc)
            if refusal is None:
                raise  # the runner's own failure: a 500, counted by its circuit breaker
            raise InvalidInput(
                f"{self._label}: ONNX Runtime refused the inputs: {refusal}"
            ) from None
        return dict(zip(self._output_names, results, strict=True))

    def _run_bound(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run through IOBinding: outputs stay where the provider computed them until copied
        back once. (Output buffers are not reused across batches: the arrays handed to
        responses are still being encoded while the next batch runs.)"""
        binding = self._session.io_binding()
        for name, array in feed.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
        for name in self._output_names:
            binding.bind_output(name)
        self._session.run_with_iobinding(binding)
        return dict(zip(self._output_names, binding.copy_outputs_to_cpu(), strict=True))

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
            try:
                return np.vectorize(_as_text, otypes=[object])(array) if array.size else array
            except UnicodeDecodeError:
                problem = f"{self._label}: input {spec.name!r} is not UTF-8 text"
                raise InvalidInput(problem) from None
        if spec.dtype is None or array.dtype == spec.dtype:
            return array
        try:
            return cast_exact(array, spec.dtype)
        except ValueError as exc:
            raise InvalidInput(f"{self._label}: input {spec.name!r}: {exc}") from None

    def close(self) -> None:
        self._session = None


def _as_text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _choose_providers(ort: Any, options: OrtOptions, plugin: PluginInfo) -> list[Provider]:
    """The requested providers this build of ONNX Runtime has, in order; CPU as the last resort."""
    available = set(ort.get_available_providers())
    chosen = [p for p in options.providers if p.name in available]
    missing = [p.name for p in options.providers if p.name not in available]
    if missing:
        gpu = [name for name in missing if name in GPU_PROVIDERS]
        fix = {"fix": gpu_fix(ort), "onnxruntime": build_package(ort)} if gpu else {}
        if options.require and options.providers[0].name in missing:
            hint = f"; {fix['onnxruntime']} has no GPU providers: {fix['fix']}" if fix else ""
            raise PluginLoadError(
                f"{plugin.label}: provider {options.providers[0].name} is required "
                f"but not available (available: {', '.join(sorted(available))}){hint}"
            )
        plugin.logger.warning(
            "providers_unavailable", missing=missing, using=[p.name for p in chosen], **fix
        )
    if any(p.name in GPU_PROVIDERS for p in chosen):
        failed = preload_gpu_libraries(ort)
        if failed:
            plugin.logger.debug("gpu_libraries_preload", failed=failed)
    return chosen or [Provider(name) for name in DEFAULT_PROVIDERS]


def _fallback(ort: Any, requested: str, used: str, options: OrtOptions, plugin: PluginInfo) -> None:
    """The session did not take ``requested``: say why and how to fix it, or fail if required."""
    reason = provider_load_error(ort, requested) if requested in GPU_PROVIDERS else None
    library = missing_library(reason)
    fields: dict[str, Any] = {"requested": requested, "using": used}
    if requested in GPU_PROVIDERS:
        fields["reason"] = reason or "no usable GPU (no device, or no NVIDIA driver)"
        if library is not None:
            fields["missing_library"] = library
        fields["fix"] = _fix(ort, library)
    if options.require:
        said = "; ".join(f"{k}: {v}" for k, v in fields.items() if k in ("reason", "fix"))
        raise PluginLoadError(
            f"{plugin.label}: provider {requested} is required but the session "
            f"fell back to {used}" + (f" ({said})" if said else " (see ONNX Runtime's log)")
        )
    plugin.logger.warning("provider_fallback", **fields)


def _fix(ort: Any, library: str | None) -> str:
    """The command that brings ``library``, or where to look when none was missing."""
    if library is None:
        return "check nvidia-smi and the driver; plugserve doctor lists the GPU libraries"
    if library.startswith(TENSORRT_LIBRARIES):
        # ONNX Runtime does not search the TensorRT wheel's folder (docs/gpu.md).
        return (
            f"{install_command('tensorrt')}, then its tensorrt_libs folder on "
            "LD_LIBRARY_PATH (plugserve doctor prints it)"
        )
    return gpu_fix(ort)


def thread_choice(options: OrtOptions, instances: int) -> ThreadChoice | None:
    """The intra-op threads to use: the runner's, else chosen from the server's CPU share
    (``registry/backends/cpu_share.py``); ``None``: ONNX Runtime's default (no server)."""
    if options.intra_op_threads is not None:
        spinning = options.session_config.get(SPINNING, "1") != "0"
        return ThreadChoice(options.intra_op_threads, spinning, "runner.intra_op_threads")
    share = cpu_share.current()
    return None if share is None else cpu_share.choose(share, instances)


def _session_options(
    ort: Any, options: OrtOptions, model_path: Path, threads: ThreadChoice | None = None
) -> tuple[Any, Path]:
    """SessionOptions, and the model file to load (an optimized copy when cached)."""
    session = ort.SessionOptions()
    if threads is not None:
        session.intra_op_num_threads = threads.threads
        if not threads.spinning and SPINNING not in options.session_config:
            session.add_session_config_entry(SPINNING, "0")
            session.add_session_config_entry(INTER_SPINNING, "0")
    if options.inter_op_threads is not None:
        session.inter_op_num_threads = options.inter_op_threads
    levels = ort.GraphOptimizationLevel
    level = {
        "disable": levels.ORT_DISABLE_ALL,
        "basic": levels.ORT_ENABLE_BASIC,
        "extended": levels.ORT_ENABLE_EXTENDED,
        "all": levels.ORT_ENABLE_ALL,
    }.get(options.graph_optimization_level or "all")
    session.graph_optimization_level = level
    for key, value in options.session_config.items():
        session.add_session_config_entry(key, value)
    if not options.optimized_model_cache:
        return session, model_path
    digest = hashlib.sha256(model_path.read_bytes()).hexdigest()[:16]
    providers = "-".join(p.name.removesuffix("ExecutionProvider") for p in options.providers)
    level_name = options.graph_optimization_level or "all"
    cached = (
        cache_dir() / "onnxruntime" / f"{digest}-{level_name}-{providers}-{ort.__version__}.onnx"
    )
    if cached.is_file():
        session.graph_optimization_level = levels.ORT_DISABLE_ALL  # already optimized
        return session, cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    session.optimized_model_filepath = str(cached)
    return session, model_path


def create_runner(
    plugin: PluginInfo, runner: Mapping[str, Any], model_path: Path | None
) -> OnnxRuntimeRunner:
    """The ``onnxruntime`` backend factory."""
    try:
        import onnxruntime as ort  # imported on first use: importing plugserve stays light
    except ImportError as exc:
        raise PluginLoadError(
            f"{plugin.label}: ONNX Runtime is not installed ({exc}): "
            f"{install_command('cpu')}, or {install_command('gpu')} for NVIDIA GPUs"
        ) from None

    if model_path is None:
        raise PluginLoadError(f"{plugin.label}: the onnxruntime backend needs [runner] model")
    options = parse_options(runner, plugin.label)
    providers = _choose_providers(ort, options, plugin)
    threads = thread_choice(options, _instances(runner))
    session_options, source = _session_options(ort, options, model_path, threads)
    session = ort.InferenceSession(
        str(source),
        sess_options=session_options,
        providers=[p.name for p in providers],
        provider_options=[dict(p.options) for p in providers],
    )
    used = session.get_providers()
    if used[:1] != [providers[0].name]:
        _fallback(ort, providers[0].name, used[0], options, plugin)
    serving = (
        next(p for p in providers if p.name == used[0])
        if used[0] in {p.name for p in providers}
        else Provider(used[0])
    )
    runtime: dict[str, Any] = {
        "requested_providers": [p.name for p in options.providers],
        "providers": list(used),
        "device": options.device or serving.device,
    }
    if threads is not None:
        runtime["threads"] = threads.as_json()
    plugin.logger.info("onnx_session_created", model=str(source), **runtime)
    created = OnnxRuntimeRunner(session, plugin, runtime, options)
    try:
        check_batch_axes(plugin, runner, created.inputs, created.outputs, created.infer)
    except PluginLoadError:
        created.close()
        raise
    return created


def _instances(runner: Mapping[str, Any]) -> int:
    """The runner's concurrent executions (``instances``; the manifest checked it)."""
    value = runner.get("instances", 1)
    return value if isinstance(value, int) and value > 0 else 1


create_runner.model_filename = "model.onnx"  # type: ignore[attr-defined]  # factories may carry it
create_runner.runner_keys = RUNNER_KEYS  # type: ignore[attr-defined]  # the [runner] keys it reads


@hookimpl
def plugserve_backends() -> dict[str, BackendFactory]:
    return {"onnxruntime": create_runner}


def _all_utf8(elements: list[Any]) -> bool:
    """Whether every ``bytes`` element is UTF-8, in one decode: joined by NUL, which no
    multi-byte sequence holds, two broken halves can never pass as one character."""
    try:
        b"\0".join(e for e in elements if isinstance(e, bytes)).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
