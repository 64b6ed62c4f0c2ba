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

import binascii
import dataclasses
import json
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from plugserve.registry import checks
from plugserve.registry.errors import InvalidInput
from plugserve.registry.tensors.datatypes import V2_TO_NUMPY, v2_datatype
from plugserve.registry.tensors.values import MayHoldBool, from_json
from plugserve.server.config import Limits
from plugserve.server.triton.classification import class_count
from plugserve.server.triton.requests import (
    DEFAULT_LIMITS,
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

HEADER_LENGTH = "Inference-Header-Content-Length"


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
        key = (header, len(binary))
        plan = _PLANS.get(key)
        if plan is not None and plan.limits is limits:
            return plan.request(binary)
    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the request is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput("the request must be a JSON object")
    request = _request(doc, binary, limits, _BoolSearch(header))
    if header_length is not None and len(header) <= PLANNED_HEADER_BYTES:
        _remember(key, doc, request, limits)
    return request


PLANS_KEPT = 256
PLANNED_HEADER_BYTES = 4096
"""A binary request's JSON header is decoded once per distinct header (up to ``PLANS_KEPT``
of them, each at most this long): clients send the same header with every request, only
the tensors' bytes change, and every check of a header depends on nothing but its text
and the length of the binary data after it. A repeat skips the JSON parse and the checks
(:class:`_Plan`); its tensors are still read from its own bytes, BYTES elements and BOOL
values checked as they are."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Plan:
    """What a binary request's header says, once checked: each input's name, datatype,
    shape, element count and byte size, in body order, and the rest of the request."""

    inputs: tuple[tuple[str, str, list[int], int, int], ...]
    limits: Limits
    """The limits it was checked against (the server's own: one object a process)."""
    request_id: str | None
    parameters: dict[str, Any]
    outputs: tuple[RequestedOutput, ...] | None

    def request(self, binary: memoryview) -> InferRequest:
        inputs: dict[str, np.ndarray] = {}
        offset = 0
        for name, datatype, shape, count, size in self.inputs:
            chunk = binary[offset : offset + size]
            inputs[name] = from_binary(name, datatype, shape, count, chunk)
            offset += size
        outputs = None if self.outputs is None else list(self.outputs)
        return InferRequest(inputs, self.request_id, dict(self.parameters), outputs)


_PLANS: dict[tuple[bytes, int], _Plan] = {}
_PLANS_LOCK = threading.Lock()  # large bodies are decoded on the body threads


def _remember(
    key: tuple[bytes, int], doc: dict[str, Any], request: InferRequest, limits: Limits
) -> None:
    """Keep the plan of a decoded binary request whose every input is binary data (a JSON
    ``data`` list or a shared-memory input is read from the request itself) and whose
    parameters are plain values (each request gets a copy of them)."""
    if request.shared_inputs or not all(_plain(v) for v in request.parameters.values()):
        return
    inputs = []
    for raw in doc["inputs"]:
        name, datatype, shape = raw["name"], raw["datatype"], raw["shape"]
        size = raw.get("parameters", {}).get("binary_data_size")
        if size is None:
            return
        inputs.append((name, datatype, shape, request.inputs[name].size, size))
    outputs = None if request.outputs is None else tuple(request.outputs)
    plan = _Plan(tuple(inputs), limits, request.id, dict(request.parameters), outputs)
    with _PLANS_LOCK:
        if len(_PLANS) >= PLANS_KEPT:
            del _PLANS[next(iter(_PLANS))]  # the oldest
        _PLANS[key] = plan


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


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
    base64 = False
    if "parameters" not in raw:  # the usual input of a JSON request: its data, no more
        size = ref = None
    else:
        parameters = _parameters(raw, f"input {name!r}")
        size = parameters.get("binary_data_size")
        ref = shared_memory_ref(parameters, f"input {name!r}")
        base64 = _is_base64(name, datatype, parameters)
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
    if base64:
        return name, _from_base64(name, shape, count, raw["data"]), 0
    return name, _from_json(name, datatype, shape, count, raw["data"], may_hold_bool), 0


CONTENT_TYPES = ("base64", "str", "np")
"""An input's ``parameters.content_type`` (MLServer's): ``base64`` for BYTES elements sent
as base64 text (an encoded image in JSON); ``str`` and ``np`` are what a plain JSON input
means already."""


def _is_base64(name: str, datatype: str, parameters: Mapping[str, Any]) -> bool:
    content_type = parameters.get("content_type")
    if content_type is None:
        return False
    if content_type not in CONTENT_TYPES:
        raise InvalidInput(
            f"input {name!r}: content_type {checks.shown(content_type)} is not one of "
            f"{', '.join(CONTENT_TYPES)}"
        )
    if content_type == "base64" and datatype != "BYTES":
        raise InvalidInput(f"input {name!r}: content_type base64 is for BYTES, not {datatype}")
    return bool(content_type == "base64")


def _from_base64(name: str, shape: list[int], count: int, data: Any) -> np.ndarray:
    """BYTES elements sent as base64 strings, decoded (strictly: no stray characters)."""
    values = data if isinstance(data, list) else [data]
    flat = np.asarray(values, dtype=object).reshape(-1)
    if flat.size != count:
        raise InvalidInput(
            f"input {name!r}: shape {shape} needs {count} elements, the data has {flat.size}"
        )
    decoded = np.empty(count, dtype=object)
    for i, value in enumerate(flat):
        if not isinstance(value, str):
            raise InvalidInput(
                f"input {name!r}: base64 elements are strings, not {type(value).__name__}"
            )
        try:
            decoded[i] = binascii.a2b_base64(value, strict_mode=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidInput(f"input {name!r}: element {i} is not base64 ({exc})") from None
    return decoded.reshape(shape)


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


def encode_response(
    request: InferRequest,
    model_name: str,
    model_version: str,
    outputs: Mapping[str, np.ndarray],
) -> tuple[bytes, dict[str, str]]:
    """Build the response body and headers; binary where the request asked for it."""
    if request.outputs is None and request.id is None and not request.binary_output:
        body = _float_answer(model_name, model_version, outputs)
        if body is not None:
            return body, {"Content-Type": "application/json"}
    selected = select_outputs(request, outputs)
    shared = {o.name for o in request.outputs or () if o.shared is not None}
    header_outputs = []
    chunks: list[bytes] = []
    floats: list[tuple[dict[str, Any], np.ndarray]] = []
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
            data = _to_json(name, array, datatype)
            if isinstance(data, np.ndarray):
                floats.append((entry, data))
                text = orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY)
                finite = finite and b"n" not in text  # orjson writes inf and nan as null
                entry["data"] = orjson.Fragment(text)
            else:
                entry["data"] = data
        header_outputs.append(entry)
    doc: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request.id is not None:
        doc["id"] = request.id
    doc["outputs"] = header_outputs
    if finite:
        header = orjson.dumps(doc)
    else:
        # JSON has no Infinity or NaN. Python's json writes them, and Python clients
        # (tritonclient among them) read them back.
        for entry, values in floats:
            entry["data"] = values.tolist()
        header = json.dumps(doc, separators=(",", ":")).encode()
    if not chunks:
        return header, {"Content-Type": "application/json"}
    headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
    return b"".join([header, *chunks]), headers


ANSWERS_KEPT = 256
"""The JSON answers of float outputs are written around a skeleton kept per model, version
and outputs' names, types and shapes (up to this many): only the values are encoded."""

_ANSWERS: dict[tuple[Any, ...], tuple[bytes, ...] | None] = {}
_ANSWERS_LOCK = threading.Lock()  # large answers are encoded on the body threads


def _float_answer(
    model_name: str, model_version: str, outputs: Mapping[str, np.ndarray]
) -> bytes | None:
    """The JSON answer of a request that asked for every output as JSON, when each is a
    float tensor with finite values: the kept skeleton (the same bytes as
    :func:`encode_response`'s general path writes) with each output's values in place.
    ``None``: any other answer, for the general path."""
    key = (model_name, model_version, *[(n, a.dtype, a.shape) for n, a in outputs.items()])
    try:
        parts = _ANSWERS[key]
    except KeyError:
        parts = _skeleton(model_name, model_version, outputs)
        with _ANSWERS_LOCK:
            if len(_ANSWERS) >= ANSWERS_KEPT:
                del _ANSWERS[next(iter(_ANSWERS))]  # the oldest
            _ANSWERS[key] = parts
    if parts is None:
        return None
    pieces = [parts[0]]
    for array, after in zip(outputs.values(), parts[1:], strict=True):
        text = orjson.dumps(array.reshape(-1).astype(np.float64), option=orjson.OPT_SERIALIZE_NUMPY)
        if b"n" in text:  # orjson writes inf and nan as null: the general path writes them
            return None
        pieces += (text, after)
    return b"".join(pieces)


def _skeleton(
    model_name: str, model_version: str, outputs: Mapping[str, np.ndarray]
) -> tuple[bytes, ...] | None:
    """The answer's bytes around each output's values, or ``None`` unless every output is
    a float tensor. A NUL byte marks each place: orjson escapes any in a string."""
    if not outputs or any(a.dtype.kind != "f" for a in outputs.values()):
        return None
    hole = orjson.Fragment(b"\x00")
    entries = [
        {"name": name, "datatype": v2_datatype(a.dtype), "shape": list(a.shape), "data": hole}
        for name, a in outputs.items()
    ]
    doc = {"model_name": model_name, "model_version": model_version, "outputs": entries}
    return tuple(orjson.dumps(doc).split(b"\x00"))


def _to_json(name: str, array: np.ndarray, datatype: str) -> list[Any] | np.ndarray:
    """An output's values as JSON writes them: floats as float64 (orjson writes each as the
    shortest text of that double, as it writes a Python float, with no Python float made),
    other numbers and booleans as Python values, BYTES as strings."""
    flat = array.reshape(-1)
    if array.dtype.kind == "f":
        return flat.astype(np.float64)
    if datatype != "BYTES":
        return list(flat.tolist())
    try:
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in flat]
    except UnicodeDecodeError:
        raise InvalidInput(
            f"output {name!r} holds bytes that are not UTF-8; ask for it as binary_data"
        ) from None
