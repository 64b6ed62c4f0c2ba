"""A decoded v2 inference request in no wire format, and the tensor rules both wires
share: the limits checked before anything is allocated, tensor names, Triton's binary
tensor layout and shared memory references, the outputs asked for.

HTTP's JSON and binary bodies (``server/http_api/codec.py``) and gRPC's messages
(``server/grpc_api/tensors.py``) decode into :class:`InferRequest`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plugserve.registry.errors import InvalidInput, PayloadTooLarge
from plugserve.registry.tensors.datatypes import V2_TO_NUMPY, v2_datatype
from plugserve.registry.tensors.values import bytes_elements
from plugserve.server.config import Limits

_U32 = struct.Struct("<I")


_LITTLE_ENDIAN = {name: dtype.newbyteorder("<") for name, dtype in V2_TO_NUMPY.items()}
"""Each datatype's dtype as the binary extension lays it out, made once."""


DEFAULT_LIMITS = Limits()


MAX_NAME_CHARS = 1024
"""The longest tensor name a v2 request may use, for an input or an output it asks for
(HTTP and gRPC): no model names a tensor with more, and a longer one (megabytes of
control characters, each six bytes once escaped as JSON) is refused before anything
else is read of it, or echoed in an error message."""


def check_name(name: str, kind: str) -> None:
    """:class:`InvalidInput` for an ``kind`` ("input", "output") name over the bound."""
    if len(name) > MAX_NAME_CHARS:
        raise InvalidInput(f"an {kind} name of {len(name)} characters; at most {MAX_NAME_CHARS}")


SHM_REGION = "shared_memory_region"


SHM_OFFSET = "shared_memory_offset"


SHM_BYTE_SIZE = "shared_memory_byte_size"


@dataclass(frozen=True)
class SharedMemoryRef:
    """Where a tensor's data lies: ``byte_size`` bytes at ``offset`` in a registered region."""

    region: str
    byte_size: int
    offset: int = 0


@dataclass(frozen=True)
class SharedInput:
    """An input whose data is in shared memory: read once the request is decoded."""

    ref: SharedMemoryRef
    datatype: str
    shape: tuple[int, ...]
    index: int
    """Its place among the request's inputs (the order the chain sees them in)."""


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool | None = None
    shared: SharedMemoryRef | None = None
    """Written into this shared memory; the response carries its metadata only."""
    parameters: Mapping[str, Any] = field(default_factory=dict)
    """The output's own parameters (gRPC passes them all; HTTP reads what it knows)."""
    classification: int = 0
    """Triton's classification extension: the top this many classes (0: the tensor itself)."""


@dataclass
class InferRequest:
    """A decoded v2 request: named input arrays, parameters and the outputs asked for."""

    inputs: dict[str, np.ndarray]
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    outputs: list[RequestedOutput] | None = None
    shared_inputs: dict[str, SharedInput] = field(default_factory=dict)
    """Inputs still in shared memory: not in ``inputs`` until they are read."""

    @property
    def uses_shared_memory(self) -> bool:
        if self.shared_inputs:
            return True
        return self.outputs is not None and any(o.shared is not None for o in self.outputs)

    @property
    def binary_output(self) -> bool:
        return self.parameters.get("binary_data_output") is True

    def classifications(self) -> dict[str, int]:
        """The outputs asked for as their top ``k`` classes, name: ``k``."""
        return {o.name: o.classification for o in self.outputs or () if o.classification}


