import numpy as np
import pytest

from plugserve.registry.tensors.datatypes import V2_TO_NUMPY, numpy_dtype, v2_datatype


@pytest.mark.parametrize("datatype", sorted(V2_TO_NUMPY))
def test_every_v2_datatype_round_trips_through_numpy(datatype: str) -> None:
    assert v2_datatype(numpy_dtype(datatype)) == datatype


@pytest.mark.parametrize(
    ("dtype", "datatype"),
    [(np.dtype("<f4"), "FP32"), (np.dtype(">f4"), "FP32"), (np.dtype("U5"), "BYTES"),
     (np.dtype("S3"), "BYTES"), (np.dtype(object), "BYTES"), (np.dtype(bool), "BOOL")],
)  # fmt: skip
def test_numpy_dtypes_map_to_v2(dtype: np.dtype, datatype: str) -> None:  # type: ignore[type-arg]
    assert v2_datatype(dtype) == datatype


def test_types_v2_cannot_carry_are_refused() -> None:
    with pytest.raises(KeyError):
        v2_datatype(np.dtype(np.complex64))
    with pytest.raises(KeyError):
        numpy_dtype("BF16")
