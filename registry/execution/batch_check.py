"""Whether batching keeps a runner's answers: the same sample requests, alone and batched.

Batching is exact when each row's answer depends on that row alone: the model computes
row by row (a MatMul, a convolution, a softmax over a row's classes) and masks the
positions padding added (its ``lengths`` input). It is not when rows meet: dynamic
quantization (one activation scale for the whole batch), padding the model does not
mask, batch statistics (batch norm in training mode), anything that reduces over the
batch axis. Floating point also rounds a batch's sums otherwise than one row's, in the
last bits: answers are compared within a tolerance, ``atol + rtol * |alone|``.

:func:`check_batching` makes the sample requests (from the runner's declared inputs,
random with a seed, or read from a ``.npz``), runs each alone and all of them as one
batch, merged and split as the scheduler does (:class:`BatchLayout`), and compares the
answers. :func:`probe_outputs` runs one request and compares its outputs with the shapes
the runner declares.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plugserve.registry.errors import PlugserveError
from plugserve.registry.execution.layout import BatchLayout, why_apart
from plugserve.registry.manifest import BatchCheckSpec, BatchingSection
from plugserve.registry.tensors.inputs import InputSpec

Arrays = Mapping[str, np.ndarray]
Execute = Callable[[Arrays], Awaitable[Arrays]]

MAX_REQUESTS = 8
"""Random sample requests at most (fewer where ``max_batch_size`` is smaller)."""
FREE_SIZE = 3
"""The size of a dynamic axis that is neither the batch axis nor a ragged one."""
RAGGED_SIZES = (1, 8)
"""The sizes a random request takes on a ragged axis (so that padding happens)."""
SCALES = (0.25, 4.0)
"""Each random request's float values are scaled by a factor in this range: rows of a
batch differ in magnitude, as real ones do, which is what a per-batch scale shows."""
WHY = (
    "a row's answer depends on its batch-mates: dynamic quantization (one scale per "
    "batch), padding the model does not mask, batch statistics (batch norm in training "
    "mode), or a reduction over the batch axis"
)
_ALL_ON_AXIS_0 = BatchLayout(BatchingSection())


class _Unchecked(Exception):
    """The check cannot run: no sample requests can be made or run alone."""


@dataclass(frozen=True)
class Difference:
    """One output whose batched answers differ from those alone."""

    output: str
    requests: int
    """Requests whose answer differed."""
    largest: float
    """The largest absolute difference (``inf``: a shape, or values that are not numbers)."""
    shapes: str | None = None
    """``shape [..] alone, [..] batched`` where the shapes differ."""

    def text(self, of: int, spec: BatchCheckSpec) -> str:
        where = f"in {self.requests} of {of} requests"
        if self.shapes is not None:
            return f"batching changes output {self.output!r} {where}: {self.shapes}"
        if not math.isfinite(self.largest):  # text, or a NaN where alone was a number
            return f"batching changes output {self.output!r} {where}"
        return (
            f"batching changes output {self.output!r} {where}: largest difference "
            f"{self.largest:.3g} (rtol {spec.rtol:g}, atol {spec.atol:g})"
        )


@dataclass(frozen=True)
class BatchCheck:
    """What :func:`check_batching` found."""

    spec: BatchCheckSpec
    requests: int = 0
    differences: tuple[Difference, ...] = ()
    failed: str | None = None
    """The batch failed, or could not be split into answers, where each request alone ran."""
    skipped: str | None = None
    """Nothing to check: why (requests never batch)."""
    error: str | None = None
    """The check could not run: why (no sample requests could be made or run alone)."""
    padded: bool = False

    @property
    def exact(self) -> bool:
        """Batching keeps every answer (within the tolerance), or nothing batches."""
        return self.failed is None and self.error is None and not self.differences

    @property
    def outputs(self) -> list[str]:
        return [d.output for d in self.differences]

    def problems(self) -> list[str]:
        """One sentence per output that batching changes, or the batch's failure."""
        found = [d.text(self.requests, self.spec) for d in self.differences]
        if self.failed is not None:
            found.append(
                f"a batch of {self.requests} sample requests failed where each alone ran: "
                f"{self.failed}"
            )
        if self.error is not None:
            found.append(f"the batching check could not run: {self.error}")
        return found

    def why(self) -> str | None:
        """What makes batching change answers, where the check found it does."""
        if self.failed is not None:
            return "the runner refuses or mis-shapes a batch it is sent"
        return WHY if self.differences else None

    def text(self) -> str:
        """One line for a report: exact, skipped, or what differs."""
        if self.skipped is not None:
            return f"not checked: {self.skipped}"
        if self.exact:
            padded = ", padded" if self.padded else ""
            spec = self.spec
            return (
                f"exact: {self.requests} requests alone and batched{padded} "
                f"(rtol {spec.rtol:g}, atol {spec.atol:g})"
            )
        return "; ".join(self.problems())

    def as_json(self) -> dict[str, Any]:
        return {
            "exact": self.exact,
            "requests": self.requests,
            "padded": self.padded,
            "rtol": self.spec.rtol,
            "atol": self.spec.atol,
            "differences": [
                {"output": d.output, "requests": d.requests, "largest": _finite(d.largest),
                 "shapes": d.shapes}
                for d in self.differences
            ],
            "failed": self.failed,
            "skipped": self.skipped,
            "error": self.error,
        }  # fmt: skip


