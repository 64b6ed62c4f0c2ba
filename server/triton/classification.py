"""Triton's classification extension: an output's top ``k`` classes as ``score:index[:label]``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from plugserve.registry.errors import InvalidInput
from plugserve.registry.execution.chain import Chain
from plugserve.registry.tensors.datatypes import v2_datatype

MAX_CLASSES = 1 << 20
"""The largest ``k`` a request may ask for (more classes than any output holds is clamped)."""


def class_count(parameters: Mapping[str, Any], where: str) -> int:
    """A requested output's ``classification`` parameter: ``k``, or 0 when absent.

    Raises :class:`InvalidInput` unless it is an integer from 0 to :data:`MAX_CLASSES`.
    """
    k = parameters.get("classification", 0)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_CLASSES:
        raise InvalidInput(
            f"{where}: parameter 'classification' must be an integer from 0 to {MAX_CLASSES}"
        )
    return k


def classify(
    array: np.ndarray, k: int, labels: Sequence[str] = (), batched: bool = False
) -> np.ndarray:
    """The top ``k`` elements of ``array`` as BYTES ``b"score:index[:label]"``, highest first.

    As Triton formats them: a float score with six decimals (C's ``%f``), an
    integer one as it is, the index, and the class's label when ``labels``
    has one. ``batched``: each row of the first dimension is classified on its
    own (shape ``[rows, k]``); otherwise the whole tensor is one (shape ``[k]``).
    ``k`` above the number of classes gives them all (Triton clamps too); equal
    scores keep index order. Raises :class:`InvalidInput` for a non-numeric array.
    """
    if array.dtype.kind not in "iuf":
        datatype = v2_datatype(array.dtype)
        raise InvalidInput(
            f"class result not available for output due to unsupported type '{datatype}'"
        )
    count_rows = array.shape[0] if batched and array.ndim else 1
    if count_rows == 0:  # an empty batch: no row to classify
        return np.empty((0, min(k, int(np.prod(array.shape[1:])))), dtype=object)
    rows = array.reshape(count_rows, -1)
    classes = rows.shape[1]
    count = min(k, classes)
    # Descending, ties in index order: a stable ascending sort of the reversed rows, reversed.
    order = classes - 1 - np.argsort(rows[:, ::-1], axis=1, kind="stable")[:, ::-1][:, :count]
    show = "{:f}".format if array.dtype.kind == "f" else str
    out = np.empty((rows.shape[0], count), dtype=object)
    for r, (row, indices) in enumerate(zip(rows.tolist(), order.tolist(), strict=True)):
        for c, index in enumerate(indices):
            text = f"{show(row[index])}:{index}"
            if index < len(labels):
                text += f":{labels[index]}"
            out[r, c] = text.encode()
    return out if batched and array.ndim else out.reshape(count)


def classify_outputs(
    chain: Chain, outputs: Mapping[str, np.ndarray], wanted: Mapping[str, int]
) -> dict[str, np.ndarray]:
    """``outputs`` with each output of ``wanted`` (name: ``k``) replaced by its top ``k``,
    labelled from the runner's ``[runner] labels``; batched when the runner batches."""
    runner = chain.runner.manifest.runner
    labels = runner.labels if runner is not None else {}
    batched = runner is not None and runner.max_batch_size > 0
    classified = dict(outputs)
    for name, k in wanted.items():
        if name in outputs:  # an unknown one is the encoder's 400
            classified[name] = classify(outputs[name], k, labels.get(name, ()), batched)
    return classified
