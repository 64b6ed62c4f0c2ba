"""gRPC's ``ModelInferRequest`` into the request the chains run, their outputs back out.

Inputs arrive either as ``raw_input_contents`` (one entry per input, in input
order, laid out as the binary tensor extension lays them: little-endian,
row-major, ``BYTES`` length-prefixed) or as typed ``contents``; both are checked
against the same limits as HTTP's, by the same code (``server/triton/requests.py``), and
raw ones are read without a copy. Outputs always go back as
``raw_output_contents``, as Triton answers, which every Triton client reads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from plugserve.registry.errors import InvalidInput, PayloadTooLarge
from plugserve.registry.tensors.datatypes import V2_TO_NUMPY, v2_datatype
from plugserve.server.config import Limits
from plugserve.server.grpc_api.generated import grpc_service_pb2 as pb
from plugserve.server.triton.classification import class_count
from plugserve.server.triton.requests import (
    InferRequest,
    RequestedOutput,
    SharedInput,
    check_name,
    element_count,
    from_binary,
    select_outputs,
    shared_memory_ref,
    to_binary,
)

CONTENTS_FIELD = {
    "BOOL": ("bool_contents", np.bool_),
    "INT8": ("int_contents", np.int32),
    "INT16": ("int_contents", np.int32),
    "INT32": ("int_contents", np.int32),
    "INT64": ("int64_contents", np.int64),
    "UINT8": ("uint_contents", np.uint32),
    "UINT16": ("uint_contents", np.uint32),
    "UINT32": ("uint_contents", np.uint32),
    "UINT64": ("uint64_contents", np.uint64),
    "FP32": ("fp32_contents", np.float32),
    "FP64": ("fp64_contents", np.float64),
    "BYTES": ("bytes_contents", np.object_),
}
"""Which typed field of ``InferTensorContents`` carries a datatype, and the field's own
element type (FP16 has none: raw only)."""


def parameters(given: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    """A ``map<string, InferParameter>`` as the plain values HTTP's JSON parameters hold."""
    out: dict[str, Any] = {}
    for key, parameter in given.items():
        which = parameter.WhichOneof("parameter_choice")
        out[key] = None if which is None else getattr(parameter, which)
    return out


def set_parameter(target: pb.InferParameter, value: Any) -> None:
    """Write a plain value into an ``InferParameter`` (the type picks the field)."""
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        if value < 1 << 63:
            target.int64_param = value
        else:
            target.uint64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = str(value)


def decode(request: pb.ModelInferRequest, limits: Limits) -> InferRequest:
    """The request the chain runs; :class:`InvalidInput` for anything malformed."""
    tensors = list(request.inputs)  # each field read once: a read makes Python objects
    if not tensors:
        raise InvalidInput("'inputs' must be a non-empty list")
    if len(tensors) > limits.max_inputs:
        raise InvalidInput(f"{len(tensors)} inputs; at most {limits.max_inputs} (max_inputs)")
    for tensor in tensors:  # before any message quotes a name
        check_name(tensor.name, "input")
    requested = list(request.outputs)
    for output in requested:
        check_name(output.name, "output")
    raw = request.raw_input_contents
    # Inputs in shared memory have no raw entry (tritonclient sends none for them).
    shared_refs = [
        shared_memory_ref(parameters(t.parameters), f"input {t.name!r}") if t.parameters else None
        for t in tensors
    ]
    carried = len(tensors) - sum(ref is not None for ref in shared_refs)
    if raw:  # Triton's words, which its clients check
        for tensor in tensors:
            if tensor.HasField("contents"):
                raise InvalidInput(
                    "contents field must not be specified when using raw_input_contents for "
                    f"{tensor.name!r} for model {request.model_name!r}"
                )
    if raw and len(raw) != carried:
        raise InvalidInput(
            f"raw_input_contents has {len(raw)} entries for {carried} inputs: one per input "
            "not in shared memory, in order, or none"
        )
    inputs: dict[str, np.ndarray] = {}
    shared: dict[str, SharedInput] = {}
    contents = iter(raw)
    for index, (tensor, ref) in enumerate(zip(tensors, shared_refs, strict=True)):
        name = tensor.name
        if name in inputs or name in shared:
            raise InvalidInput(f"input {name!r} appears twice")
        if ref is not None:
            shape = _shape(tensor, limits)
            if tensor.HasField("contents"):
                raise InvalidInput(f"input {name!r} is in shared memory: it takes no contents")
            shared[name] = SharedInput(ref, tensor.datatype, tuple(shape), index)
        else:
            inputs[name] = _input(tensor, next(contents) if raw else None, limits)
    outputs = []
    for output in requested:
        given = parameters(output.parameters) if output.parameters else {}
        where = f"output {output.name!r}"
        ref, count = shared_memory_ref(given, where), class_count(given, where)
        outputs.append(RequestedOutput(output.name, True, ref, given, count))
    if len({o.name for o in outputs}) != len(outputs):
        raise InvalidInput("an output is requested more than once")
    return InferRequest(
        inputs,
        request.id or None,
        parameters(request.parameters) if request.parameters else {},
        outputs or None,
        shared,
    )


