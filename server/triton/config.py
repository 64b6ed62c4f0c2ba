"""Triton's model configuration of a route, derived from its chain and runner manifest.

The answer is the JSON form of Triton's ``inference.ModelConfig``
(``model_config.proto``), field names as the proto spells them (snake_case,
as Triton's HTTP answers use them): ``json_format.ParseDict`` turns it into the
message a gRPC answer carries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plugserve.registry.execution.chain import Chain
from plugserve.registry.manifest import RunnerSection

PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "tensorrt": "tensorrt_plan"}
"""Triton's ``platform`` of the backends that have one; any other runner is its backend's."""
PYTHON_BACKEND = "python"
"""The backend of a runner with a module of its own (no ``[runner] backend``)."""
GPU_PROVIDERS = frozenset({"CUDAExecutionProvider", "TensorrtExecutionProvider"})


def data_type(datatype: str) -> str:
    """Triton's ``DataType`` name of a v2 datatype: ``FP32`` is ``TYPE_FP32``, ``BYTES``
    ``TYPE_STRING``; an unknown one ``TYPE_INVALID``."""
    if datatype == "BYTES":
        return "TYPE_STRING"
    known = {"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}
    if datatype in known or datatype in {"FP16", "FP32", "FP64", "BF16"}:
        return f"TYPE_{datatype}"
    return "TYPE_INVALID"


def model_config(chain: Chain) -> dict[str, Any]:
    """The model configuration of the route ``chain`` serves, as Triton's JSON.

    Inputs are the first stage's, outputs the last stage's (as in the model
    metadata); without batching (``max_batch_size`` 0) ``dims`` is the whole
    shape, with it the shape after the batch dimension. A streaming route is
    ``model_transaction_policy: {decoupled: true}``, as Triton shows a decoupled model.
    """
    runner = chain.runner.manifest.runner or RunnerSection()
    specs = chain.metadata()
    batching = runner.max_batch_size > 0
    config: dict[str, Any] = {
        "name": chain.route,
        **_platform(runner),
        "version_policy": {"all": {}},
        "max_batch_size": runner.max_batch_size,
        "input": [_tensor(spec, batching, format=runner.formats) for spec in specs["inputs"]],
        "output": [_tensor(spec, batching, labels=runner.label_files) for spec in specs["outputs"]],
        "instance_group": [_instances(chain.route, runner)],
    }
    if batching:
        config["dynamic_batching"] = _dynamic_batching(runner)
    if chain.streaming:  # Triton's decoupled model: several responses to one request
        config["model_transaction_policy"] = {"decoupled": True}
    return config


def _platform(runner: RunnerSection) -> dict[str, str]:
    backend = runner.backend or PYTHON_BACKEND
    platform = PLATFORMS.get(backend)
    return {"platform": platform, "backend": backend} if platform else {"backend": backend}


def _tensor(
    spec: Mapping[str, Any],
    batching: bool,
    format: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """One ``ModelInput`` or ``ModelOutput``; an undeclared or odd dimension is ``-1``."""
    name = str(spec.get("name", ""))
    shape = spec.get("shape")
    dims = [
        d if isinstance(d, int) and not isinstance(d, bool) else -1
        for d in (shape if isinstance(shape, list | tuple) else [-1])
    ]
    if batching and dims:
        dims = dims[1:]
    tensor: dict[str, Any] = {
        "name": name,
        "data_type": data_type(str(spec.get("datatype", ""))),
        "dims": dims,
    }
    if format is not None:
        tensor["format"] = format.get(name, "FORMAT_NONE")
    if labels is not None and name in labels:
        tensor["label_filename"] = labels[name]
    return tensor


def _instances(route: str, runner: RunnerSection) -> dict[str, Any]:
    """One instance group: ``instances`` copies, on the runner's GPUs when it has any."""
    group: dict[str, Any] = {"name": route, "count": runner.instances, "kind": "KIND_CPU"}
    if runner.devices:
        group["kind"] = "KIND_GPU"
        group["gpus"] = sorted({int(d.split(":", 1)[1]) for d in runner.devices})
    elif runner.backend == "tensorrt" or GPU_PROVIDERS & set(runner.providers):
        group["kind"] = "KIND_GPU"
    return group


def _dynamic_batching(runner: RunnerSection) -> dict[str, Any]:
    batching: dict[str, Any] = {
        "preferred_batch_size": list(runner.preferred_batch_sizes),
        "max_queue_delay_microseconds": round(runner.max_queue_delay_ms * 1000),
    }
    if runner.priority_levels > 1:
        batching["priority_levels"] = runner.priority_levels
        batching["default_priority_level"] = runner.default_priority_level or runner.priority_levels
    return batching
