"""Bounds read from a ModelInferRequest's wire format before it is parsed (prescan.py)."""

from __future__ import annotations

import numpy as np
from tritonclient.grpc import service_pb2

from plugserve.server.config import Limits
from plugserve.server.grpc_api.prescan import MAX_FIELDS, SCAN_FROM, bounds

REQUEST = service_pb2.ModelInferRequest.DESCRIPTOR
check = bounds(REQUEST, Limits(max_inputs=64, max_bytes_elements=1000))


def request(inputs: int = 1, rows: int = 1024) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name="add", id="a")
    for i in range(inputs):
        tensor = message.inputs.add(name=f"x{i}", datatype="FP32", shape=[rows, 4])
        tensor.parameters["p"].int64_param = 1
        message.raw_input_contents.append(np.ones((rows, 4), np.float32).tobytes())
    message.outputs.add(name="y")
    return message


def test_a_request_within_its_bounds_passes() -> None:
    body = request(inputs=64).SerializeToString()
    assert len(body) > SCAN_FROM
    assert check(body) is None


def test_millions_of_empty_inputs_are_refused_at_the_first_past_max_inputs() -> None:
    body = b"\x0a\x03add" + b"\x2a\x00" * 8_400_000  # 16 MiB: field 5, empty, 8.4 M times
    assert check(body) == "more than 64 inputs entries (max_inputs)"


def test_raw_contents_past_max_inputs_are_refused() -> None:
    message = request()
    message.raw_input_contents.extend([b"\0" * 64] * 64)
    assert (
        check(message.SerializeToString()) == "more than 64 raw_input_contents entries (max_inputs)"
    )


def test_nested_fields_count_towards_the_bound() -> None:
    message = request()
    for i in range(MAX_FIELDS):
        message.inputs[0].parameters[f"k{i}"].bool_param = True
    why = check(message.SerializeToString())
    assert why is not None and str(MAX_FIELDS) in why


def test_contents_past_their_fields_are_refused_only_when_they_could_be() -> None:
    limit = 1000 + MAX_FIELDS  # max_bytes_elements, and the other fields a message may have
    message = service_pb2.ModelInferRequest(model_name="add")
    tensor = message.inputs.add(name="s", datatype="BYTES", shape=[limit + 1])
    tensor.contents.bytes_contents.extend([b"ab"] * (limit + 1))
    assert check(message.SerializeToString()) == (
        f"a tensor's contents has more than {limit} fields (max_bytes_elements elements of "
        "bytes_contents, and numbers sent packed)"
    )
    del tensor.contents.bytes_contents[limit:]
    assert check(message.SerializeToString()) is None
    packed = service_pb2.ModelInferRequest(model_name="add")
    packed.inputs.add(name="f", datatype="FP32", shape=[100_000]).contents.fp32_contents.extend(
        [1.0] * 100_000
    )
    assert check(packed.SerializeToString()) is None  # one field, however long
    unpacked = b"".join(b"\x08\x01" for _ in range(3 * limit))  # bool_contents, one by one
    contents = b"\x2a" + _varint(len(unpacked)) + unpacked
    tensor_bytes = b"\x0a\x01b\x12\x04BOOL" + contents
    body = b"\x0a\x03add\x2a" + _varint(len(tensor_bytes)) + tensor_bytes
    assert check(body) is not None


def test_a_group_is_refused_however_it_hides_what_follows() -> None:
    body = b"\x0a\x03add" + b"\x9b\x06\x9c\x06" + b"\x2a\x00" * 8_000  # group 99, then inputs
    assert check(body) == "the request holds a group, a field of no ModelInferRequest"


def test_the_field_bound_grows_with_max_inputs() -> None:
    wide = bounds(REQUEST, Limits(max_inputs=2000))
    body = request(inputs=1000, rows=1).SerializeToString()
    assert check(body) is not None and wide(body) is None


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def test_a_malformed_message_is_left_to_the_parser() -> None:
    body = request().SerializeToString()
    assert check(body[:-3]) is None
    assert check(b"\x2a\xff\xff\xff\xff\x0f" + b"\0" * SCAN_FROM) is None
