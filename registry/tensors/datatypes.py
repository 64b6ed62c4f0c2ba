"""KServe v2 tensor datatypes and their numpy dtypes, both ways."""

from __future__ import annotations

import numpy as np

V2_TO_NUMPY: dict[str, np.dtype[np.generic]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}

_NUMPY_TO_V2 = {dtype: name for name, dtype in V2_TO_NUMPY.items()}


def numpy_dtype(datatype: str) -> np.dtype[np.generic]:
    """The numpy dtype of a v2 datatype; ``KeyError`` when it has none (``BF16``)."""
    return V2_TO_NUMPY[datatype]


def v2_datatype(dtype: np.dtype[np.generic]) -> str:
    """The v2 datatype of a numpy dtype; strings and bytes map to ``BYTES``.

    Raises ``KeyError`` for dtypes v2 cannot carry (complex, datetime, ...).
    """
    name = _NUMPY_TO_V2.get(dtype)  # a native dtype: one lookup
    if name is not None:
        return name
    if dtype.kind in "OSU":
        return "BYTES"
    return _NUMPY_TO_V2[dtype.newbyteorder("=")]
