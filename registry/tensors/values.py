"""Tensors from client data without a silent change of value: JSON values and exact casts.

A value that cannot be carried exactly is refused with a reason (``ValueError``);
callers turn it into a 400 naming the input. Rounding a number to the nearest
float of the target type is not a change of value; a finite number that becomes
``inf``, a fraction cast to an integer type, a number outside an integer type's
range, or a number other than 0 and 1 cast to ``BOOL`` is.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from operator import countOf
from typing import Any

import numpy as np

from plugserve.registry.tensors.datatypes import v2_datatype

MayHoldBool = bool | Callable[[], bool]
"""Whether JSON data may hold a boolean: known, or asked only when it matters."""

_JSON_KINDS = {"b": "booleans", "i": "numbers", "u": "numbers", "f": "numbers"}


def from_json(values: Any, dtype: np.dtype[Any], may_hold_bool: MayHoldBool = True) -> np.ndarray:
    """An array of ``dtype`` from parsed JSON ``values`` (nested lists), refusing any loss.

    ``BOOL`` takes JSON booleans only, numeric types take numbers only (no
    booleans, no strings), and each value must survive the conversion.
    ``may_hold_bool`` false (or a callable answering false): the caller knows the
    values hold no boolean (the JSON text had no ``true`` or ``false``), which spares
    a pass over them.
    """
    floats = _float_list(values, dtype)
    if floats is not None:
        return floats
    try:
        raw = np.asarray(values)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the data is not a rectangular array: {exc}") from None
    if raw.size == 0:
        return np.empty(raw.shape, dtype=dtype)
    want = "booleans" if dtype.kind == "b" else "numbers"
    got = _JSON_KINDS.get(raw.dtype.kind, "strings or mixed values")
    # [true, 2] is inferred as integers; the text is searched only when that could be so.
    if got == "numbers" and _may_hold(may_hold_bool) and _holds_bool(values):
        got = "booleans among numbers"
    if got != want:
        raise ValueError(f"{v2_datatype(dtype)} takes JSON {want}; the data holds {got}")
    if raw.dtype.kind in "iu" and dtype.kind == "f" and dtype.itemsize >= 4:
        return raw.astype(dtype)  # any int64 lies within float32's range: rounding only
    if raw.dtype.kind == "f" and dtype.kind in "iu" and dtype.itemsize == 8:
        # Integers beyond int64 beside others are inferred as float64, which rounds
        # them: read them as the target type, where numpy range-checks each one.
        try:
            with np.errstate(invalid="ignore", over="ignore"):
                exact = np.asarray(values, dtype=dtype)
            if np.array_equal(exact.astype(np.float64), raw):
                return exact
        except (OverflowError, ValueError, TypeError):
            pass  # cast_exact names the value
    return cast_exact(raw, dtype)


def _float_list(values: Any, dtype: np.dtype[Any]) -> np.ndarray | None:
    """The common case, without the general path's search for booleans: a flat list of
    floats (JSON numbers with a point or an exponent) for a floating-point type.
    ``None``: anything else, for the general path.

    The floats are read as float64 (Python's own floats: no rounding), then narrowed in
    one rounding when every one lies within ``dtype``'s range. A value beyond it (or
    ``inf`` or ``nan``, which a lenient parser may let in) is left to the general path,
    which names the value it cannot carry."""
    if dtype.kind != "f" or type(values) is not list or not values:
        return None
    if countOf(map(type, values), float) != len(values):  # a bool, int, string or list
        return None
    array = _doubles(values)
    if dtype.itemsize == 8:
        return array if dtype == _FLOAT64 else array.astype(dtype)
    limit = _LIMITS.get(dtype.itemsize)
    if limit is None or not _within_limit(array, limit):
        return None
    return array.astype(dtype)


_FLOAT64 = np.dtype(np.float64)


def _doubles(values: list[float]) -> np.ndarray:
    """A list of Python floats as a new float64 array. ``struct`` packs a few thousand at
    C speed, straight into the array (half the cost of numpy's conversion, which looks at
    each element's type); a longer list through numpy, without a tuple of its values."""
    count = len(values)
    if count > 4096:
        return np.fromiter(values, dtype=_FLOAT64, count=count)
    array = np.empty(count, dtype=_FLOAT64)
    _packer(count)(array, 0, *values)
    return array


@functools.lru_cache(maxsize=64)
def _packer(count: int) -> Callable[..., None]:
    return struct.Struct(f"={count}d").pack_into


_LIMITS = {2: float(np.finfo(np.float16).max), 4: float(np.finfo(np.float32).max)}
"""The largest magnitude of the narrower float types, by item size."""


def _within_limit(array: np.ndarray, limit: float) -> bool:
    """Whether every value of a float64 array is finite and within ``[-limit, limit]``
    (``nan`` compares false). Up to 4,096 values, by their sum of squares: one BLAS pass,
    and ``vdot``, unlike ``dot``, raises no floating-point warning when a huge value
    overflows it (then the value is out of range anyway). Beyond, where BLAS would start
    threads of its own, by the largest magnitude."""
    if array.size <= 4096:
        return bool(np.vdot(array, array) <= limit * limit)
    return bool(np.maximum.reduce(np.abs(array)) <= limit)


def _may_hold(may_hold_bool: MayHoldBool) -> bool:
    return may_hold_bool() if callable(may_hold_bool) else may_hold_bool


def _holds_bool(values: Any) -> bool:
    """Whether a rectangular nest of lists (numpy read it: at most 64 deep) holds a boolean."""
    if type(values) is not list:
        return type(values) is bool
    if values and type(values[0]) is list:
        return any(_holds_bool(row) for row in values)
    return bool in set(map(type, values))


def cast_exact(array: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """``array`` as ``dtype``; ``ValueError`` naming the first value the cast would change."""
    if array.dtype == dtype:
        return array
    source, target = array.dtype.kind, dtype.kind
    if source not in "biuf" or target not in "biuf":
        raise ValueError(f"{_name(array.dtype)} cannot be converted to {_name(dtype)}")
    if array.size == 0:
        return array.astype(dtype)
    if target == "b":
        bad = (array != 0) & (array != 1)
        _refuse(array, bad, dtype, "only 0 and 1 are booleans")
    elif target in "iu":
        _check_integers(array, dtype)
    elif source != "b" and not _within(array, float(np.finfo(dtype).max)):
        with np.errstate(over="ignore", invalid="ignore"):
            result = array.astype(dtype)
        overflowed = ~np.isfinite(result)
        if source == "f":
            overflowed &= np.isfinite(array)  # inf and nan stay what they are
        _refuse(array, overflowed, dtype, "outside its range")
        return result
    return array.astype(dtype)


def _within(array: np.ndarray, limit: float) -> bool:
    """Whether every value lies in [-limit, limit] (the fast path; NaN says no)."""
    if array.size <= 64:  # a small request's tensor: a numpy reduction costs more
        return all(-limit <= value <= limit for value in array.reshape(-1).tolist())
    # One pass: the largest magnitude (ptp or min and max would take two).
    return bool(np.abs(array).max() <= limit)


def _check_integers(array: np.ndarray, dtype: np.dtype[Any]) -> None:
    info = np.iinfo(dtype)
    if array.dtype.kind == "f":
        fractional = ~np.isfinite(array) | (np.floor(array) != array)
        _refuse(array, fractional, dtype, "not an integer")
        # 2**63 and 2**64 are exact floats: compare against them, not against max (rounded).
        outside = (array < info.min) | (array >= float(int(info.max) + 1))
    elif array.dtype.kind in "iu":
        # numpy 2 compares with out-of-range Python integers exactly.
        if info.min <= array.min() and array.max() <= info.max:
            return
        outside = (array < info.min) | (array > info.max)
    else:
        return
    _refuse(array, outside, dtype, f"outside {info.min}..{info.max}")


def _refuse(array: np.ndarray, bad: np.ndarray, dtype: np.dtype[Any], why: str) -> None:
    if not bad.any():
        return
    index = int(np.argmax(bad.reshape(-1)))
    value = array.reshape(-1)[index].item()
    raise ValueError(f"{value!r} (element {index}) does not fit {_name(dtype)}: {why}")


def _name(dtype: np.dtype[Any]) -> str:
    try:
        return v2_datatype(dtype)
    except KeyError:
        return str(dtype)


_U32 = struct.Struct("<I")


def bytes_elements(array: np.ndarray) -> bytes:
    """``BYTES`` elements as the v2 binary format carries them: each a little-endian u32
    length, then its bytes (a ``str`` as UTF-8)."""
    parts = []
    for value in array.reshape(-1):
        raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
        parts.append(_U32.pack(len(raw)))
        parts.append(raw)
    return b"".join(parts)
