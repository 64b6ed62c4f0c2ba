"""What an ONNX model's shapes suggest its manifest declare, beyond what ``plugserve new``
writes as it is (``server/commands/scaffold.py`` writes them commented out):

- Declared batching (docs/plugins.md, "Declared batching: [runner.batching]"): a model
  with a tensor whose first axis is fixed cannot batch on axis 0. When every output has
  a free axis and some input has one, each tensor's rows go on its first free axis, and
  an input with none (a sample rate, a threshold) is one value for the whole batch.
- A sequence's state (docs/plugins.md, "Sequences: [runner.sequence]"): an input and an
  output of one datatype and shape (the output's may leave free what the input fixes),
  both named like a recurrent state (``state`` and ``stateN``, ``h0`` and ``hn``), the
  input's rows on one free axis and no other axis free; the output's rows are on the
  same axis.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from plugserve.registry.manifest import STATE_DATATYPES

STATE_WORDS = frozenset({"state", "states", "h", "c", "hx", "cx", "hidden", "cell", "memory"})
"""Words a recurrent state's tensors are named with (``state``/``stateN``, ``h0``/``hn``,
``c_in``/``c_out``, ``hidden_state``)."""


@dataclass(frozen=True)
class Tensor:
    """One of a model's inputs or outputs: each dimension a size, or -1 where it is free."""

    kind: str
    """``input`` or ``output``."""
    name: str
    datatype: str
    dims: tuple[int, ...]

    @property
    def rows_axis(self) -> int | None:
        """Where its rows would be: axis 0 if that is free, else its first free axis;
        ``None`` for a tensor with none (a scalar, a fixed shape)."""
        return next((axis for axis, size in enumerate(self.dims) if size == -1), None)

    @property
    def batches_on_first_axis(self) -> bool:
        return bool(self.dims) and self.dims[0] == -1


@dataclass(frozen=True)
class State:
    """An input the model reads a state from and the output it writes the next one to."""

    input: Tensor
    output: Tensor

    @property
    def axis(self) -> int:
        axis = self.input.rows_axis
        assert axis is not None  # state_pairs keeps states with rows only
        return axis

    def table(self) -> dict[str, Any]:
        """Its ``[[runner.sequence.state]]``: the shape of one sequence's state, without
        the rows' axis."""
        shape = [size for axis, size in enumerate(self.input.dims) if axis != self.axis]
        return {"input": self.input.name, "output": self.output.name,
                "datatype": self.input.datatype, "shape": shape}  # fmt: skip


@dataclass(frozen=True)
class Hints:
    """What the shapes suggest: ``[runner.batching]`` tables (``batching``: the whole
    declaration that lets a model with a fixed first axis batch; else only the axes its
    states' rows are on) and the states of a ``[runner.sequence]``."""

    batching: bool = False
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``[runner.batching.inputs]``: ``{"axis": k}`` or ``{"shared": True}`` by name."""
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``[runner.batching.outputs]``: ``{"axis": k}`` by name."""
    states: tuple[State, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.batching or self.states)


def looks_like_state(name: str) -> bool:
    """Whether a word of ``name`` (split at separators, digits and capitals) is one of
    :data:`STATE_WORDS`, or one of them with an ``n`` after it (``hn``, ``cn``)."""
    words = [w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+", name)]
    return any(w in STATE_WORDS or (w.endswith("n") and w[:-1] in STATE_WORDS) for w in words)


def state_pairs(tensors: Sequence[Tensor]) -> tuple[State, ...]:
    """Each input named like a state with the output named like one that has its shape
    and datatype (of several, the one whose name shares the longest start with its name),
    where one sequence's state has a fixed shape: its rows on one free axis, no other."""
    outputs = [t for t in tensors if t.kind == "output" and looks_like_state(t.name)]
    pairs = []
    for tensor in tensors:
        axis = tensor.rows_axis
        if tensor.kind != "input" or not looks_like_state(tensor.name) or axis is None:
            continue
        if -1 in tensor.dims[axis + 1 :] or tensor.datatype not in STATE_DATATYPES:
            continue
        same = [o for o in outputs if o.datatype == tensor.datatype and _fits(o.dims, tensor.dims)]
        if same:
            output = max(same, key=lambda o: _common_start(o.name, tensor.name))
            outputs.remove(output)
            pairs.append(State(tensor, output))
    return tuple(pairs)


def shape_hints(tensors: Sequence[Tensor]) -> Hints:
    """What ``tensors`` suggest (the module's docstring says when)."""
    states = state_pairs(tensors)
    outputs_split = all(t.rows_axis is not None for t in tensors if t.kind == "output")
    batching = (
        not all(t.batches_on_first_axis for t in tensors)
        and outputs_split
        and any(t.rows_axis is not None for t in tensors if t.kind == "input")
    )
    declared = tensors if batching else [t for s in states for t in (s.input, s.output)]
    state_axes = {s.output.name: s.axis for s in states}
    inputs: dict[str, dict[str, Any]] = {}
    outputs: dict[str, dict[str, Any]] = {}
    for tensor in declared:
        axis = tensor.rows_axis
        if tensor.kind == "output":
            axis = state_axes.get(tensor.name, axis)
        if axis == 0:
            continue  # the default
        if tensor.kind == "output":
            outputs[tensor.name] = {"axis": axis}
        else:
            inputs[tensor.name] = {"shared": True} if axis is None else {"axis": axis}
    return Hints(batching, inputs, outputs, states)


def _fits(output: tuple[int, ...], state: tuple[int, ...]) -> bool:
    """Whether an output of dimensions ``output`` can hold a state of ``state``'s: the
    same rank, each size the same where both fix it."""
    return len(output) == len(state) and all(
        -1 in (o, s) or o == s for o, s in zip(output, state, strict=True)
    )


def _common_start(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` start with alike."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