async def check_batching(
    execute: Execute,
    layout: BatchLayout | None,
    inputs: Sequence[InputSpec],
    spec: BatchCheckSpec,
    max_batch_size: int,
) -> BatchCheck:
    """Run the sample requests (``spec.sample``, else made from ``inputs``) through
    ``execute`` alone and as one batch of at most ``max_batch_size`` rows, and compare."""
    layout = layout or _ALL_ON_AXIS_0
    padded = any(layout.input(s.name).ragged == "pad" for s in inputs)

    def samples() -> list[dict[str, np.ndarray]]:
        if spec.sample is not None:
            requests = load_samples(spec.sample, layout)
        else:
            requests = sample_requests(inputs, layout, min(max_batch_size, MAX_REQUESTS), spec.seed)
        return _fitting(requests, layout, max_batch_size)

    # Reading a sample file, making, merging, splitting and comparing arrays: a thread's
    # work (a load runs beside requests served on the event loop); only the runs are awaited.
    try:
        requests = await asyncio.to_thread(samples)
    except _Unchecked as exc:
        return BatchCheck(spec, error=str(exc))
    count = len(requests)
    apart = _apart(requests, layout)
    if apart is not None:
        return BatchCheck(spec, requests=count, skipped=apart)
    try:
        alone = [await execute(layout.merge([r]) if layout.reshapes else r) for r in requests]
    except Exception as exc:
        return BatchCheck(spec, error=f"a sample request failed alone: {_said(exc)}")
    try:
        outputs = await execute(await asyncio.to_thread(layout.merge, requests))
        sizes = [layout.rows(r) for r in requests]
        batched = await asyncio.to_thread(layout.split, outputs, sizes)
    except Exception as exc:
        return BatchCheck(spec, requests=count, failed=_said(exc), padded=padded)
    found = await asyncio.to_thread(_differences, alone, batched, spec, padded)
    return BatchCheck(spec, count, found, padded=padded)


async def probe_outputs(
    execute: Execute,
    layout: BatchLayout | None,
    inputs: Sequence[InputSpec],
    metadata: Mapping[str, Any] | None,
    batching: bool,
    sample: Path | None = None,
) -> list[str]:
    """Run one sample input (two requests' rows merged, with ``batching``; from the
    ``sample`` file where given) and say where its outputs contradict the declared shapes
    (``metadata``'s outputs) and, with ``batching``, where an output does not hold the
    input's rows on its batch axis. Raises what the run raises."""
    declared = [o for o in (metadata or {}).get("outputs") or [] if isinstance(o, Mapping)]
    if not declared or not (inputs or sample):
        return []
    layout = layout or _ALL_ON_AXIS_0
    count = 2 if batching else 1
    try:
        if sample is not None:
            requests = load_samples(sample, layout)[:count]
        else:
            requests = sample_requests(inputs, layout, count, 0)
    except _Unchecked:
        return []
    rows = sum(layout.rows(r) for r in requests)
    fed = requests[0] if len(requests) == 1 and not layout.reshapes else layout.merge(requests)
    outputs = await execute(fed)
    found = []
    for item in declared:
        name, shape = item.get("name"), item.get("shape")
        if not isinstance(name, str) or name not in outputs:
            continue
        got = np.asarray(outputs[name])
        if isinstance(shape, list | tuple):
            dims = [d if isinstance(d, int) and d >= 0 else -1 for d in shape]
            if len(dims) != got.ndim or any(
                d not in (-1, g) for d, g in zip(dims, got.shape, strict=True)
            ):
                found.append(
                    f"output {name!r} is declared {dims} (-1: any) and the model returned "
                    f"{list(got.shape)} for an input of {rows} row(s)"
                )
        axis = layout.output_axis(name)
        if batching and (got.ndim <= axis or got.shape[axis] != rows):
            held = "no" if got.ndim <= axis else str(got.shape[axis])
            found.append(
                f"output {name!r} holds {held} on its batch axis {axis} ({list(got.shape)}) "
                f"for an input of {rows} row(s): a batch cannot be split into answers; "
                "declare the axis its rows are on in [runner.batching.outputs]"
            )
    return found


