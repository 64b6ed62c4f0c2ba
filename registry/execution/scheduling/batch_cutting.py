"""Which queued requests leave together as a batch, and how a batch is joined and split.

A batch is cut from the head of the queue's order: requests join it while their inputs
agree on names, dtypes and every dimension after the first (their :func:`signature`, or
that of the runner's declared layout), its rows stay within ``max_batch_size`` and each
merged tensor within the bounds of one request's (a request past them closes the batch).
It leaves when full, closed, when the runner is idle, or once its oldest request waited
``max_queue_delay_s``; with ``preferred_batch_sizes`` it is cut to the largest preferred
size it fills. Its inputs are joined row after row (or by the runner's layout: padded,
ragged), and its outputs split back into each request's own rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from plugserve.registry.errors import PluginError
from plugserve.registry.execution.layout import BatchLayout, Footprint, TensorBounds, footprint
from plugserve.registry.execution.scheduling.policy import BatchPolicy
from plugserve.registry.execution.scheduling.request_queue import Pending

Arrays = Mapping[str, np.ndarray]


def signature(inputs: Arrays) -> tuple[int, tuple[Any, ...] | None]:
    """Rows and batching signature of ``inputs``; ``None``: it cannot join a batch."""
    if len(inputs) == 1:  # the usual request: no sort, no generator
        for name, array in inputs.items():
            shape = array.shape
            if not shape:
                return 1, None
            return shape[0], ((name, array.dtype.str, shape[1:]),)
    arrays = list(inputs.values())
    if not arrays or any(a.ndim == 0 for a in arrays):
        return 1, None
    rows = arrays[0].shape[0]
    if any(a.shape[0] != rows for a in arrays):
        return rows, None
    return rows, tuple(sorted((n, a.dtype.str, a.shape[1:]) for n, a in inputs.items()))


class Cut(NamedTuple):
    """What :func:`cut` decided: the batch to send now, or when to look again."""

    batch: list[Pending] | None
    """The batch to send now; ``None``: none is due."""
    due: float | None
    """When the oldest queued request's delay runs out, while no batch is due."""
    apart: Pending | None
    """A queued request the batch was cut without, though it had room: its inputs could
    not join the batch's first request's."""


def cut(
    ordered: list[Pending],
    policy: BatchPolicy,
    layout: BatchLayout | None,
    bounds: TensorBounds,
    idle: bool,
    now: float,
) -> Cut:
    """The batch to send now from the queued requests, ``ordered`` as they leave (at least
    one); ``idle``: no execution of the runner is in flight."""
    head = ordered[0]
    batch, rows = [head], head.rows
    limit = policy.max_batch_size
    apart = None
    closed = False  # the next request would take a merged tensor past bounds
    if limit and head.signature is not None and head.rows < limit:
        kept: Footprint | None = None
        for request in ordered[1:]:
            if request.signature == head.signature:
                if rows + request.rows <= limit:
                    kept = kept or footprint(layout, head.inputs, bounds)
                    if not kept.admits(request.inputs):
                        closed = True
                        break
                    batch.append(request)
                    rows += request.rows
                    if rows == limit:
                        break
            elif apart is None:
                apart = request
    elif limit > 1 and head.signature is None and len(ordered) > 1:
        apart = ordered[1]
    oldest = min(r.arrival for r in ordered)
    due = oldest + policy.max_queue_delay_s
    ready = not limit or rows >= limit or closed or idle or now >= due
    if not ready:
        return Cut(None, due, None)
    return Cut(preferred(batch, rows, policy), None, apart if rows < limit else None)


def preferred(batch: list[Pending], rows: int, policy: BatchPolicy) -> list[Pending]:
    """``batch`` cut to the largest of ``preferred_batch_sizes`` it fills (its first
    request at least)."""
    fitting = [p for p in policy.preferred_batch_sizes if p <= rows]
    if not fitting or len(batch) == 1:
        return batch
    size, total = max(fitting), 0
    kept = []
    for request in batch:
        if total + request.rows > size:
            break
        kept.append(request)
        total += request.rows
    return kept or batch[:1]


def merge(layout: BatchLayout | None, batch: list[Pending]) -> Arrays:
    """The batch's inputs as one: rows concatenated, or joined by the runner's layout."""
    if layout is not None:
        return layout.merge([r.inputs for r in batch])
    if len(batch) == 1:
        return batch[0].inputs
    return {
        name: np.concatenate([r.inputs[name] for r in batch], axis=0) for name in batch[0].inputs
    }


def split(
    layout: BatchLayout | None, label: str, batch: list[Pending], rows: int, outputs: Arrays
) -> None:
    """Answer each request of ``batch`` with its own slice of ``outputs``; a
    :class:`PluginError` (``label``'s) when the outputs cannot be split (not a row per
    input row)."""
    if len(batch) == 1:
        if not batch[0].future.done():
            batch[0].future.set_result(outputs)
        return
    if layout is not None:
        try:
            answers = layout.split(outputs, [r.rows for r in batch])
        except ValueError as exc:
            raise PluginError(label, exc) from None
        for request, answer in zip(batch, answers, strict=True):
            if not request.future.done():
                request.future.set_result(answer)
        return
    for name, value in outputs.items():
        if not isinstance(value, np.ndarray) or value.ndim == 0 or value.shape[0] != rows:
            shape = getattr(value, "shape", type(value).__name__)
            problem = (
                f"output {name!r} has shape {shape}; a batch of {rows} rows needs {rows} first"
            )
            raise PluginError(label, ValueError(problem))
    offset = 0
    for request in batch:
        end = offset + request.rows
        if not request.future.done():
            request.future.set_result({n: v[offset:end] for n, v in outputs.items()})
        offset = end
