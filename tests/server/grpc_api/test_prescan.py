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


def test_bytes_contents_past_max_bytes_elements_are_refused_only_when_they_could_be() -> None:
    message = service_pb2.ModelInferRequest(model_name="add")
    tensor = message.inputs.add(name="s", datatype="BYTES", shape=[1001])
    tensor.contents.bytes_contents.extend([b"ab"] * 1001)
    assert check(message.SerializeToString()) == (
        "a tensor's bytes_contents has more than 1000 elements (max_bytes_elements)"
    )
    del tensor.contents.bytes_contents[1000:]
    assert check(message.SerializeToString()) is None
    packed = service_pb2.ModelInferRequest(model_name="add")
    packed.inputs.add(name="f", datatype="FP32", shape=[100_000]).contents.fp32_contents.extend(
        [1.0] * 100_000
    )
    assert check(packed.SerializeToString()) is None  # one field, however long


def test_a_malformed_message_is_left_to_the_parser() -> None:
    body = request().SerializeToString()
    assert check(body[:-3]) is None
    assert check(b"\x2a\xff\xff\xff\xff\x0f" + b"\0" * SCAN_FROM) is None
