"""The v2 codec alone: binary and JSON round trips over generated tensors."""

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from plugserve.registry.errors import InvalidInput, PayloadTooLarge
from plugserve.registry.tensors.datatypes import V2_TO_NUMPY
from plugserve.server.grpc_api import tensors as grpc_tensors
from plugserve.server.grpc_api.generated import grpc_service_pb2 as pb
from plugserve.server.http_api import codec
from plugserve.server.http_api.codec import HEADER_LENGTH, decode_request, encode_response
from plugserve.server.triton.requests import (
    InferRequest,
    Limits,
    RequestedOutput,
    SharedInput,
    SharedMemoryRef,
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


def one_input(**fields: Any) -> bytes:
    entry = {"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0], **fields}
    return json.dumps({"inputs": [entry]}).encode()


def test_a_huge_dimension_of_an_empty_tensor_is_400() -> None:
    """issue 12, finding 15: shape [0, 2**62] with empty data was a 500 (numpy overflowed)."""
    for shape in ([0, 2**62], [2**62, 0], [0, 2**62, 2**62]):
        with pytest.raises(InvalidInput, match=r"has a dimension over \d+ \(max_tensor_elements\)"):
            decode_request(one_input(shape=shape, data=[]), None)
        binary = one_input(shape=shape, data=None, parameters={"binary_data_size": 0})
        with pytest.raises(InvalidInput, match="has a dimension over"):
            decode_request(binary, str(len(binary)))
    assert decode_request(one_input(shape=[0, 3], data=[]), None).inputs["x"].shape == (0, 3)


def test_a_bytes_tensor_over_its_element_limit_is_413_before_any_element_is_built() -> None:
    """After issue 12: a gzip bomb of 16 M empty BYTES elements was built and checked one
    Python object at a time, stalling every client for seconds; BYTES tensors have their
    own element limit (max_bytes_elements), checked before a single element is made."""
    limits = Limits(max_bytes_elements=3)
    strings = one_input(datatype="BYTES", shape=[4], data=["a", "b", "c", "d"])
    with pytest.raises(
        PayloadTooLarge, match=r"4 BYTES elements; at most 3 \(max_bytes_elements\)"
    ):
        decode_request(strings, None, limits)
    header = json.dumps({"inputs": [{"name": "s", "datatype": "BYTES", "shape": [4],
                                     "parameters": {"binary_data_size": 16}}]}).encode()  # fmt: skip
    with pytest.raises(PayloadTooLarge, match="max_bytes_elements"):
        decode_request(header + bytes(16), str(len(header)), limits)
    three = one_input(datatype="BYTES", shape=[3], data=["a", "b", "c"])
    assert decode_request(three, None, limits).inputs["x"].tolist() == [b"a", b"b", b"c"]
    numbers = one_input(shape=[4], data=[1.0, 2.0, 3.0, 4.0])  # other datatypes: not this limit
    assert decode_request(numbers, None, limits).inputs["x"].shape == (4,)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"parameters": {"binary_data_output": "false"}},
         "request parameter 'binary_data_output' must be true or false, not 'false'"),
        ({"parameters": {"binary_data_output": 1}}, "'binary_data_output' must be true or false"),
        ({"outputs": [{"name": "y", "parameters": {"binary_data": "no"}}]},
         "output 'y': parameter 'binary_data' must be true or false, not 'no'"),
    ],
)  # fmt: skip
def test_request_parameters_of_the_wrong_type_are_400(doc: dict[str, Any], message: str) -> None:
    """issue 12, finding 16: binary_data_output "false" (a string) returned binary."""
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}], **doc}
    with pytest.raises(InvalidInput) as info:
        decode_request(json.dumps(body).encode(), None)
    assert message in info.value.message
    body = {"inputs": body["inputs"], "parameters": {"binary_data_output": False}}
    assert decode_request(json.dumps(body).encode(), None).binary_output is False


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("INT8", [1.5], "input 'x': 1.5 (element 0) does not fit INT8: not an integer"),
        ("BOOL", ["x"], "input 'x': BOOL takes JSON booleans; the data holds strings"),
        ("FP16", [1e10], "input 'x': 10000000000.0 (element 0) does not fit FP16"),
        ("UINT8", [-1], "input 'x': -1 (element 0) does not fit UINT8: outside 0..255"),
        ("INT32", [True], "input 'x': INT32 takes JSON numbers; the data holds booleans"),
        # The decoder skips the search for booleans only when the text has no true/false.
        ("FP32", [2.5, True], "input 'x': FP32 takes JSON numbers; the data holds booleans"),
        ("FP32", [1, False], "input 'x': FP32 takes JSON numbers; the data holds booleans"),
        # Over 64 elements the range is checked by numpy, in one pass.
        ("FP32", [0.5] * 99 + [-1e300], "input 'x': -1e+300 (element 99) does not fit FP32"),
    ],
)
def test_json_data_must_fit_the_datatype_exactly(
    datatype: str, data: list[Any], message: str
) -> None:
    """issue 12, finding 16: values were cast without a word (INT8 1.5 -> 1, BOOL "x" -> true)."""
    with pytest.raises(InvalidInput) as info:
        decode_request(one_input(datatype=datatype, data=data), None)
    assert info.value.message.startswith(message)


