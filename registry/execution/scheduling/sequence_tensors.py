"""The tensors of a sequence's requests, beside the ones each request sends: the state
and contexts a sequence keeps between its requests, and the control tensors that say
where a request stands in its sequence.

A state (``[[runner.sequence.state]]``) starts at its ``initial`` value, one row of its
declared shape, reaches the runner as an input and is replaced by the runner's matching
output. A context (a state declared with ``from_input``) keeps the last samples of a
request input: it is fed in front of the next request's samples or as an input of its
own, and the joined samples' tail is kept. The controls
(``[runner.sequence.controls]``) are the start, end and ready flags and the
correlation id, one row each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np

from plugserve.registry.errors import InvalidInput, PluginError
from plugserve.registry.execution.layout import BatchLayout, TensorBounds
from plugserve.registry.manifest import ContextSpec, SequenceSection, StateSpec
from plugserve.registry.tensors.datatypes import V2_TO_NUMPY, v2_datatype

Arrays = Mapping[str, np.ndarray]
INLINE_JOIN_BYTES = 64 * 1024
"""Chunks up to this many bytes are joined with their contexts on the event loop: as large
as a batch that may run there (``INLINE_MAX_BYTES`` of ``components/inline.py``, a package
that imports this module)."""


class SequenceTensors:
    """The state, context and control tensors of one runner version's sequences: each at a
    sequence's start, what a request is fed of them, and what its sequence keeps after it
    (the runner's state outputs, the contexts' new tails)."""

    def __init__(self, section: SequenceSection, label: str, layout: BatchLayout | None) -> None:
        self.section = section
        self.label = label
        self.layout = layout
        """The runner's declared batching: the axis each state's row is on (default 0)."""
        self.bounds = TensorBounds()
        """What one tensor may hold (the server's): a chunk joined with its context too."""

    def initial(self) -> dict[str, np.ndarray]:
        """Each state at a sequence's start: one row of its declared shape."""
        return {spec.input: self._initial(spec) for spec in self.section.states}

    def _initial(self, spec: StateSpec) -> np.ndarray:
        shape = _with_row(spec.shape, self._axis(spec.input, output=False))
        return np.full(shape, spec.initial, dtype=V2_TO_NUMPY[spec.datatype])

    def initial_contexts(self) -> dict[str, np.ndarray]:
        """Each context at a sequence's start (silence, by default): one row of its shape."""
        return {
            spec.input: np.full(
                _with_row(spec.shape, self._axis(spec.source, output=False)),
                spec.initial,
                dtype=V2_TO_NUMPY[spec.datatype],
            )
            for spec in self.section.contexts
        }

    def contexts_of(
        self, inputs: Arrays, contexts: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """A request's context inputs, and the contexts its sequence keeps after it.

        Each context joins the request's samples, ``[context, chunk]`` along its axis: that
        is the model's input for a prepended context (else the context is an input of its
        own), and its last samples, as many as the context holds, are the next context.
        A chunk shorter than the context keeps part of the context before it. A 400 when the
        chunk is missing or does not fit its context (datatype, rank, other dimensions).
        """
        fed: dict[str, np.ndarray] = {}
        after: dict[str, np.ndarray] = {}
        for spec in self.section.contexts:
            before = contexts[spec.input]
            chunk = inputs.get(spec.source)
            self._check_chunk(spec, chunk, before)
            assert chunk is not None  # _check_chunk refused it
            kept = before.shape[spec.axis]
            tail: list[slice] = [slice(None)] * chunk.ndim
            if not spec.prepended and chunk.shape[spec.axis] >= kept:
                # Its own input: the context is the chunk's last samples, nothing joined.
                tail[spec.axis] = slice(chunk.shape[spec.axis] - kept, None)
                fed[spec.input], after[spec.input] = before, chunk[tuple(tail)].copy()
                continue
            joined = np.concatenate((before, chunk), axis=spec.axis)
            fed[spec.input] = joined if spec.prepended else before
            tail[spec.axis] = slice(joined.shape[spec.axis] - kept, None)
            # A copy: a view would keep the whole joined tensor alive with the sequence.
            after[spec.input] = joined[tuple(tail)].copy()
        return fed, after

    async def contexts(
        self, inputs: Mapping[str, Any], contexts: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """:meth:`contexts_of`, on a thread once the chunks are larger than
        :data:`INLINE_JOIN_BYTES` (a join costs what the request sent)."""
        sent = sum(getattr(inputs.get(spec.source), "nbytes", 0) for spec in self.section.contexts)
        if sent <= INLINE_JOIN_BYTES:
            return self.contexts_of(inputs, contexts)
        return await asyncio.to_thread(self.contexts_of, inputs, contexts)

    def _check_chunk(self, spec: ContextSpec, chunk: Any, before: np.ndarray) -> None:
        if not isinstance(chunk, np.ndarray):
            raise InvalidInput(
                f"runner {self.label} keeps a context of input {spec.source!r}: each request "
                "of a sequence sends it"
            )
        if chunk.dtype != before.dtype:
            raise InvalidInput(
                f"input {spec.source!r} is {_datatype(chunk)}; runner {self.label} keeps its "
                f"context as {spec.datatype}"
            )
        fits = chunk.ndim == before.ndim and all(
            got == want
            for axis, (got, want) in enumerate(zip(chunk.shape, before.shape, strict=True))
            if axis != spec.axis
        )
        if not fits:
            want = [-1 if axis == spec.axis else size for axis, size in enumerate(before.shape)]
            raise InvalidInput(
                f"input {spec.source!r} has shape {list(chunk.shape)}; runner {self.label} "
                f"keeps its context along axis {spec.axis}: a request sends {want} (-1: any)"
            )
        most = self.bounds.elements(chunk.dtype)
        if spec.prepended and chunk.size + before.size > most:
            raise InvalidInput(
                f"input {spec.source!r} has {chunk.size} elements and its context "
                f"{before.size}: joined, more than max_tensor_elements ({most})"
            )

    def controls(self, sequence_id: int | str, start: bool, end: bool) -> dict[str, np.ndarray]:
        """The request's control tensors (``[runner.sequence.controls]``), one row each."""
        controls = self.section.controls
        fed = {}
        for name, value in ((controls.start, start), (controls.end, end), (controls.ready, True)):
            if name:
                fed[name] = np.full((1, 1), int(value), np.int32)
        if controls.corrid:
            if controls.corrid_datatype == "BYTES":
                fed[controls.corrid] = np.full((1, 1), str(sequence_id).encode(), dtype=object)
            elif isinstance(sequence_id, str) or (
                controls.corrid_datatype == "INT64" and sequence_id >= 2**63
            ):
                raise InvalidInput(
                    f"runner {self.label} takes {controls.corrid_datatype} sequence ids, "
                    f"not {sequence_id!r}"
                )
            else:
                dtype = np.uint64 if controls.corrid_datatype == "UINT64" else np.int64
                fed[controls.corrid] = np.full((1, 1), sequence_id, dtype)
        return fed

    def _axis(self, name: str, output: bool) -> int:
        layout = self.layout
        if layout is None:
            return 0
        return layout.output_axis(name) if output else layout.input_axis(name)

    def kept(self, outputs: Arrays) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The runner's outputs split into the next state and the answer."""
        state, answer = {}, dict(outputs)
        for spec in self.section.states:
            value = answer.pop(spec.output, None)
            want = _with_row(spec.shape, self._axis(spec.output, output=True))
            if not isinstance(value, np.ndarray) or value.shape != want:
                shape = getattr(value, "shape", type(value).__name__)
                raise PluginError(
                    self.label,
                    ValueError(f"state output {spec.output!r} is {shape}; the state is {want}"),
                )
            # A copy: the output is a view of its whole batch's, which it would keep alive.
            state[spec.input] = np.array(value, dtype=V2_TO_NUMPY[spec.datatype], copy=True)
        return state, answer


def _with_row(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """One sequence's state shape with its one row on ``axis``."""
    return (*shape[:axis], 1, *shape[axis:])


def _datatype(array: np.ndarray) -> str:
    try:
        return v2_datatype(array.dtype)
    except KeyError:
        return str(array.dtype)
