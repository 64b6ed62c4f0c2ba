"""KServe v2 inference requests and responses: JSON tensors and Triton's binary tensor extension.

Binary tensor data (``Inference-Header-Content-Length``): the body is a JSON
header of that many bytes followed by the raw data of every input whose
``parameters.binary_data_size`` is set, in input order. Numeric tensors are
little-endian row-major; ``BYTES`` elements are each a 4-byte little-endian
length followed by the bytes. Binary inputs are decoded without a copy
(``numpy.frombuffer``), so they arrive read-only.

Triton's shared memory extension: an input or requested output whose parameters
name a ``shared_memory_region`` is decoded into a :class:`SharedMemoryRef`; the
data itself is read and written by ``server/triton/shared_memory.py``.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from plugserve.registry.errors import InvalidInput, PayloadTooLarge
from plugserve.registry.tensors.datatypes import V2_TO_NUMPY, v2_datatype
from plugserve.registry.tensors.values import MayHoldBool, bytes_elements, from_json
from plugserve.server.triton.classification import class_count

HEADER_LENGTH = "Inference-Header-Content-Length"
_U32 = struct.Struct("<I")
_LITTLE_ENDIAN = {name: dtype.newbyteorder("<") for name, dtype in V2_TO_NUMPY.items()}
"""Each datatype's dtype as the binary extension lays it out, made once."""


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; nothing is allocated before these are checked."""

    max_inputs: int = 64
    max_rank: int = 16
    max_elements: int = 1 << 26
    max_bytes_elements: int = 1 << 20


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


def json_header_size(header_length: str, body_length: int) -> int:
    """The JSON header's length that ``Inference-Header-Content-Length`` declares; 400
    unless it is an integer within the body of ``body_length`` bytes."""
    try:
        size = int(header_length)
    except ValueError:  # not a number, or more digits than int() takes
        raise InvalidInput(f"{HEADER_LENGTH} must be an integer") from None
    if not 0 <= size <= body_length:
        raise InvalidInput(f"{HEADER_LENGTH} {size} is outside the body ({body_length} bytes)")
    return size


def decode_request(
    body: bytes, header_length: str | None, limits: Limits = DEFAULT_LIMITS
) -> InferRequest:
    """Parse a v2 infer request body; raise :class:`InvalidInput` for anything malformed.

    JSON nested deeper than 1024 levels is refused by the parser (orjson's limit).
    """
    if header_length is None:
        header, binary = body, memoryview(b"")
    else:
        size = json_header_size(header_length, len(body))
        header, binary = body[:size], memoryview(body)[size:]
    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the request is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput("the request must be a JSON object")
    return _request(doc, binary, limits, _BoolSearch(header))


class _BoolSearch:
    """Whether the JSON text holds ``true`` or ``false``; if not, no tensor holds a JSON
    boolean. Searched only when a tensor's data needs it (not a plain list of floats,
    registry/tensors/values.py), and at most once a request, however many tensors ask: a large
    body with many tensors is never scanned once per tensor. A slotted class, as
    ``functools.cache`` would build a cache per request that costs more than the search."""

    __slots__ = ("_answer", "_text")

    def __init__(self, text: bytes) -> None:
        self._text = text
        self._answer: bool | None = None

    def __call__(self) -> bool:
        if self._answer is None:
            self._answer = b"true" in self._text or b"false" in self._text
        return self._answer


def _request(
    doc: dict[str, Any], binary: memoryview, limits: Limits, may_hold_bool: MayHoldBool = True
) -> InferRequest:
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("'inputs' must be a non-empty list")
    if len(raw_inputs) > limits.max_inputs:
        raise InvalidInput(f"{len(raw_inputs)} inputs; at most {limits.max_inputs} (max_inputs)")
    parameters = _parameters(doc, "request")
    _boolean(parameters, "binary_data_output", "request parameter")
    inputs: dict[str, np.ndarray] = {}
    shared: dict[str, SharedInput] = {}
    offset = 0
    for index, raw in enumerate(raw_inputs):
        name, array, used = _input(raw, binary, offset, limits, may_hold_bool)
        if name in inputs or name in shared:
            raise InvalidInput(f"input {name!r} appears twice")
        if isinstance(array, SharedInput):
            shared[name] = SharedInput(array.ref, array.datatype, array.shape, index)
        else:
            inputs[name] = array
        offset += used
    if offset != len(binary):
        raise InvalidInput(f"{len(binary) - offset} bytes of binary data belong to no input")
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput("'id' must be a string")
    outputs = _requested_outputs(doc.get("outputs"))
    return InferRequest(inputs, request_id, parameters, outputs, shared)


def _parameters(doc: Mapping[str, Any], where: str) -> dict[str, Any]:
    value = doc.get("parameters", {})
    if not isinstance(value, dict):
        raise InvalidInput(f"'parameters' of the {where} must be an object")
    return value


def _boolean(parameters: Mapping[str, Any], key: str, where: str) -> bool | None:
    """A boolean parameter, or ``None`` when absent; a string such as ``"false"`` is a 400."""
    value = parameters.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidInput(f"{where} {key!r} must be true or false, not {value!r}")
    return value


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


def _input(
    raw: Any, binary: memoryview, offset: int, limits: Limits, may_hold_bool: MayHoldBool = True
) -> tuple[str, np.ndarray | SharedInput, int]:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise InvalidInput("each input must be an object with a string 'name'")
    name = raw["name"]
    check_name(name, "input")
    datatype = raw.get("datatype")
    if not isinstance(datatype, str) or datatype not in V2_TO_NUMPY:
        known = ", ".join(V2_TO_NUMPY)
        raise InvalidInput(f"input {name!r}: datatype {datatype!r} is not supported ({known})")
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InvalidInput(f"input {name!r}: 'shape' must be a list of non-negative integers")
    count = element_count(name, datatype, shape, limits)
    parameters = _parameters(raw, f"input {name!r}")
    size = parameters.get("binary_data_size")
    ref = shared_memory_ref(parameters, f"input {name!r}")
    if ref is not None:
        if size is not None or "data" in raw:
            raise InvalidInput(
                f"input {name!r} is in shared memory: it takes no 'data' or binary_data_size"
            )
        return name, SharedInput(ref, datatype, tuple(shape), -1), 0
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidInput(f"input {name!r}: binary_data_size must be a non-negative integer")
        if offset + size > len(binary):
            raise InvalidInput(f"input {name!r}: binary_data_size {size} runs past the body")
        chunk = binary[offset : offset + size]
        return name, from_binary(name, datatype, shape, count, chunk), size
    if "data" not in raw:
        raise InvalidInput(f"input {name!r} has neither 'data' nor binary_data_size")
    return name, _from_json(name, datatype, shape, count, raw["data"], may_hold_bool), 0


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


def _from_json(
    name: str,
    datatype: str,
    shape: list[int],
    count: int,
    data: Any,
    may_hold_bool: MayHoldBool = True,
) -> np.ndarray:
    """The tensor of a JSON ``data`` list: every value must fit ``datatype`` exactly."""
    if not isinstance(data, list):
        data = [data]
    try:
        if datatype == "BYTES":
            array = np.asarray(data, dtype=object).reshape(-1)
            array = np.fromiter((_to_bytes(name, v) for v in array), dtype=object, count=array.size)
        else:
            array = from_json(data, V2_TO_NUMPY[datatype], may_hold_bool)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidInput(f"input {name!r}: {exc}") from None
    if array.size != count:
        raise InvalidInput(
            f"input {name!r}: shape {shape} needs {count} elements, the data has {array.size}"
        )
    return array.reshape(shape)


def _to_bytes(name: str, value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes):
        return value
    raise InvalidInput(
        f"input {name!r}: BYTES elements must be strings, not {type(value).__name__}"
    )


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


def _requested_outputs(raw: Any) -> list[RequestedOutput] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise InvalidInput("'outputs' must be a list")
    outputs = []
    names: set[str] = set()
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidInput("each requested output must be an object with a string 'name'")
        check_name(item["name"], "output")
        where = f"output {item['name']!r}"
        if item["name"] in names:  # each repeat would be encoded again: a size multiplier
            raise InvalidInput(f"{where} is requested more than once")
        names.add(item["name"])
        parameters = _parameters(item, where)
        binary = _boolean(parameters, "binary_data", f"{where}: parameter")
        shared = shared_memory_ref(parameters, where)
        outputs.append(
            RequestedOutput(
                item["name"], binary, shared=shared, classification=class_count(parameters, where)
            )
        )
    return outputs


# -- responses ---------------------------------------------------------------------------


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


def encode_response(
    request: InferRequest,
    model_name: str,
    model_version: str,
    outputs: Mapping[str, np.ndarray],
) -> tuple[bytes, dict[str, str]]:
    """Build the response body and headers; binary where the request asked for it."""
    selected = select_outputs(request, outputs)
    shared = {o.name for o in request.outputs or () if o.shared is not None}
    header_outputs = []
    chunks: list[bytes] = []
    finite = True
    for name, binary in selected:
        array = outputs[name]
        datatype = v2_datatype(array.dtype)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if name in shared:  # written into its region already: metadata only, as Triton answers
            pass
        elif binary:
            raw = to_binary(array, datatype)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            data = entry["data"] = _to_json(name, array, datatype)
            if array.dtype.kind == "f" and not _finite(array, data):
                finite = False
        header_outputs.append(entry)
    doc: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request.id is not None:
        doc["id"] = request.id
    doc["outputs"] = header_outputs
    # JSON has no Infinity or NaN: orjson would write null. Python's json writes
    # Infinity/NaN, which Python clients (tritonclient among them) read back.
    header = orjson.dumps(doc) if finite else json.dumps(doc, separators=(",", ":")).encode()
    if not chunks:
        return header, {"Content-Type": "application/json"}
    headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
    return b"".join([header, *chunks]), headers


def _finite(array: np.ndarray, values: list[float]) -> bool:
    """Whether every element is finite: a small output's values checked as Python floats
    (a numpy reduction costs more), a large one in one numpy pass without a temporary:
    the sum, in float64, is finite when every element is (or it overflowed, and then
    the slower encoder is merely unneeded)."""
    if array.size <= 64:
        return all(map(math.isfinite, values))
    with np.errstate(over="ignore", invalid="ignore"):
        return math.isfinite(array.sum(dtype=np.float64))


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


def _to_json(name: str, array: np.ndarray, datatype: str) -> list[Any]:
    flat = array.reshape(-1)
    if datatype != "BYTES":
        return list(flat.tolist())
    try:
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in flat]
    except UnicodeDecodeError:
        raise InvalidInput(
            f"output {name!r} holds bytes that are not UTF-8; ask for it as binary_data"
        ) from None


def to_binary(array: np.ndarray, datatype: str) -> bytes:
    if datatype != "BYTES":
        return np.ascontiguousarray(array, dtype=_LITTLE_ENDIAN[datatype]).tobytes()
    return bytes_elements(array)
