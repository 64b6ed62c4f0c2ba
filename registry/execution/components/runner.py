"""What every kind of runner shares: its ``[runner]`` settings and its inputs as named arrays."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from plugserve.registry.errors import InvalidInput, PluginError, PlugserveError
from plugserve.registry.execution.batching import BatchPolicy
from plugserve.registry.execution.components.base import LoadedPlugin
from plugserve.registry.execution.sequences import inputs_as_sent
from plugserve.registry.manifest import RunnerSection
from plugserve.registry.tensors.inputs import conform, input_specs
from plugserve.registry.tensors.values import from_json


class Checked(dict[str, np.ndarray]):
    """A request's tensors already checked against ``by``'s declared inputs
    (:meth:`Runner.check_request`), so that runner does not check them twice."""

    __slots__ = ("by",)

    def __init__(self, inputs: Mapping[str, np.ndarray], by: Runner) -> None:
        super().__init__(inputs)
        self.by = by


@dataclass(eq=False)
class Runner(LoadedPlugin):
    """A runner version's instance, whichever way it runs (batched, streaming, isolated)."""

    _validate: Callable[[Mapping[str, np.ndarray]], Any] | None = field(
        init=False, default=None, repr=False
    )
    metadata_from_model: ClassVar[bool] = True
    """Whether its component's ``metadata()`` is the model's own, which :meth:`warmup`
    turns into what clients see (an isolated runner's is already so: its process's)."""

    def __post_init__(self) -> None:
        validate = getattr(self.component, "validate", None)
        self._validate = validate if callable(validate) else None

    async def warmup(self, within: float) -> None:
        """Warm up and read the metadata; a sequence runner's state tensors and a ragged
        input's ``lengths`` are the server's to feed (and keep): neither shown nor asked
        of clients. An input a context is prepended to shows the request's chunk."""
        await super().warmup(within)
        hidden = self.server_tensors()
        metadata = self._metadata
        if metadata is None or not self.metadata_from_model:
            return
        if hidden:
            metadata = {
                **metadata,
                **{
                    kind: [t for t in metadata[kind] if t.get("name") not in hidden]
                    for kind in ("inputs", "outputs")
                    if isinstance(metadata.get(kind), list)
                },
            }
        sequence, inputs = self.section.sequence, metadata.get("inputs")
        if sequence is not None and sequence.contexts and isinstance(inputs, list):
            shown = inputs_as_sent(sequence, self.section.batching, inputs, self.label)
            metadata = {**metadata, "inputs": shown}
        if metadata is not self._metadata:
            self._metadata = metadata
            self._inputs = input_specs(metadata)
            self._input_dtypes = {spec.name: spec.dtype for spec in self._inputs}

    def server_tensors(self) -> set[str]:
        """The tensors the server feeds or keeps itself: sequence states and controls,
        ``lengths``."""
        section = self.section
        hidden: set[str] = set()
        if section.sequence is not None:
            hidden.update(section.sequence.tensors)
        if section.batching is not None:
            hidden.update(section.batching.made_inputs)
        return hidden

    @property
    def section(self) -> RunnerSection:
        """The manifest's ``[runner]`` table."""
        runner = self.manifest.runner
        assert runner is not None  # a runner's manifest has one
        return runner

    def check_request(
        self, inputs: Mapping[str, np.ndarray], route: str
    ) -> Mapping[str, np.ndarray]:
        """A request's tensors checked against this runner's declared inputs (if any), when it
        is first in its chain: the runner then takes them as they are (:class:`Checked`).

        Names, ranks, fixed dimensions and datatypes must match (400 otherwise);
        ``[runner] cast_inputs = true`` takes other datatypes when the cast changes no value.
        """
        if not self._inputs:
            return inputs
        checked = conform(self._inputs, inputs, f"route {route!r}", self.section.cast_inputs)
        return Checked(checked, self)

    def runner_inputs(self, data: Any) -> Mapping[str, np.ndarray]:
        """Turn what reaches a runner into named arrays of its declared inputs.

        Named arrays pass through. A JSON object of nested lists becomes arrays
        of the dtypes the runner's ``metadata()`` declares; a bare list or array
        goes to a runner with exactly one input. With declared inputs, names,
        ranks and fixed dimensions are checked and other datatypes cast when no
        value changes (:func:`plugserve.registry.tensors.inputs.conform`): a 400 otherwise.
        """
        if type(data) is Checked and data.by is self:  # checked in this step already
            return data
        if isinstance(data, Mapping):
            if all(isinstance(v, np.ndarray) for v in data.values()):
                inputs = data
            else:
                inputs = {str(k): self._as_array(str(k), v) for k, v in data.items()}
        elif isinstance(data, list | np.ndarray) and len(self._input_dtypes) == 1:
            (name,) = self._input_dtypes
            inputs = {name: self._as_array(name, data)}
        else:
            names = sorted(self._input_dtypes)
            raise InvalidInput(
                f"runner {self.label} takes named inputs {names}, got {type(data).__name__}"
            )
        if not self._inputs:
            return inputs
        return conform(self._inputs, inputs, f"runner {self.label}", cast=True)

    def _as_array(self, name: str, value: Any) -> np.ndarray:
        if isinstance(value, np.ndarray):
            return value
        dtype = self._input_dtypes.get(name)
        try:
            if dtype is None or dtype.kind == "O":
                return np.asarray(value, dtype=dtype)
            return from_json(value, dtype)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"input {name!r} of runner {self.label}: {exc}") from None

    def validate_request(self, inputs: Mapping[str, np.ndarray]) -> None:
        """The runner's own per-request check (``validate``), before it can join a batch."""
        if self._validate is None:
            return
        try:
            self._validate(inputs)
        except InvalidInput as exc:
            raise self._refused(exc) from None
        except PlugserveError:
            raise
        except Exception as exc:
            raise PluginError(self.label, exc) from exc


def batch_policy(runner: RunnerSection) -> BatchPolicy:
    """The scheduler settings of a manifest's ``[runner]`` table."""
    return BatchPolicy(
        max_batch_size=runner.max_batch_size,
        max_queue_delay_s=runner.max_queue_delay_ms / 1000,
        preferred_batch_sizes=runner.preferred_batch_sizes,
        instances=runner.instances,
        max_queue_size=runner.max_queue_size,
        priority_levels=runner.priority_levels,
        default_priority=runner.default_priority_level,
        tenant_weights=runner.tenant_weights,
    )
