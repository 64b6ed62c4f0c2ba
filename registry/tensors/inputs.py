"""A stage's declared inputs (``metadata()["inputs"]``) and the check of tensors against them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from plugserve.registry.errors import InvalidInput
from plugserve.registry.tensors.datatypes import V2_TO_NUMPY, v2_datatype
from plugserve.registry.tensors.values import cast_exact


@dataclass(frozen=True)
class InputSpec:
    """One declared input: ``dtype`` is ``None`` for a datatype numpy cannot hold (``BF16``),
    ``shape`` ``None`` when none is declared (``-1``: any size)."""

    name: str
    datatype: str
    dtype: np.dtype[Any] | None
    shape: tuple[int, ...] | None


def input_specs(metadata: Any) -> tuple[InputSpec, ...]:
    """The input specs of a ``metadata()`` result; entries lacking name or datatype are skipped."""
    raw = metadata.get("inputs") if isinstance(metadata, Mapping) else None
    specs = []
    for item in raw if isinstance(raw, list | tuple) else ():
        if not isinstance(item, Mapping):
            continue
        name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
        if not isinstance(name, str) or not isinstance(datatype, str):
            continue
        dims = None
        if isinstance(shape, list | tuple):
            dims = tuple(d if isinstance(d, int) and not isinstance(d, bool) else -1 for d in shape)
        specs.append(InputSpec(name, datatype, V2_TO_NUMPY.get(datatype), dims))
    return tuple(specs)


def conform(
    specs: tuple[InputSpec, ...], inputs: Mapping[str, np.ndarray], who: str, cast: bool
) -> Mapping[str, np.ndarray]:
    """``inputs`` checked against ``specs``: names, ranks, fixed dimensions and datatypes.

    With ``cast``, an array of another datatype is converted when no value
    changes (:func:`plugserve.registry.tensors.values.cast_exact`); without, a different datatype
    is refused naming both. Raises :class:`InvalidInput`; ``who`` names the
    taker in messages (``route 'iris'``, a plugin label).
    """
    if not specs:  # nothing declared: nothing to check against
        return inputs
    if len(inputs) != len(specs) or not all(s.name in inputs for s in specs):
        names = [s.name for s in specs]
        unknown = sorted(set(inputs) - set(names))
        if unknown:
            raise InvalidInput(f"unknown input(s) {unknown}; {who} takes {sorted(names)}")
        missing = sorted(set(names) - set(inputs))
        raise InvalidInput(f"missing input(s) {missing}; {who} takes {sorted(names)}")
    converted: dict[str, np.ndarray] | None = None
    for spec in specs:
        array = inputs[spec.name]
        _check_shape(spec, array, who)
        if spec.dtype is None or array.dtype == spec.dtype:
            continue
        if not cast:
            sent = _datatype(array)
            raise InvalidInput(f"input {spec.name!r} is {spec.datatype}; the request sent {sent}")
        try:
            array = cast_exact(array, spec.dtype)
        except ValueError as exc:
            raise InvalidInput(f"input {spec.name!r} of {who}: {exc}") from None
        converted = converted if converted is not None else dict(inputs)
        converted[spec.name] = array
    return inputs if converted is None else converted


def _check_shape(spec: InputSpec, array: np.ndarray, who: str) -> None:
    want = spec.shape
    if want is None:
        return
    got = array.shape
    if len(got) == len(want):
        for w, g in zip(want, got, strict=True):  # no generator: a few dimensions
            if w != -1 and w != g:
                break
        else:
            return
    raise InvalidInput(
        f"input {spec.name!r} has shape {list(got)}, {who} takes {list(want)} (-1: any)"
    )


def _datatype(array: np.ndarray) -> str:
    try:
        return v2_datatype(array.dtype)
    except KeyError:
        return str(array.dtype)
