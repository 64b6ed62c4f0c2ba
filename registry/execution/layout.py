"""How requests join a batch: each input's batch axis, shared and ragged inputs.

Without ``[runner.batching]`` every input and output holds its rows on axis 0, and
requests batch when their inputs agree beyond it (:func:`~plugserve.registry.execution.
batching.signature`). A :class:`BatchLayout` reads the declared table instead:

- ``axis = k``: rows are on axis ``k`` (a recurrent state ``[layers, batch, hidden]``);
  requests are concatenated along it, and outputs declared the same way split along it.
- ``shared = true``: one value for the whole batch (a sample rate, a threshold): it
  reaches the runner once, and requests whose values differ never batch together.
- ``ragged = "pad"``: requests may differ on the declared ``ragged_axes`` (and must agree
  on every other axis); each is padded with ``pad_value`` to the batch's largest, and
  ``lengths`` (INT64) gives each row's size on each ragged axis: ``[N]`` for one ragged
  axis, ``[N, k]`` for ``k``.
- ``ragged = "concat"``: each request's tensor is flattened and concatenated; ``lengths``
  holds each request's element count, and each request is one row.

Every tensor a batch merges its requests into keeps the bounds of one request's tensor
(:class:`TensorBounds`): a :class:`Footprint` counts what the merged tensors will hold as
requests join a forming batch, so one that would take a tensor past its bound starts the
next batch instead, before anything is allocated. A padded tensor also holds at most
:data:`PAD_WASTE` times the elements its requests sent (or :data:`PAD_FLOOR` elements), so
small requests never pad into a large batch. :func:`why_apart` says, in words, why two
requests could not share a batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

import numpy as np

from plugserve.registry.errors import InvalidInput
from plugserve.registry.manifest import DEFAULT_INPUT_BATCHING, BatchingSection, InputBatching

Arrays = Mapping[str, np.ndarray]
Signature = tuple[Any, ...] | None

SHARED_BYTES_KEPT = 256
"""A shared value up to this size is compared by its bytes; a larger one by a digest."""
RAGGED = -1
"""A padded input's ragged axis (and its batch axis) in its batching signature."""
PAD_WASTE = 4
"""A padded batch's tensor holds at most this many times the elements its requests sent."""
PAD_FLOOR = 1 << 16
"""Elements a padded batch's tensor may hold whatever its requests sent."""


@dataclass(frozen=True, slots=True)
class TensorBounds:
    """What one tensor may hold: the server's ``max_tensor_elements`` and, for a BYTES
    tensor, ``max_bytes_elements``. A request's tensors are checked against them as they
    are decoded; each tensor a batch merges several requests into keeps them too."""

    max_elements: int = 1 << 26
    max_bytes_elements: int = 1 << 20

    def elements(self, dtype: np.dtype[Any]) -> int:
        """The most elements a tensor of ``dtype`` may hold."""
        return self.max_bytes_elements if dtype.kind == "O" else self.max_elements


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
                if array.ndim <= max((spec.axis, *spec.ragged_axes)):
                    return rows or 1, None
                count = array.shape[spec.axis]
                shape = _fixed(array, spec) if spec.ragged == "pad" else _beyond(array, spec.axis)
                parts.append((name, array.dtype.str, shape))
            if rows is None:
                rows = count
            elif rows != count:
                return rows, None
        return (1 if rows is None else rows), tuple(parts)

    def rows(self, inputs: Arrays) -> int:
        return self.signature(inputs)[0]

    def merge(self, parts: Sequence[Arrays]) -> dict[str, np.ndarray]:
        """The inputs of one execution of ``parts`` (requests of one signature); a padded
        input without its batch axis or a ragged axis is the request's mistake (400)."""
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
                _check_padded(name, first[name], spec)
                merged[name] = _padded(arrays, spec)
                if spec.lengths:
                    merged[spec.lengths] = _lengths(arrays, spec)
            elif len(arrays) == 1:
                merged[name] = arrays[0]
            else:
                merged[name] = np.concatenate(arrays, axis=spec.axis)
        return merged

    def footprint(self, first: Arrays, bounds: TensorBounds) -> Footprint:
        """What a batch that ``first`` opens will merge into, kept within ``bounds``."""
        return Footprint(self, bounds, first)

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


