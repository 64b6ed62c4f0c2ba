"""How requests join a batch: each input's batch axis, shared and ragged inputs.

Without ``[runner.batching]`` every input and output holds its rows on axis 0, and
requests batch when their inputs agree beyond it (:func:`~plugserve.registry.execution.
batching.signature`). A :class:`BatchLayout` reads the declared table instead:

- ``axis = k``: rows are on axis ``k`` (a recurrent state ``[layers, batch, hidden]``);
  requests are concatenated along it, and outputs declared the same way split along it.
- ``shared = true``: one value for the whole batch (a sample rate, a threshold): it
  reaches the runner once, and requests whose values differ never batch together.
- ``ragged = "pad"``: requests may differ beyond the batch axis; each is padded with
  ``pad_value`` to the batch's largest, and ``lengths`` (INT64, a value per row) tells
  the runner each row's length along the last axis.
- ``ragged = "concat"``: each request's tensor is flattened and concatenated; ``lengths``
  holds each request's element count, and each request is one row.

:func:`why_apart` says, in words, why two requests could not share a batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from hashlib import blake2b
from typing import Any

import numpy as np

from plugserve.registry.manifest import DEFAULT_INPUT_BATCHING, BatchingSection, InputBatching

Arrays = Mapping[str, np.ndarray]
Signature = tuple[Any, ...] | None

SHARED_BYTES_KEPT = 256
"""A shared value up to this size is compared by its bytes; a larger one by a digest."""


class BatchLayout:
    """A runner's declared batching (``[runner.batching]``)."""

    __slots__ = ("_inputs", "_outputs", "reshapes")

    def __init__(self, section: BatchingSection) -> None:
        self._inputs = dict(section.inputs)
        self._outputs = dict(section.outputs)
        self.reshapes = any(spec.ragged for spec in self._inputs.values())
        """Whether even a request alone reaches the runner changed (ragged inputs: the
        ``lengths`` inputs are made, a concatenated input is flattened)."""

    def input(self, name: str) -> InputBatching:
        return self._inputs.get(name, DEFAULT_INPUT_BATCHING)

    def input_axis(self, name: str) -> int:
        return self.input(name).axis

    def output_axis(self, name: str) -> int:
        return self._outputs.get(name, 0)

    def signature(self, inputs: Arrays) -> tuple[int, Signature]:
        """Rows of ``inputs`` and their batching signature (``None``: it joins no batch)."""
        rows: int | None = None
        parts: list[tuple[Any, ...]] = []
        for name in sorted(inputs):
            array = inputs[name]
            spec = self.input(name)
            if spec.shared:
                raw = array.tobytes()
                value = raw if len(raw) <= SHARED_BYTES_KEPT else blake2b(raw).digest()
                parts.append((name, array.dtype.str, array.shape, value))
                continue
            if spec.ragged == "concat":
                parts.append((name, array.dtype.str, "concat"))
                count = 1
            else:
                if array.ndim <= spec.axis:
                    return rows or 1, None
                count = array.shape[spec.axis]
                shape: Any = array.ndim if spec.ragged == "pad" else _beyond(array, spec.axis)
                parts.append((name, array.dtype.str, shape))
            if rows is None:
                rows = count
            elif rows != count:
                return rows, None
        return (1 if rows is None else rows), tuple(parts)

    def rows(self, inputs: Arrays) -> int:
        return self.signature(inputs)[0]

    def merge(self, parts: Sequence[Arrays]) -> dict[str, np.ndarray]:
        """The inputs of one execution of ``parts`` (requests of one signature)."""
        first = parts[0]
        merged: dict[str, np.ndarray] = {}
        for name in first:
            spec = self.input(name)
            arrays = [p[name] for p in parts]
            if spec.shared:
                merged[name] = first[name]
            elif spec.ragged == "concat":
                merged[name] = np.concatenate([a.reshape(-1) for a in arrays])
                assert spec.lengths is not None  # the manifest requires it
                merged[spec.lengths] = np.array([a.size for a in arrays], dtype=np.int64)
            elif spec.ragged == "pad":
                merged[name] = _padded(arrays, spec)
                if spec.lengths:
                    merged[spec.lengths] = np.repeat(
                        np.array([a.shape[-1] for a in arrays], dtype=np.int64),
                        [a.shape[spec.axis] for a in arrays],
                    )
            elif len(arrays) == 1:
                merged[name] = arrays[0]
            else:
                merged[name] = np.concatenate(arrays, axis=spec.axis)
        return merged

    def split(self, outputs: Arrays, counts: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Each request's slice of a batch's ``outputs``; ``ValueError`` naming an output
        that does not hold ``sum(counts)`` rows on its axis."""
        total = sum(counts)
        for name, value in outputs.items():
            axis = self.output_axis(name)
            if (
                not isinstance(value, np.ndarray)
                or value.ndim <= axis
                or value.shape[axis] != total
            ):
                shape = getattr(value, "shape", type(value).__name__)
                raise ValueError(
                    f"output {name!r} has shape {shape}; a batch of {total} rows needs "
                    f"{total} on its axis {axis}"
                )
        answers = []
        offset = 0
        for count in counts:
            end = offset + count
            answers.append(
                {n: _rows_of(v, self.output_axis(n), offset, end) for n, v in outputs.items()}
            )
            offset = end
        return answers


def _padded(arrays: Sequence[np.ndarray], spec: InputBatching) -> np.ndarray:
    """``arrays`` padded at their ends to the largest of each axis, then concatenated on
    the batch axis."""
    ndim = arrays[0].ndim
    target = [max(a.shape[d] for a in arrays) for d in range(ndim)]
    padded = []
    for array in arrays:
        widths = [(0, 0 if d == spec.axis else target[d] - array.shape[d]) for d in range(ndim)]
        if any(w for _, w in widths):
            array = np.pad(array, widths, constant_values=spec.pad_value)
        padded.append(array)
    return padded[0] if len(padded) == 1 else np.concatenate(padded, axis=spec.axis)


def _beyond(array: np.ndarray, axis: int) -> tuple[int, ...]:
    """``array``'s shape without its batch axis."""
    return array.shape[:axis] + array.shape[axis + 1 :]


def _rows_of(value: np.ndarray, axis: int, start: int, end: int) -> np.ndarray:
    if axis == 0:
        return value[start:end]
    index: tuple[slice, ...] = (slice(None),) * axis + (slice(start, end),)
    return value[index]


def why_apart(layout: BatchLayout | None, one: Arrays, other: Arrays | None) -> str:
    """Why ``one`` runs without ``other`` (or, ``other`` None, why it joins no batch), in
    words a runner's author can act on."""
    layout = layout or _DEFAULT
    if other is not None and set(one) != set(other):
        return "requests send different inputs: " + ", ".join(sorted(set(one) ^ set(other)))
    rows_of: dict[str, int] = {}
    for name in sorted(one):
        array, spec = one[name], layout.input(name)
        if spec.shared:
            if other is not None and not np.array_equal(array, other[name]):
                return (
                    f"shared input {name!r} differs between requests: requests with "
                    "different values never batch together"
                )
            continue
        if spec.ragged != "concat" and array.ndim <= spec.axis:
            return (
                f"input {name!r} has {array.ndim} dimensions and no batch axis {spec.axis}: "
                "declare it shared (one value for the batch) or its axis in "
                "[runner.batching.inputs]"
            )
        rows_of[name] = 1 if spec.ragged == "concat" else array.shape[spec.axis]
        if other is None:
            continue
        theirs = other[name]
        if theirs.dtype != array.dtype:
            return f"input {name!r} is {array.dtype} in one request and {theirs.dtype} in another"
        if spec.ragged == "pad" and theirs.ndim != array.ndim:
            return (
                f"ragged input {name!r} has {array.ndim} dimensions in one request and "
                f"{theirs.ndim} in another"
            )
        if spec.ragged is None and _beyond(theirs, spec.axis) != _beyond(array, spec.axis):
            return (
                f"input {name!r} has shape {list(array.shape)} in one request and "
                f"{list(theirs.shape)} in another: beyond the batch axis ({spec.axis}) they "
                "must agree, or the input be declared ragged"
            )
    if len(set(rows_of.values())) > 1:
        shown = ", ".join(f"{n}: {r}" for n, r in rows_of.items())
        return (
            f"the inputs hold different rows on their batch axes ({shown}): declare each "
            "input's axis in [runner.batching.inputs]"
        )
    return "the requests' inputs differ"


_DEFAULT = BatchLayout(BatchingSection())