def test_binary_bool_elements_must_be_0_or_1() -> None:
    """The binary path's counterpart of finding 16: a BOOL byte of 2 is no boolean."""
    header = one_input(datatype="BOOL", shape=[2], data=None, parameters={"binary_data_size": 2})
    with pytest.raises(InvalidInput, match="BOOL elements must be the bytes 0 or 1"):
        decode_request(header + b"\x01\x02", str(len(header)))
    ok = decode_request(header + b"\x01\x00", str(len(header)))
    assert ok.inputs["x"].tolist() == [True, False]


def test_an_output_requested_twice_is_400() -> None:
    """Attack round after issue 12: each repeat of a requested output was encoded again, so a
    64 MiB request naming a large output a million times asked for terabytes (out of memory,
    and below 256 KiB per output the encoding ran on the event loop)."""
    for outputs in ([{"name": "y"}, {"name": "y"}],
                    [{"name": "y", "parameters": {"binary_data": True}}, {"name": "z"},
                     {"name": "y", "parameters": {"binary_data": False}}]):  # fmt: skip
        with pytest.raises(InvalidInput, match="output 'y' is requested more than once"):
            decode_request(
                json.dumps({**json.loads(one_input()), "outputs": outputs}).encode(), None
            )
    ok = json.dumps({**json.loads(one_input()), "outputs": [{"name": "y"}, {"name": "z"}]})
    assert [o.name for o in decode_request(ok.encode(), None).outputs or []] == ["y", "z"]


hostile = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["name", "datatype", "shape", "data", "parameters", "binary_data_size",
                         "binary_data_output", "binary_data", "inputs", "outputs", "id"]),
        inner, max_size=4),
    max_leaves=20,
)  # fmt: skip
datatypes = st.sampled_from([*V2_TO_NUMPY, "BF16", "fp32"])
shapes = st.lists(st.integers(-1, 2**64) | st.sampled_from([0, 1, 2, 2**62]), max_size=4)
inputs = st.fixed_dictionaries(
    {"name": st.sampled_from(["x", "y"]), "datatype": datatypes, "shape": shapes},
    optional={
        "data": hostile | st.just([]),
        "parameters": hostile | st.fixed_dictionaries({"binary_data_size": st.integers(0, 9)}),
    },
)


@settings(max_examples=400, deadline=None)
@given(
    st.fixed_dictionaries(
        {"inputs": st.lists(inputs, max_size=3) | hostile},
        optional={"parameters": hostile, "outputs": hostile, "id": hostile},
    ),
    st.binary(max_size=16),
    st.booleans(),
)
def test_no_request_makes_the_decoder_raise_anything_but_a_client_error(
    doc: dict[str, Any], tail: bytes, binary: bool
) -> None:
    """The class of findings 15 and 16: a hostile v2 request is a 4xx, never an escape."""
    header = json.dumps(doc).encode()
    body = header + tail if binary else header
    try:
        request = decode_request(body, str(len(header)) if binary else None)
    except (InvalidInput, PayloadTooLarge):
        return
    for name, array in request.inputs.items():
        assert isinstance(name, str) and isinstance(array, np.ndarray)
    if request.binary_output:  # only a literal true asks for binary ("false" did: finding 16)
        assert doc["parameters"]["binary_data_output"] is True