def _shape(tensor: pb.ModelInferRequest.InferInputTensor, limits: Limits) -> list[int]:
    """The input's shape, its datatype known and both within ``limits``."""
    name, datatype = tensor.name, tensor.datatype
    if datatype not in V2_TO_NUMPY:
        known = ", ".join(V2_TO_NUMPY)
        raise InvalidInput(f"input {name!r}: datatype {datatype!r} is not supported ({known})")
    shape = list(tensor.shape)
    if any(d < 0 for d in shape):
        raise InvalidInput(f"input {name!r}: 'shape' must be a list of non-negative integers")
    element_count(name, datatype, shape, limits)
    return shape


def _input(
    tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None, limits: Limits
) -> np.ndarray:
    name, datatype = tensor.name, tensor.datatype
    shape = _shape(tensor, limits)
    count = math.prod(shape)
    if raw is not None:
        return from_binary(name, datatype, shape, count, memoryview(raw))
    typed = CONTENTS_FIELD.get(datatype)
    if typed is None:
        raise InvalidInput(f"input {name!r}: {datatype} travels in raw_input_contents only")
    field, wire = typed
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InvalidInput(
            f"input {name!r}: shape {shape} needs {count} elements, the contents have {len(values)}"
        )
    # Each typed value becomes a Python object on its way into numpy, on the event loop:
    # bounded as BYTES elements are (a large tensor goes raw, as tritonclient sends it).
    if count > limits.max_bytes_elements:
        raise PayloadTooLarge(
            f"input {name!r} has {count} typed contents elements; at most "
            f"{limits.max_bytes_elements} (max_bytes_elements): send it as raw_input_contents"
        )
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array.reshape(shape)
    dtype = V2_TO_NUMPY[datatype]
    wide: np.ndarray = np.array(values, dtype=wire)  # exact: the field's own type holds every value
    array = wide.astype(dtype)
    if dtype != wide.dtype and count and not np.array_equal(array, wide):
        # int_contents is int32: an INT8 value of 300 would wrap silently; refuse it instead.
        raise InvalidInput(f"input {name!r}: a value does not fit {datatype}")
    return array.reshape(shape)


def encode(
    request: InferRequest,
    model_name: str,
    model_version: str,
    outputs: Mapping[str, np.ndarray],
) -> pb.ModelInferResponse:
    """The response: the requested outputs (every one when none was named), raw."""
    response = pb.ModelInferResponse(model_name=model_name, model_version=model_version)
    if request.id is not None:
        response.id = request.id
    shared = {o.name for o in request.outputs or () if o.shared is not None}
    for name, _ in select_outputs(request, outputs):
        array = outputs[name]
        datatype = v2_datatype(array.dtype)
        response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        # One entry per output, an empty one for an output written into shared memory
        # (clients find an output's data by its place among the outputs).
        response.raw_output_contents.append(b"" if name in shared else to_binary(array, datatype))
    return response
