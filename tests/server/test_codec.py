"""The v2 codec alone: binary and JSON round trips over generated tensors."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from registry.datatypes import V2_TO_NUMPY
from registry.errors import InvalidInput
from server.codec import (
    HEADER_LENGTH,
    InferRequest,
    RequestedOutput,
    decode_request,
    encode_response,
)

NUMERIC = [d for d in V2_TO_NUMPY if d != "BYTES"]


def tensors() -> st.SearchStrategy[tuple[str, np.ndarray]]:
    def array_of(datatype: str) -> st.SearchStrategy[tuple[str, np.ndarray]]:
        shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4)
        if datatype == "BYTES":
            elements = st.binary(max_size=8)
            arrays = shapes.flatmap(
                lambda s: st.lists(
                    elements, min_size=int(np.prod(s)), max_size=int(np.prod(s))
                ).map(lambda xs, s=s: np.array(xs, dtype=object).reshape(s))
            )
        else:
            arrays = hnp.arrays(V2_TO_NUMPY[datatype], shapes, elements={"allow_nan": False})
        return arrays.map(lambda a: (datatype, a))

    return st.sampled_from([*NUMERIC, "BYTES"]).flatmap(array_of)


def binary_request(named: dict[str, tuple[str, np.ndarray]]) -> tuple[bytes, str]:
    inputs, chunks = [], []
    for name, (datatype, array) in named.items():
        if datatype == "BYTES":
            raw = b"".join(len(v).to_bytes(4, "little") + v for v in array.reshape(-1))
        else:
            raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
        chunks.append(raw)
        inputs.append({"name": name, "datatype": datatype, "shape": list(array.shape),
                       "parameters": {"binary_data_size": len(raw)}})  # fmt: skip
    header = json.dumps({"inputs": inputs}).encode()
    return header + b"".join(chunks), str(len(header))


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(st.text("abcxyz", min_size=1, max_size=3), tensors(), min_size=1, max_size=4)
)
def test_binary_request_decodes_to_the_same_tensors(
    named: dict[str, tuple[str, np.ndarray]],
) -> None:
    body, header_length = binary_request(named)
    decoded = decode_request(body, header_length)
    assert list(decoded.inputs) == list(named)
    for name, (_, array) in named.items():
        got = decoded.inputs[name]
        assert got.shape == array.shape
        assert got.tolist() == array.tolist()


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text("abcxyz", min_size=1, max_size=3), tensors(), min_size=1, max_size=4),
       st.booleans())  # fmt: skip
def test_responses_decode_back_to_the_outputs(
    named: dict[str, tuple[str, np.ndarray]], binary: bool
) -> None:
    outputs = {name: array for name, (_, array) in named.items()}
    request = InferRequest({}, "id-1", {"binary_data_output": binary})
    if not binary and any(d == "BYTES" for d, _ in named.values()):
        # JSON carries BYTES as UTF-8 text only.
        outputs = {n: a for n, a in outputs.items() if named[n][0] != "BYTES"} or {"z": np.zeros(1)}
    body, headers = encode_response(request, "m", "1.0.0", outputs)
    size = int(headers.get(HEADER_LENGTH, len(body)))
    doc = json.loads(body[:size])
    assert doc["id"] == "id-1"
    offset = size
    for out in doc["outputs"]:
        want = outputs[out["name"]]
        assert out["shape"] == list(want.shape)
        if binary:
            n = out["parameters"]["binary_data_size"]
            raw, offset = body[offset : offset + n], offset + n
            if out["datatype"] == "BYTES":
                items, pos = [], 0
                while pos < len(raw):
                    length = int.from_bytes(raw[pos : pos + 4], "little")
                    items.append(raw[pos + 4 : pos + 4 + length])
                    pos += 4 + length
                assert items == list(want.reshape(-1))
            else:
                got = np.frombuffer(raw, V2_TO_NUMPY[out["datatype"]].newbyteorder("<"))
                assert got.tolist() == want.reshape(-1).tolist()
        else:
            assert out["data"] == want.reshape(-1).tolist()
    assert offset == len(body)


def test_requested_output_overrides_the_request_default() -> None:
    request = InferRequest({}, None, {"binary_data_output": True}, [RequestedOutput("a", False)])
    body, headers = encode_response(request, "m", "1", {"a": np.arange(3), "b": np.arange(2)})
    assert HEADER_LENGTH not in headers
    assert json.loads(body)["outputs"] == [
        {"name": "a", "datatype": "INT64", "shape": [3], "data": [0, 1, 2]}
    ]


def test_bytes_elements_that_are_not_utf8_need_binary() -> None:
    request = InferRequest({}, None, {})
    with pytest.raises(InvalidInput, match="not UTF-8"):
        encode_response(request, "m", "1", {"s": np.array([b"\xff"], dtype=object)})


def test_malformed_bytes_elements_are_rejected() -> None:
    header = json.dumps({"inputs": [{"name": "s", "datatype": "BYTES", "shape": [2],
                                     "parameters": {"binary_data_size": 9}}]}).encode()  # fmt: skip
    element = (5).to_bytes(4, "little") + b"hello"
    with pytest.raises(InvalidInput, match="BYTES data ends before element 1"):
        decode_request(header + element, str(len(header)))
    bad = (50).to_bytes(4, "little") + b"hello"
    with pytest.raises(InvalidInput, match="runs past its data"):
        decode_request(header + bad, str(len(header)))
