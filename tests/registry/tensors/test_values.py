"""Tensors from JSON values and exact casts: a value is carried exactly or refused."""

import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugserve.registry.tensors.datatypes import V2_TO_NUMPY
from plugserve.registry.tensors.values import cast_exact, from_json

NUMERIC = {name: dtype for name, dtype in V2_TO_NUMPY.items() if name != "BYTES"}


@pytest.mark.parametrize(
    ("datatype", "values", "message"),
    [
        ("INT8", [1.5], "1.5 (element 0) does not fit INT8: not an integer"),
        ("UINT8", [0, 300], "300 (element 1) does not fit UINT8: outside 0..255"),
        ("UINT64", [-1, 2**64 - 1], "does not fit UINT64: outside"),
        ("INT64", [2**63], "does not fit INT64: outside"),
        ("BOOL", ["x"], "BOOL takes JSON booleans; the data holds strings"),
        ("BOOL", [1], "BOOL takes JSON booleans; the data holds numbers"),
        ("INT8", [True], "INT8 takes JSON numbers; the data holds booleans"),
        ("FP32", ["1.5"], "FP32 takes JSON numbers; the data holds strings"),
        ("FP16", [1e10], "10000000000.0 (element 0) does not fit FP16: outside its range"),
        ("FP32", [1e300], "does not fit FP32: outside its range"),
        # floats only: the fast path leaves a value out of range to the general one, which
        # names it; past 4,096 values the range is checked by the largest magnitude
        ("FP32", [0.5, -2.5, 1e39, 0.25], "(element 2) does not fit FP32: outside its range"),
        ("FP32", [0.5] * 5000 + [-1e39], "(element 5000) does not fit FP32: outside its range"),
        ("FP16", [0.5, 65520.0], "(element 1) does not fit FP16: outside its range"),
        ("FP32", [[1, 2], [3]], "not a rectangular array"),
    ],
)
def test_json_values_must_fit_their_datatype_exactly(
    datatype: str, values: list[Any], message: str
) -> None:
    """issue 12, finding 16: INT8 1.5 was 1, BOOL "x" true, FP16 1e10 inf, without a word."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_json(values, V2_TO_NUMPY[datatype])


@pytest.mark.parametrize(
    ("datatype", "values"),
    [
        ("INT8", [-128, 127]),
        ("INT8", [1.0, -2.0]),  # integral numbers are integers, whatever JSON spelled
        ("UINT64", [0, 2**64 - 1]),  # inferred as float64 on its own: must stay exact
        ("INT64", [-(2**63), 2**63 - 1]),
        ("BOOL", [True, False]),
        ("FP16", [65504.0, 0.1]),  # rounding to the nearest FP16 is not a loss
        ("FP16", [65519.0, -65519.0]),  # past the largest, yet rounding to it
        ("FP32", [0.25] * 5000 + [3.4028234663852886e38]),
        ("FP32", [3.4028234663852886e38, -1.5, 1e-46]),  # FP32's largest; a subnormal's 0
        ("FP64", [1e300, -1e-300]),
        ("FP32", []),
    ],
)
def test_json_values_that_fit_are_carried_exactly(datatype: str, values: list[Any]) -> None:
    array = from_json(values, V2_TO_NUMPY[datatype])
    assert array.dtype == V2_TO_NUMPY[datatype]
    if datatype.startswith(("INT", "UINT", "BOOL")):
        assert array.tolist() == values


@pytest.mark.parametrize(
    ("array", "datatype", "message"),
    [
        (np.array([1.5]), "INT8", "not an integer"),
        (np.array([np.nan]), "INT32", "not an integer"),
        (np.array([200], np.int64), "INT8", "outside -128..127"),
        (np.array([-1], np.int8), "UINT64", "outside 0.."),
        (np.array([2], np.int64), "BOOL", "only 0 and 1 are booleans"),
        (np.array([1e300]), "FP32", "outside its range"),
        (np.array([70000], np.int32), "FP16", "outside its range"),
        (np.array([b"a"], object), "FP32", "BYTES cannot be converted to FP32"),
    ],
)
def test_a_cast_that_would_change_a_value_is_refused(
    array: np.ndarray, datatype: str, message: str
) -> None:
    """issue 12, finding 16: INT64 or FP64 data was cast to FP32 (and worse) silently."""
    with pytest.raises(ValueError, match=message):
        cast_exact(array, V2_TO_NUMPY[datatype])


def test_exact_casts_keep_values_and_non_finite_floats() -> None:
    assert cast_exact(np.array([1.0, -3.0]), V2_TO_NUMPY["INT8"]).tolist() == [1, -3]
    assert cast_exact(np.array([0, 1]), V2_TO_NUMPY["BOOL"]).tolist() == [False, True]
    kept = cast_exact(np.array([np.inf, np.nan, 0.5]), V2_TO_NUMPY["FP16"])
    assert np.isinf(kept[0]) and np.isnan(kept[1]) and kept[2] == 0.5
    same = np.zeros(3, np.float32)
    assert cast_exact(same, same.dtype) is same


json_values = st.recursive(
    # JSON holds no NaN nor infinity (orjson refuses both), so neither is generated.
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(json_values, st.sampled_from(sorted(NUMERIC)))
def test_any_json_value_is_carried_exactly_or_refused_with_a_reason(
    values: Any, datatype: str
) -> None:
    """The class of finding 16: nothing but ValueError escapes, and nothing changes silently."""
    dtype = NUMERIC[datatype]
    try:
        array = from_json(values, dtype)
    except ValueError:
        return
    assert array.dtype == dtype
    flat = np.asarray(values, dtype=object).reshape(-1).tolist() if array.size else []
    for got, sent in zip(array.reshape(-1).tolist(), flat, strict=True):
        if dtype.kind in "biu":
            assert got == sent and type(sent) is not str
        else:
            assert np.isfinite(got) and not isinstance(sent, bool)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(width=64), min_size=1, max_size=8),
    st.sampled_from(["FP16", "FP32", "FP64"]),
)
def test_a_list_of_floats_takes_the_fast_path_to_the_same_answer(
    values: list[float], datatype: str
) -> None:
    """A flat list of floats skips the general path: same array, or the same refusal."""
    dtype = V2_TO_NUMPY[datatype]
    try:
        expected = cast_exact(np.asarray(values), dtype)
    except ValueError as exc:
        with pytest.raises(ValueError, match=re.escape(str(exc))):
            from_json(values, dtype)
        return
    got = from_json(values, dtype, may_hold_bool=False)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected)  # inf and nan from a Python caller included


def test_a_non_native_float_type_takes_the_general_path() -> None:
    big_endian = np.dtype(">f8")
    array = from_json([1.5, -2.0], big_endian)
    assert array.dtype == big_endian and array.tolist() == [1.5, -2.0]