def shared_memory_ref(parameters: Mapping[str, Any], where: str) -> SharedMemoryRef | None:
    """Triton's shared memory parameters of an input or requested output, or ``None``.


    ``shared_memory_region`` and ``shared_memory_byte_size`` go together;
    ``shared_memory_offset`` is optional (0). Sizes are checked against the region later.
    """
    region = parameters.get(SHM_REGION)
    size = parameters.get(SHM_BYTE_SIZE)
    if region is None and size is None:
        if SHM_OFFSET in parameters:
            raise InvalidInput(f"{where}: {SHM_OFFSET} needs {SHM_REGION} and {SHM_BYTE_SIZE}")
        return None
    if region is None or size is None:
        given, missing = (
            (SHM_REGION, SHM_BYTE_SIZE) if size is None else (SHM_BYTE_SIZE, SHM_REGION)
        )
        raise InvalidInput(f"{where}: {given} needs {missing} too")
    if not isinstance(region, str) or not region:
        raise InvalidInput(f"{where}: {SHM_REGION} must be a region's name")
    offset = parameters.get(SHM_OFFSET, 0)
    for key, value in ((SHM_BYTE_SIZE, size), (SHM_OFFSET, offset)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
            raise InvalidInput(f"{where}: {key} must be a non-negative integer")
    return SharedMemoryRef(region, size, offset)


def element_count(name: str, datatype: str, shape: list[int], limits: Limits) -> int:
    """The element count of an input's ``shape`` (non-negative integers), checked against
    ``limits`` before anything is allocated: 400 for a rank or dimension past them, 413
    for too many elements."""
    if len(shape) > limits.max_rank:
        raise InvalidInput(
            f"input {name!r} has rank {len(shape)}; at most {limits.max_rank} (max_tensor_rank)"
        )
    # Each dimension on its own too: [0, 2**62] holds no element but no array can have it.
    if any(d > limits.max_elements for d in shape):
        raise InvalidInput(
            f"input {name!r}: shape {shape} has a dimension over {limits.max_elements} "
            "(max_tensor_elements)"
        )
    count = math.prod(shape)
    if count > limits.max_elements:
        raise PayloadTooLarge(
            f"input {name!r} has {count} elements; at most {limits.max_elements} "
            "(max_tensor_elements)"
        )
    if datatype == "BYTES" and count > limits.max_bytes_elements:
        raise PayloadTooLarge(
            f"input {name!r} has {count} BYTES elements; at most {limits.max_bytes_elements} "
            "(max_bytes_elements)"
        )
    return count


def tensor_from_bytes(
    name: str, datatype: str, shape: tuple[int, ...], chunk: memoryview
) -> np.ndarray:
    """The tensor whose v2 binary form is ``chunk`` (no copy: it shares the buffer)."""
    return from_binary(name, datatype, list(shape), math.prod(shape), chunk)


def tensor_byte_size(datatype: str, shape: tuple[int, ...]) -> int | None:
    """The bytes a tensor's binary form takes; ``None`` for BYTES (it depends on the data)."""
    if datatype == "BYTES":
        return None
    return math.prod(shape) * V2_TO_NUMPY[datatype].itemsize


def from_binary(
    name: str, datatype: str, shape: list[int], count: int, chunk: memoryview
) -> np.ndarray:
    if datatype == "BYTES":
        return _bytes_elements(name, chunk, count).reshape(shape)
    dtype = _LITTLE_ENDIAN[datatype]
    if len(chunk) != count * dtype.itemsize:
        raise InvalidInput(
            f"input {name!r}: shape {shape} of {datatype} needs {count * dtype.itemsize} bytes, "
            f"binary_data_size is {len(chunk)}"
        )
    if datatype == "BOOL" and count and np.frombuffer(chunk, dtype=np.uint8).max() > 1:
        raise InvalidInput(f"input {name!r}: BOOL elements must be the bytes 0 or 1")
    return np.frombuffer(chunk, dtype=dtype).reshape(shape)


def _bytes_elements(name: str, chunk: memoryview, count: int) -> np.ndarray:
    if count * 4 > len(chunk):  # every element has a 4-byte length: check before allocating
        raise InvalidInput(f"input {name!r}: {len(chunk)} bytes cannot hold {count} BYTES elements")
    out = np.empty(count, dtype=object)
    pos = 0
    for i in range(count):
        if pos + 4 > len(chunk):
            raise InvalidInput(f"input {name!r}: BYTES data ends before element {i}")
        (length,) = _U32.unpack_from(chunk, pos)
        pos += 4
        if pos + length > len(chunk):
            raise InvalidInput(f"input {name!r}: BYTES element {i} runs past its data")
        out[i] = bytes(chunk[pos : pos + length])
        pos += length
    if pos != len(chunk):
        raise InvalidInput(f"input {name!r}: {len(chunk) - pos} bytes after the last element")
    return out


def as_tensor(name: str, value: Any) -> np.ndarray:
    """What a chain returns for one output, as an array v2 can carry."""
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    if array.dtype.kind in "SU":
        array = array.astype(object)
    try:
        v2_datatype(array.dtype)
    except KeyError:
        raise TypeError(f"output {name!r} has dtype {array.dtype}, which v2 cannot carry") from None
    return array


def select_outputs(
    request: InferRequest, outputs: Mapping[str, np.ndarray]
) -> list[tuple[str, bool]]:
    default = request.binary_output
    if request.outputs is None:
        return [(name, default) for name in outputs]
    missing = [o.name for o in request.outputs if o.name not in outputs]
    if missing:
        raise InvalidInput(f"unknown output(s) {missing}; the route returns {sorted(outputs)}")
    return [(o.name, default if o.binary is None else o.binary) for o in request.outputs]


def to_binary(array: np.ndarray, datatype: str) -> bytes:
    if datatype != "BYTES":
        return np.ascontiguousarray(array, dtype=_LITTLE_ENDIAN[datatype]).tobytes()
    return bytes_elements(array)
