"""Tensors checked against a stage's declared inputs: names, ranks, dimensions, datatypes."""

import numpy as np
import pytest

from plugserve.registry.errors import InvalidInput
from plugserve.registry.tensors.inputs import conform, input_specs

SPECS = input_specs(
    {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [-1, 4]},
            {"name": "s", "datatype": "BYTES", "shape": [-1]},
            {"name": "junk"},  # no datatype: not a spec
            "junk",
        ]
    }
)
GOOD = {"x": np.zeros((2, 4), np.float32), "s": np.array([b"a", b"b"], object)}


def test_specs_skip_malformed_entries_and_metadata() -> None:
    assert [s.name for s in SPECS] == ["x", "s"]
    assert SPECS[0].shape == (-1, 4) and SPECS[0].dtype == np.float32
    assert input_specs(None) == input_specs({"inputs": 5}) == input_specs([1]) == ()
    assert input_specs({"inputs": [{"name": "b", "datatype": "BF16"}]})[0].dtype is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": np.zeros(1, np.float32)}, "unknown input(s) ['q']; route 'r' takes ['s', 'x']"),
        ({"x": None}, "missing input(s) ['x']; route 'r' takes ['s', 'x']"),
        (
            {"x": np.zeros((2, 3), np.float32)},
            "input 'x' has shape [2, 3], route 'r' takes [-1, 4]",
        ),
        ({"x": np.zeros(4, np.float32)}, "input 'x' has shape [4], route 'r' takes [-1, 4]"),
        ({"x": np.zeros((2, 4))}, "input 'x' is FP32; the request sent FP64"),
        ({"s": np.zeros(2, np.int64)}, "input 's' is BYTES; the request sent INT64"),
    ],
)
def test_a_request_that_does_not_match_is_refused_naming_what_differs(
    change: dict[str, np.ndarray | None], message: str
) -> None:
    """issue 12, findings 15 and 16: unknown names, ranks and datatypes are the client's 400."""
    inputs = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(InvalidInput) as info:
        conform(SPECS, inputs, "route 'r'", cast=False)
    assert message in info.value.message


def test_matching_inputs_pass_through_untouched() -> None:
    assert conform(SPECS, GOOD, "route 'r'", cast=False) is GOOD
    assert conform((), {"anything": np.zeros(1)}, "route 'r'", cast=False)


def test_with_cast_other_datatypes_are_converted_only_without_loss() -> None:
    """issue 12, finding 16: [runner] cast_inputs casts, and a lossy cast is still a 400."""
    inputs = {**GOOD, "x": np.ones((1, 4), np.int64)}
    converted = conform(SPECS, inputs, "runner r", cast=True)
    assert converted["x"].dtype == np.float32 and converted["x"].tolist() == [[1.0] * 4]
    assert inputs["x"].dtype == np.int64  # the caller's dict is not changed
    with pytest.raises(InvalidInput, match=r"input 'x' of runner r: 1e\+300 .* outside"):
        conform(SPECS, {**GOOD, "x": np.full((1, 4), 1e300)}, "runner r", cast=True)