# -- sample requests -----------------------------------------------------------------------


def sample_requests(
    inputs: Sequence[InputSpec], layout: BatchLayout, count: int, seed: int
) -> list[dict[str, np.ndarray]]:
    """``count`` random requests of one row each from the declared ``inputs``: a shared
    input one value for all, a ragged axis a random size each, another dynamic axis
    :data:`FREE_SIZE`."""
    if not inputs:
        raise _Unchecked("the runner declares no inputs (metadata()): give a sample file")
    rng = np.random.default_rng(seed)
    low, high = math.log(SCALES[0]), math.log(SCALES[1])
    scales = np.exp(rng.uniform(low, high, size=count))
    requests: list[dict[str, np.ndarray]] = [{} for _ in range(count)]
    for spec in inputs:
        if spec.shape is None or spec.dtype is None:
            lacks = "shape" if spec.shape is None else f"numpy datatype ({spec.datatype})"
            raise _Unchecked(f"input {spec.name!r} declares no {lacks}: give a sample file")
        how = layout.input(spec.name)
        if how.shared:
            value = _values(rng, spec.dtype, _shape(spec.shape, -1, (), rng), 1.0)
            for request in requests:
                request[spec.name] = value
            continue
        for request, scale in zip(requests, scales, strict=True):
            if how.ragged == "concat":
                shape: tuple[int, ...] = (int(rng.integers(RAGGED_SIZES[0], RAGGED_SIZES[1] + 1)),)
            else:
                shape = _shape(spec.shape, how.axis, how.ragged_axes, rng)
            request[spec.name] = _values(rng, spec.dtype, shape, float(scale))
    return requests


def _shape(
    declared: tuple[int, ...], axis: int, ragged: tuple[int, ...], rng: np.random.Generator
) -> tuple[int, ...]:
    def size(index: int, dim: int) -> int:
        if dim >= 0:
            return dim
        if index == axis:
            return 1
        if index in ragged:
            return int(rng.integers(RAGGED_SIZES[0], RAGGED_SIZES[1] + 1))
        return FREE_SIZE

    return tuple(size(i, d) for i, d in enumerate(declared))


def _values(
    rng: np.random.Generator, dtype: np.dtype[Any], shape: tuple[int, ...], scale: float
) -> np.ndarray:
    if dtype.kind == "f":
        return (rng.standard_normal(shape) * scale).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 10, shape).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind == "O":
        words = [f"sample {n}".encode() for n in rng.integers(0, 1000, shape).reshape(-1)]
        return np.array(words, dtype=object).reshape(shape)
    return np.zeros(shape, dtype)