class Footprint:
    """The size of each tensor a forming batch merges into, kept as requests join it.

    :meth:`admits` says whether one more request keeps every merged tensor within its
    bound (:class:`TensorBounds`), from shapes alone, before anything is allocated. A
    padded input's batch holds its rows times the largest size of each other axis, so
    requests that are each small but wide on different axes multiply: it is also kept
    within :data:`PAD_WASTE` times the elements its requests sent (any size up to
    :data:`PAD_FLOOR`). Any other input's holds the sum of its requests' elements; a
    shared input is one request's.
    """

    __slots__ = ("_bounds", "_elements", "_layout", "_sent", "_shapes")

    def __init__(self, layout: BatchLayout, bounds: TensorBounds, first: Arrays) -> None:
        self._layout = layout
        self._bounds = bounds
        self._elements: dict[str, int] = {}
        """Inputs concatenated: their elements so far."""
        self._shapes: dict[str, tuple[int, ...]] = {}
        """Padded inputs: their merged shape so far."""
        self._sent: dict[str, int] = {}
        """Padded inputs: the elements their requests sent so far."""
        for name, array in first.items():
            spec = layout.input(name)
            if spec.ragged == "pad":
                self._shapes[name] = array.shape
                self._sent[name] = array.size
            elif not spec.shared:
                self._elements[name] = array.size

    def admits(self, inputs: Arrays) -> bool:
        """Whether ``inputs`` (a request of the batch's signature) may join the batch:
        counted in if so; the batch is left as it was if not."""
        elements: dict[str, int] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        sent: dict[str, int] = {}
        for name, array in inputs.items():
            kept = self._elements.get(name)
            if kept is not None:
                count = elements[name] = kept + array.size
            elif name in self._shapes:
                shape = shapes[name] = _padded_shape(
                    self._shapes[name], array.shape, self._layout.input(name).axis
                )
                count = math.prod(shape)
                real = sent[name] = self._sent[name] + array.size
                if count > max(PAD_FLOOR, PAD_WASTE * real):
                    return False
            else:  # shared
                continue
            if count > self._bounds.elements(array.dtype):
                return False
        self._elements.update(elements)
        self._shapes.update(shapes)
        self._sent.update(sent)
        return True


def _padded_shape(kept: tuple[int, ...], shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """A padded batch's shape once a request of ``shape`` joins it: rows added on ``axis``,
    the largest size of each other axis."""
    return tuple(
        k + s if d == axis else max(k, s) for d, (k, s) in enumerate(zip(kept, shape, strict=True))
    )


def footprint(layout: BatchLayout | None, first: Arrays, bounds: TensorBounds) -> Footprint:
    """What a batch that ``first`` opens will merge into (``layout`` ``None``: every input's
    rows on axis 0)."""
    return (layout or _DEFAULT).footprint(first, bounds)


def _fixed(array: np.ndarray, spec: InputBatching) -> tuple[int, ...]:
    """A padded input's shape with its batch and ragged axes as :data:`RAGGED`: requests
    batch when the rest agrees."""
    free = {spec.axis, *spec.ragged_axes}
    return tuple(RAGGED if d in free else size for d, size in enumerate(array.shape))


def _check_padded(name: str, array: np.ndarray, spec: InputBatching) -> None:
    needed = max((spec.axis, *spec.ragged_axes)) + 1
    if array.ndim < needed:
        raise InvalidInput(
            f"input {name!r} has {array.ndim} dimensions; its batch axis {spec.axis} and "
            f"ragged axes {list(spec.ragged_axes)} need at least {needed}"
        )


def _lengths(arrays: Sequence[np.ndarray], spec: InputBatching) -> np.ndarray:
    """Each row's size on each ragged axis: ``[N]`` for one ragged axis, ``[N, k]`` for
    ``k``."""
    sizes = np.array([[a.shape[d] for d in spec.ragged_axes] for a in arrays], dtype=np.int64)
    rows = np.repeat(sizes, [a.shape[spec.axis] for a in arrays], axis=0)
    return rows[:, 0] if len(spec.ragged_axes) == 1 else rows


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
        if spec.ragged == "pad" and spec.ragged_axes and array.ndim <= max(spec.ragged_axes):
            return (
                f"padded input {name!r} has {array.ndim} dimensions and no ragged axis "
                f"{max(spec.ragged_axes)}"
            )
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
        if spec.ragged == "pad" and _fixed(theirs, spec) != _fixed(array, spec):
            return (
                f"padded input {name!r} has shape {list(array.shape)} in one request and "
                f"{list(theirs.shape)} in another: only its ragged_axes "
                f"{list(spec.ragged_axes)} may differ"
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