def test_shared_memory_tensors_are_decoded_as_references() -> None:
    doc = {
        "inputs": [
            {"name": "a", "shape": [1], "datatype": "INT32", "data": [1]},
            {
                "name": "b",
                "shape": [2, 2],
                "datatype": "FP16",
                "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8},
            },
        ],
        "outputs": [
            {
                "name": "y",
                "parameters": {
                    "binary_data": False,
                    "shared_memory_region": "o",
                    "shared_memory_byte_size": 64,
                    "shared_memory_offset": 16,
                },
            },
            {"name": "z"},
        ],
    }
    request = decode_request(json.dumps(doc).encode(), None)
    assert list(request.inputs) == ["a"]
    assert request.shared_inputs == {
        "b": SharedInput(SharedMemoryRef("r", 8, 0), "FP16", (2, 2), 1)
    }
    assert request.outputs == [
        RequestedOutput("y", False, shared=SharedMemoryRef("o", 64, 16)),
        RequestedOutput("z"),
    ]
    assert request.uses_shared_memory
    assert not decode_request(
        b'{"inputs": [{"name": "a", "shape": [1], "datatype": "INT32", "data": [1]}]}', None
    ).uses_shared_memory


def test_an_output_in_shared_memory_is_answered_with_its_metadata_only() -> None:
    request = InferRequest(
        {},
        None,
        {"binary_data_output": True},
        [RequestedOutput("y", shared=SharedMemoryRef("o", 64))],
    )
    body, headers = encode_response(request, "m", "1", {"y": np.ones((2, 3), np.float32)})
    assert headers == {"Content-Type": "application/json"}
    assert json.loads(body)["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [2, 3]}]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"shared_memory_region": "r"}, "shared_memory_region needs shared_memory_byte_size"),
        ({"shared_memory_byte_size": 4}, "shared_memory_byte_size needs shared_memory_region"),
        ({"shared_memory_offset": 4}, "shared_memory_offset needs"),
        ({"shared_memory_region": 5, "shared_memory_byte_size": 4}, "must be a region's name"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": True}, "non-negative"),
        (
            {"shared_memory_region": "r", "shared_memory_byte_size": 4, "shared_memory_offset": -1},
            "non-negative",
        ),
        (
            {"shared_memory_region": "r", "shared_memory_byte_size": 4, "binary_data_size": 4},
            "takes no 'data' or binary_data_size",
        ),
    ],
)
def test_shared_memory_parameters_are_checked(parameters: dict[str, Any], message: str) -> None:
    doc = {"inputs": [{"name": "a", "shape": [1], "datatype": "INT32", "parameters": parameters}]}
    body = json.dumps(doc).encode()
    if "binary_data_size" in parameters:
        body += b"\0" * 4
        header: str | None = str(len(json.dumps(doc)))
    else:
        header = None
    with pytest.raises(InvalidInput, match=message):
        decode_request(body, header)


def test_the_boolean_search_runs_at_most_once_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Integer tensors take the general path, which asks whether the text holds a JSON
    boolean: fifty of them search the request's text once, not fifty times."""
    searched: list[bytes] = []

    class CountingText(bytes):
        def __contains__(self, part: object) -> bool:
            assert isinstance(part, bytes)
            searched.append(part)
            return bytes.__contains__(self, part)

    class Counting(codec._BoolSearch):
        __slots__ = ()

        def __init__(self, text: bytes) -> None:
            super().__init__(CountingText(text))

    monkeypatch.setattr(codec, "_BoolSearch", Counting)
    inputs = [
        {"name": f"x{i}", "shape": [2], "datatype": "INT32", "data": [i, 2]} for i in range(50)
    ]
    decoded = decode_request(json.dumps({"inputs": inputs}).encode(), None)
    assert len(decoded.inputs) == 50
    assert searched == [b"true", b"false"]  # one search: neither word is in the text