def load_samples(path: Path, layout: BatchLayout) -> list[dict[str, np.ndarray]]:
    """The requests of a ``.npz``: arrays named ``<i>/<input>`` are request ``i``'s;
    arrays named ``<input>`` hold one request per row on the input's batch axis (a shared
    input's array is every request's)."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except (OSError, ValueError) as exc:
        raise _Unchecked(f"sample file {path}: {exc}") from None
    numbered: dict[int, dict[str, np.ndarray]] = {}
    whole: dict[str, np.ndarray] = {}
    for key, array in arrays.items():
        index, slash, name = key.partition("/")
        if slash and index.isdigit():
            numbered.setdefault(int(index), {})[name] = array
        else:
            whole[key] = array
    if numbered:
        return [{**whole, **numbered[i]} for i in sorted(numbered)]
    rows = {
        name: array.shape[layout.input_axis(name)]
        for name, array in whole.items()
        if not layout.input(name).shared and array.ndim > layout.input_axis(name)
    }
    if not rows or len(set(rows.values())) != 1:
        raise _Unchecked(
            f"sample file {path}: its arrays must hold as many rows each on their batch "
            f"axes ({rows or 'none'}), or be named '<request>/<input>'"
        )
    count = next(iter(rows.values()))
    return [
        {
            name: array if name not in rows else np.take(array, [i], axis=layout.input_axis(name))
            for name, array in whole.items()
        }
        for i in range(count)
    ]


def _fitting(
    requests: list[dict[str, np.ndarray]], layout: BatchLayout, limit: int
) -> list[dict[str, np.ndarray]]:
    """The first requests whose rows fit one batch of ``limit`` rows: two at least."""
    kept, rows = [], 0
    for request in requests:
        rows += layout.rows(request)
        if rows > limit:
            break
        kept.append(request)
    if len(kept) < 2:
        raise _Unchecked(
            f"a check batches two sample requests at least, within max_batch_size ({limit} rows)"
        )
    return kept


def _apart(requests: Sequence[Arrays], layout: BatchLayout) -> str | None:
    """Why the requests would not batch together, or ``None``."""
    first = requests[0]
    signature = layout.signature(first)[1]
    if signature is None:
        return "requests never batch: " + why_apart(layout, first, None)
    for other in requests[1:]:
        if layout.signature(other)[1] != signature:
            return "the sample requests cannot share a batch: " + why_apart(layout, first, other)
    return None


# -- comparing -----------------------------------------------------------------------------


def _differences(
    alone: Sequence[Arrays], batched: Sequence[Arrays], spec: BatchCheckSpec, padded: bool
) -> tuple[Difference, ...]:
    counts: dict[str, int] = {}
    largest: dict[str, float] = {}
    shapes: dict[str, str] = {}
    for want, got in zip(alone, batched, strict=True):
        for name, value in want.items():
            found = _difference(np.asarray(value), got.get(name), spec, padded)
            if found is None:
                continue
            gap, shape = found
            counts[name] = counts.get(name, 0) + 1
            largest[name] = max(largest.get(name, 0.0), gap)
            if shape is not None:
                shapes.setdefault(name, shape)
    return tuple(Difference(n, counts[n], largest[n], shapes.get(n)) for n in counts)


def _difference(
    want: np.ndarray, got: Any, spec: BatchCheckSpec, padded: bool
) -> tuple[float, str | None] | None:
    """How far ``got`` (batched) is from ``want`` (alone): ``None`` within the tolerance."""
    if got is None:
        return math.inf, "missing when batched"
    got = np.asarray(got)
    if got.shape != want.shape:
        cropped = _cropped(got, want.shape) if padded else None
        if cropped is None:
            return math.inf, f"shape {list(want.shape)} alone, {list(got.shape)} batched"
        got = cropped  # the rest is padding
    if want.dtype.kind not in "biufc" or got.dtype.kind not in "biufc":
        return None if np.array_equal(want, got) else (math.inf, None)
    kind = np.complex128 if "c" in want.dtype.kind + got.dtype.kind else np.float64
    a, b = want.astype(kind), got.astype(kind)
    close = np.isclose(b, a, rtol=spec.rtol, atol=spec.atol, equal_nan=True)
    if close.all():
        return None
    gaps = np.abs(a - b)[~close]
    return float(np.max(np.where(np.isnan(gaps), np.inf, gaps))), None


def _cropped(got: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """``got`` cut to ``shape`` where it is larger on each axis (a padded answer)."""
    if got.ndim != len(shape) or any(g < s for g, s in zip(got.shape, shape, strict=True)):
        return None
    return got[tuple(slice(0, s) for s in shape)]


def _said(exc: BaseException) -> str:
    return exc.message if isinstance(exc, PlugserveError) else f"{type(exc).__name__}: {exc}"


def _finite(value: float) -> float | None:
    """A JSON number: ``None`` for ``inf``."""
    return value if math.isfinite(value) else None
