"""What an ONNX model lets a batch hold, read from its tensors' shapes when it loads.

A runner with ``max_batch_size > 1`` sends its model the rows of several requests on each
input's batch axis (0, or the one ``[runner.batching]`` declares) and splits each output
on its own. ONNX Runtime refuses an input whose fixed dimension differs from what it is
sent, so a model exported with its batch axis fixed (at 1, as ``torch.onnx.export`` does
without ``dynamic_axes``) refuses every batch of more than one row, and each request of
it would run again alone: such a load is refused, naming the fixes.

An output's declared shape binds nothing (ONNX Runtime only warns when the model returns
another): an output declared with a fixed batch axis is run on a batch of two rows to
see. Where it holds them, the load goes on with a warning; where it does not, a batch's
answers could not be split per request, and the load is refused.

A model with an input that has no batch axis (a scalar not declared ``shared``) never
batches at all: every request runs alone and ``cannot_batch`` says why, so there is
nothing to refuse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from plugserve.registry.errors import PluginLoadError
from plugserve.registry.manifest import BatchingSection, declared_batching
from plugserve.registry.types import PluginInfo

PROBE_ROWS = 2
"""The rows of the batch an output declared with a fixed batch axis is run on."""
FIXES = (
    "set max_batch_size = 0 to serve it unbatched, declare the axis its rows are on in "
    "[runner.batching] (if that is not axis 0), or export the model with a dynamic batch "
    "axis (torch.onnx.export(..., dynamic_axes={{{name!r}: {{{axis}: 'batch'}}}}))"
)


class Tensor(Protocol):
    """One of the model's inputs or outputs: its shape with ``-1`` for a dynamic axis."""

    name: str
    shape: list[int]
    dtype: np.dtype[Any] | None


def check_batch_axes(
    plugin: PluginInfo,
    runner: Mapping[str, Any],
    inputs: Sequence[Tensor],
    outputs: Sequence[Tensor],
    run: Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]],
) -> None:
    """Refuse (:class:`PluginLoadError`) a model that cannot hold the batches ``runner``
    (the ``[runner]`` table) would send it; warn of an output declared with a fixed batch
    axis that holds a batch's rows all the same. ``run`` runs the model on a feed."""
    limit = runner.get("max_batch_size", 0)
    if not isinstance(limit, int) or limit <= 1:
        return
    batching = declared_batching(runner, plugin.path) or BatchingSection()
    axes = _input_axes(inputs, batching)
    if axes is None:
        return
    for tensor in inputs:
        axis = axes.get(tensor.name)
        if axis is not None and tensor.shape[axis] >= 0:
            raise PluginLoadError(
                f"{plugin.label}: max_batch_size = {limit}, but the model fixes input "
                f"{tensor.name!r} to {tensor.shape[axis]} on its batch axis {axis} (shape "
                f"{tensor.shape}): ONNX Runtime would refuse every batch of another size, "
                f"and each of its requests would run again alone. To fix it, "
                + FIXES.format(name=tensor.name, axis=axis)
            )
    declared = {t.name: batching.outputs.get(t.name, 0) for t in outputs}
    doubtful = [t for t in outputs if not _dynamic(t.shape, declared[t.name])]
    if doubtful:
        _probe(plugin, limit, inputs, axes, batching, doubtful, declared, run)


def _input_axes(inputs: Sequence[Tensor], batching: BatchingSection) -> dict[str, int] | None:
    """Each batched input's batch axis (a shared input has none); ``None`` where an input
    has no such axis, so that requests never batch."""
    axes = {}
    for tensor in inputs:
        how = batching.input(tensor.name)
        if how.shared:
            continue
        axis = 0 if how.ragged == "concat" else how.axis
        if len(tensor.shape) <= axis:
            return None
        axes[tensor.name] = axis
    return axes


def _dynamic(shape: Sequence[int], axis: int) -> bool:
    return len(shape) > axis and shape[axis] < 0


def _probe(
    plugin: PluginInfo,
    limit: int,
    inputs: Sequence[Tensor],
    axes: Mapping[str, int],
    batching: BatchingSection,
    doubtful: Sequence[Tensor],
    declared: Mapping[str, int],
    run: Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]],
) -> None:
    """Run a batch of :data:`PROBE_ROWS` rows and judge each ``doubtful`` output by what it
    returns on its batch axis."""
    names = [t.name for t in doubtful]
    try:
        returned = run(_feed(inputs, axes, batching))
    except Exception as exc:
        plugin.logger.warning(
            "batch_axis_unverified",
            outputs=names,
            declared={t.name: t.shape for t in doubtful},
            why=f"a batch of {PROBE_ROWS} zero rows failed: {type(exc).__name__}: {exc}",
            check="plugserve validate --batching",
        )
        return
    for tensor in doubtful:
        axis = declared[tensor.name]
        got = np.asarray(returned.get(tensor.name))
        if got.ndim > axis and got.shape[axis] == PROBE_ROWS:
            plugin.logger.warning(
                "output_shape_contradicted",
                output=tensor.name,
                declared=tensor.shape,
                returned=list(got.shape),
                rows=PROBE_ROWS,
                why="the model declares a fixed batch axis it does not keep: batches work, "
                "and ONNX Runtime warns on each one",
                fix=f"export the model with output {tensor.name!r} dynamic on axis {axis}",
            )
            continue
        held = [i for i, size in enumerate(got.shape) if size == PROBE_ROWS]
        where = f"; axis {held[0]} holds them" if held else ""
        raise PluginLoadError(
            f"{plugin.label}: max_batch_size = {limit}, but output {tensor.name!r} (declared "
            f"{tensor.shape}) returned {list(got.shape)} for a batch of {PROBE_ROWS} rows: "
            f"its batch axis {axis} does not hold one row a request{where}, so a batch's "
            "answers could not be split. To fix it, " + FIXES.format(name=tensor.name, axis=axis)
        )


def _feed(
    inputs: Sequence[Tensor], axes: Mapping[str, int], batching: BatchingSection
) -> dict[str, np.ndarray]:
    """Zeros of :data:`PROBE_ROWS` rows on each batch axis and 1 on every other dynamic
    axis; the ``lengths`` inputs the server would make hold ones."""
    made = set(batching.made_inputs)
    feed = {}
    for tensor in inputs:
        axis = axes.get(tensor.name)
        shape = [PROBE_ROWS if i == axis else max(d, 1) for i, d in enumerate(tensor.shape)]
        dtype = tensor.dtype or np.dtype(np.float32)
        if dtype.kind == "O":
            feed[tensor.name] = np.full(shape, "", dtype=object)
        else:
            feed[tensor.name] = (np.ones if tensor.name in made else np.zeros)(shape, dtype)
    return feed