def decode_with_names(front: str, input_name: str, output_name: str) -> InferRequest:
    """A one-input request asking for one output, decoded by ``front`` ("http", "grpc")."""
    if front == "http":
        doc = {
            "inputs": [{"name": input_name, "shape": [1], "datatype": "FP32", "data": [1]}],
            "outputs": [{"name": output_name}],
        }
        return decode_request(json.dumps(doc).encode(), None)
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name=input_name, datatype="FP32", shape=[1])
    tensor.contents.fp32_contents.append(1.0)
    request.outputs.add(name=output_name)
    return grpc_tensors.decode(request, Limits())


@pytest.mark.parametrize("where", ["input", "output"])
@pytest.mark.parametrize("front", ["http", "grpc"])
def test_a_tensor_name_over_1024_characters_is_400_without_echoing_it(
    where: str, front: str
) -> None:
    """Issue 29 finding 6: a name of megabytes is never a model's; as JSON between a worker
    and an isolated runner it became a frame over its bound. Refused at decode, by both
    front ends, for inputs and requested outputs alike; the message does not quote it."""
    long, fits = "\x01" * 1025, "n" * 1024
    names = (long, fits) if where == "input" else (fits, long)
    with pytest.raises(InvalidInput) as caught:
        decode_with_names(front, *names)
    assert caught.value.message == f"an {where} name of 1025 characters; at most 1024"
    assert list(decode_with_names(front, fits, fits).inputs) == [fits]


def _body(header: dict[str, Any], *chunks: bytes) -> tuple[bytes, str]:
    text = json.dumps(header).encode()
    return text + b"".join(chunks), str(len(text))


def test_a_repeated_binary_header_decodes_each_body_as_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second request with a header skips its parse (the plan), yet every request gets
    its own tensors, parameters and outputs, read and checked from its own bytes."""
    monkeypatch.setattr(codec, "_PLANS", {})
    header = {
        "id": "r",
        "parameters": {"priority": 1},
        "inputs": [
            {
                "name": "x",
                "datatype": "FP32",
                "shape": [1, 2],
                "parameters": {"binary_data_size": 8},
            },
            {"name": "b", "datatype": "BOOL", "shape": [2], "parameters": {"binary_data_size": 2}},
        ],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    }
    parses = 0
    real_loads = codec.orjson.loads

    def counted(text: bytes) -> Any:
        nonlocal parses
        parses += 1
        return real_loads(text)

    monkeypatch.setattr(codec.orjson, "loads", counted)
    x1, x2 = np.float32([[1, 2]]), np.float32([[3, 4]])
    first = decode_request(*_body(header, x1.tobytes(), b"\x01\x00"))
    second = decode_request(*_body(header, x2.tobytes(), b"\x00\x01"))
    assert parses == 1  # the repeat was planned
    assert first.inputs["x"].tolist() == [[1, 2]] and second.inputs["x"].tolist() == [[3, 4]]
    assert second.inputs["b"].tolist() == [False, True]
    assert (second.id, second.parameters) == ("r", {"priority": 1})
    assert second.outputs == first.outputs == [RequestedOutput("y", True)]
    second.parameters["priority"] = 9  # a plugin's change stays in its own request
    second.outputs.clear()  # type: ignore[union-attr]
    third = decode_request(*_body(header, x1.tobytes(), b"\x01\x01"))
    assert third.parameters == {"priority": 1} and third.outputs == [RequestedOutput("y", True)]
    # What depends on the bytes is checked on every request, planned or not.
    with pytest.raises(InvalidInput, match="BOOL elements must be the bytes 0 or 1"):
        decode_request(*_body(header, x1.tobytes(), b"\x01\x02"))
    with pytest.raises(InvalidInput, match="runs past the body|belong to no input"):
        decode_request(*_body(header, x1.tobytes(), b"\x01"))  # another length: no plan
    assert parses == 2  # the body of another length alone was parsed again


def test_only_all_binary_headers_of_plain_parameters_are_planned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(codec, "_PLANS", {})
    binary = {"name": "x", "datatype": "INT32", "shape": [1], "parameters": {"binary_data_size": 4}}
    as_json = {"name": "j", "datatype": "INT32", "shape": [1], "data": [7]}
    decode_request(*_body({"inputs": [binary, as_json]}, b"\x01\x00\x00\x00"))
    decode_request(*_body({"inputs": [binary], "parameters": {"nested": {"a": 1}}},
                          b"\x01\x00\x00\x00"))  # fmt: skip
    assert codec._PLANS == {}
    decode_request(*_body({"inputs": [binary], "parameters": {"tenant": "t"}}, b"\x01\x00\x00\x00"))
    assert len(codec._PLANS) == 1


def test_the_plans_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "_PLANS", {})
    for i in range(codec.PLANS_KEPT + 20):
        header = {"id": str(i), "inputs": [
            {"name": "x", "datatype": "UINT8", "shape": [1], "parameters": {"binary_data_size": 1}}
        ]}  # fmt: skip
        assert decode_request(*_body(header, bytes([i % 256]))).id == str(i)
    assert len(codec._PLANS) == codec.PLANS_KEPT
    long_id = {"id": "x" * codec.PLANNED_HEADER_BYTES, "inputs": [
        {"name": "x", "datatype": "UINT8", "shape": [1], "parameters": {"binary_data_size": 1}}
    ]}  # fmt: skip
    before = dict(codec._PLANS)
    decode_request(*_body(long_id, b"\x00"))
    assert before == codec._PLANS  # a header that long is parsed every time


def _general(model: str, version: str, outputs: dict[str, np.ndarray]) -> bytes:
    """The answer through encode_response's general path (each output named, as JSON)."""
    asked = [RequestedOutput(name, False) for name in outputs]
    return encode_response(InferRequest({}, outputs=asked), model, version, outputs)[0]


@pytest.mark.parametrize(
    "outputs",
    [
        {"y": np.array([[1.5, 1e-7, -3.0]], dtype=np.float32)},
        {"y": np.linspace(-1e30, 1e30, 7).astype(np.float64), "z": np.ones((2, 0), np.float16)},
        {'a "quoted"\x00 name\n': np.array(0.1, dtype=np.float32), "é": np.zeros(3, ">f4")},
    ],
)
def test_a_kept_json_answer_is_the_bytes_the_general_path_writes(
    monkeypatch: pytest.MonkeyPatch, outputs: dict[str, np.ndarray]
) -> None:
    monkeypatch.setattr(codec, "_ANSWERS", {})
    plain = InferRequest({})
    for _ in range(2):  # the skeleton made, then kept
        body, headers = encode_response(plain, "m\x00\"'", "1", outputs)
        assert body == _general("m\x00\"'", "1", outputs)
        assert headers == {"Content-Type": "application/json"}
    assert len(codec._ANSWERS) == 1
    assert json.loads(body)["outputs"][0]["data"] == next(iter(outputs.values())).ravel().tolist()


def test_a_kept_json_answer_leaves_inf_nan_and_other_types_to_the_general_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(codec, "_ANSWERS", {})
    plain = InferRequest({})
    for _ in range(2):
        body, _ = encode_response(plain, "m", "1", {"y": np.array([1.0, np.inf, np.nan])})
        assert b"[1.0,Infinity,NaN]" in body  # as Python's json writes them, not null
        mixed = {"y": np.ones(2, np.float32), "n": np.arange(2)}
        assert encode_response(plain, "m", "1", mixed)[0] == _general("m", "1", mixed)
    key = ("m", "1", ("y", np.dtype(np.float32), (2,)), ("n", np.dtype(np.int64), (2,)))
    assert codec._ANSWERS[key] is None  # known not to fit: not tried again


def test_the_kept_json_answers_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "_ANSWERS", {})
    for i in range(codec.ANSWERS_KEPT + 20):
        encode_response(InferRequest({}), "m", str(i), {"y": np.zeros(1, np.float32)})
    assert len(codec._ANSWERS) == codec.ANSWERS_KEPT
    assert ("m", "0", ("y", np.dtype(np.float32), (1,))) not in codec._ANSWERS  # the oldest
