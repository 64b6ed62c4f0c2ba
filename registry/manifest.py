"""``plugin.toml``: parsing and validation into typed, immutable records.

The file's tables are declared once, as pydantic models (:class:`_File` and the tables
in it): each key's type, default, bounds and meaning; ``python -m
plugserve.registry.manifest`` prints their JSON Schema (``docs/schemas/plugin.schema.json``).
What no one key says alone is checked by the tables' validators (paths inside the plugin
folder, a state's axes, a padded input's ragged axes) and by :func:`parse_manifest`,
which builds the records (the layout of folders, tables only one type of plugin has,
states against batching, labels files read). Every error names the file and the field,
so that an operator reading the admin API or the log knows what to fix.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal, Self, cast

import numpy as np
import pydantic
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from plugserve.registry import checks, requirements
from plugserve.registry.errors import ManifestError
from plugserve.registry.ratelimit import MAX_BURST, MAX_RPS, MIN_RPS, RateLimit
from plugserve.registry.refs import NAME_PATTERN, PluginType, Ref, is_valid_name
from plugserve.registry.versions import Version

MANIFEST_NAME = "plugin.toml"
MAX_MANIFEST_BYTES = 1024 * 1024
"""Largest ``plugin.toml`` read: a manifest is a few KiB; data files (labels, models) lie
beside it."""
MAX_PROBLEMS = 64
"""Problems :func:`manifest_problems` lists at most."""

# Bounds of the numbers: generous, but finite and far from overflowing anything.
MAX_BATCH_SIZE = 1_000_000
MAX_INSTANCES = 1024
MAX_QUEUE_DELAY_MS = 3_600_000.0
MAX_PRIORITY_LEVELS = 1000
MAX_LABELS_BYTES = 16 * 1024 * 1024
MAX_SEQUENCES = 1_000_000
MAX_IDLE_S = 7 * 86_400.0
MAX_STATE_ELEMENTS = 1 << 24
"""Elements of one sequence's state tensor at most (64 MiB of FP32)."""
MAX_AXIS = 15
MAX_TENSOR_NAME = 256
MAX_LIST = 256
"""Strings a list of them (``requires``, ``devices``, a route's chain) holds at most."""

StateDatatype = Literal["BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32",
                        "UINT64", "FP16", "FP32", "FP64"]  # fmt: skip
"""What a state may hold: any numeric v2 datatype."""
STATE_DATATYPES: tuple[str, ...] = typing.get_args(StateDatatype)
OpenAIKind = Literal["embeddings", "chat", "completions"]
"""``[route] openai``: the OpenAI-compatible routes (``/v1/...``) a route is served at."""


# -- the file's tables -----------------------------------------------------------------------


def _text(value: str, info: pydantic.ValidationInfo) -> str:
    """Without control characters (``description`` may span lines); its length is its
    type's to bound."""
    return checks.text(value, "", max_length=len(value), multiline=info.field_name == "description")


def _must(holds: Callable[[str], object], problem: str) -> AfterValidator:
    """A text's check: ``problem`` (``{}``: the text, quoted) unless ``holds(text)``."""

    def check(value: str) -> str:
        if not holds(value):
            raise checks.ValueProblem("", problem.format(repr(value)))
        return value

    return AfterValidator(check)


def _in_folder(value: str, info: pydantic.ValidationInfo) -> str:
    """A path the file system can take, inside the plugin folder (the validation's
    context): lexically, for symlinks are the registry's to judge (they may point into
    the models dir). A runner's ``model`` may be ``models:...``, the backend's to find."""
    checks.relative_path(value, "")
    if value.startswith("models:") and info.field_name == "model":
        return value
    folder = cast(Path, info.context)
    inside = Path(os.path.normpath(folder / value)).is_relative_to(folder)
    if Path(value).is_absolute() or not inside:
        raise checks.ValueProblem("", f"{value!r} must stay inside the plugin folder")
    return value


def _a_file(value: str, info: pydantic.ValidationInfo) -> str:
    if not (cast(Path, info.context) / value).is_file():
        raise checks.ValueProblem("", f"{value!r} is not a file in the plugin folder")
    return value


def _version(text: str) -> str:
    Version.parse(text)
    return text


def _provider(value: Any) -> Any:
    """A provider's name: the entry, or a table's ``name`` (its other keys: options)."""
    name = value.get("name") if isinstance(value, dict) else value
    if not isinstance(name, str):
        raise checks.ValueProblem("", "must be a list of names or tables with a 'name'")
    return name


def _one_or_more(value: Any) -> Any:
    if not isinstance(value, str | list):
        raise checks.ValueProblem("", "must be a name or a list of names")
    return [value] if isinstance(value, str) else value


def _true_false_or_table(value: Any) -> Any:
    """``true``: a table of defaults; ``false``: none."""
    if not isinstance(value, bool | dict):
        raise checks.ValueProblem(
            "", "must be true, false or a table of rtol, atol, seed and sample"
        )
    return ({} if value else None) if isinstance(value, bool) else value


def _or_one(schema: dict[str, Any]) -> None:
    """A list's schema, one item alone accepted too."""
    items, _ = schema.pop("items"), schema.pop("type")
    schema["anyOf"] = [items, {"type": "array", "items": items}]


def _or_true_false(schema: dict[str, Any]) -> None:
    """A table's schema, ``true`` and ``false`` accepted too (no ``null``: TOML has none)."""
    schema["anyOf"] = [{"type": "boolean"}, *(s for s in schema["anyOf"] if s != {"type": "null"})]
    schema["default"] = False


_PROVIDER = {"anyOf": [{"type": "string"}, {"type": "object", "required": ["name"]}]}
_RATE_LIMIT = {
    "type": "object", "additionalProperties": False, "required": ["rps"],
    "properties": {"rps": {"type": "number", "minimum": MIN_RPS, "maximum": MAX_RPS},
                   "burst": {"type": "integer", "minimum": 1, "maximum": MAX_BURST}},
}  # fmt: skip

Text = Annotated[str, Field(max_length=1024), AfterValidator(_text)]
"""Text without control characters."""
Item = Annotated[str, Field(max_length=checks.MAX_TEXT), AfterValidator(_text)]
TensorName = Annotated[str, Field(max_length=MAX_TENSOR_NAME), AfterValidator(_text)]
"""A tensor's name as a manifest gives it (a table's key, a state's input): it reads the
same in logs, metadata and every file written from it."""
Name = Annotated[
    Text,
    _must(is_valid_name, "{} must match " + NAME_PATTERN),
    Field(json_schema_extra={"pattern": f"^{NAME_PATTERN}$"}),
]
"""A plugin's or a route's name."""
InFolder = Annotated[str, Field(max_length=1024), AfterValidator(_in_folder)]
"""A path inside the plugin folder, relative to it."""
Device = Annotated[
    Text,
    _must(re.compile("cuda:[0-9]{1,4}").fullmatch, "{} is not a device such as 'cuda:0'"),
    Field(json_schema_extra={"pattern": "^cuda:[0-9]{1,4}$"}),
]
Provider = Annotated[
    str, Field(max_length=256), AfterValidator(_text), BeforeValidator(_provider),
    WithJsonSchema(_PROVIDER),
]  # fmt: skip
PluginRef = Annotated[
    Ref,
    PlainValidator(lambda value: Ref.parse(checks.text(value, ""))),
    WithJsonSchema({"type": "string", "description": "`name` or `name@MAJOR.MINOR.PATCH`"}),
]
Count = Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]
Axis = Annotated[int, Field(ge=0, le=MAX_AXIS)]
Number = Annotated[float, Field(ge=-checks.MAX_NUMBER, le=checks.MAX_NUMBER)]
Seconds = Annotated[float, Field(ge=0, le=86_400)]


class _Table(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        allow_inf_nan=False,
        defer_build=True,  # built on first use: a process that reads no manifest never pays
    )


class _Plugin(_Table, title="[plugin]"):
    name: Name
    """The plugin's name: its folder's (``<type>/<name>/<version>``)."""
    version: Annotated[Text, AfterValidator(_version)]
    """Its semantic version (``1.2.3``, ``1.2.3-rc.1``): its folder's name."""
    type: PluginType
    """What the plugin is: a ``preprocessor``, a ``runner`` or a ``postprocessor``."""
    module: InFolder | None = None
    """A ``.py`` file or a package folder: required for processors; a runner without
    ``backend`` builds its component there."""
    description: Annotated[str, Field(max_length=65_536), AfterValidator(_text)] = ""
    """What it does; it may span lines."""
    requires: Annotated[list[Item], Field(max_length=MAX_LIST)] = []
    """The Python packages the plugin needs (PEP 508 requirements, or alternatives of them
    separated by ``|``), checked against the server's environment at load
    (``registry/requirements.py``)."""

    @field_validator("requires")
    @classmethod
    def _parsed(cls, texts: list[str]) -> list[str]:
        """Each parsed whole and its markers evaluated here, as the loader evaluates them: a
        requirement whose marker cannot be evaluated (``~=`` on a name that is no version)
        is this file's error, not the load's (``registry/requirements.py``)."""
        for index, text in enumerate(texts):
            try:
                requirements.parse_entry(text)
            except requirements.RequirementTextError as exc:
                raise checks.ValueProblem(f"[{index}]", str(exc)) from None
        return texts


class _State(_Table, title="[[runner.sequence.state]]"):
    input: TensorName
    """The model input it is fed as."""
    output: TensorName | None = None
    """The model output that replaces it after each request (a state kept from a model)."""
    from_input: TensorName | None = None
    """Or the request input whose last samples it keeps (a context): ``input`` itself
    (prepended to the request's samples) or another."""
    axis: Annotated[int, Field(ge=0, le=16)] | None = None
    """A context's: the axis of ``from_input`` (its batch axis counted) its samples run
    along; default: the last."""
    datatype: StateDatatype
    """What it holds: any numeric v2 datatype."""
    shape: Annotated[list[Annotated[int, Field(ge=1, le=MAX_STATE_ELEMENTS)]], Field(max_length=16)]
    """One sequence's state without the batch axis (axis 0, the rows of a batch, unless
    ``[runner.batching]`` declares another); a context's size on ``axis`` is how many
    samples it keeps."""
    initial: Number = 0.0
    """Every element's value at the sequence's start."""

    @model_validator(mode="after")
    def _kept(self) -> Self:
        if (self.output is None) == (self.from_input is None):
            raise checks.ValueProblem("", "a state is kept either from a model output (output) "
                                      "or from the last samples of a request input "
                                      "(from_input)")  # fmt: skip
        if self.axis is not None and self.output is not None:
            raise checks.ValueProblem("axis", "axis is for a state kept from an input (from_input)")
        elements = math.prod(self.shape)
        if elements > MAX_STATE_ELEMENTS:
            raise checks.ValueProblem("shape", f"holds {elements} elements a sequence; at most "
                                      f"{MAX_STATE_ELEMENTS}")  # fmt: skip
        if not _holds(self.datatype, self.initial):
            raise checks.ValueProblem("initial", f"{self.initial:g} is not a {self.datatype} value")
        if self.from_input is not None and not self.shape:
            raise checks.ValueProblem("shape", "a context holds samples along an axis: at least "
                                      "one dimension")  # fmt: skip
        if self.from_input is not None and self.axis is not None:
            checks.integer(self.axis, "axis", low=0, high=len(self.shape))
        return self

    def spec(self) -> StateSpec | ContextSpec:
        shape = tuple(self.shape)
        if self.output is not None:
            return StateSpec(self.input, self.output, self.datatype, shape, self.initial)
        assert self.from_input is not None  # _kept: one or the other
        axis = len(shape) if self.axis is None else self.axis
        return ContextSpec(self.input, self.from_input, axis, self.datatype, shape, self.initial)


class SequenceControls(_Table, title="[runner.sequence.controls]"):
    """``[runner.sequence.controls]``: the control inputs the server feeds each request of a
    sequence, as Triton's sequence batcher does (each ``[1, 1]``, one row a request); the
    names of the runner's inputs, ``None`` for a control it does not take."""

    start: Text | None = None
    """INT32: 1 on the sequence's first request, else 0."""
    end: Text | None = None
    """INT32: 1 on its last request, else 0."""
    ready: Text | None = None
    """INT32: 1 (every row is a request)."""
    corrid: Text | None = None
    """The sequence id: its text (BYTES), or an integer (``corrid_datatype``)."""
    corrid_datatype: Literal["BYTES", "UINT64", "INT64"] = "BYTES"
    """``UINT64`` and ``INT64`` refuse string ids (400)."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.start, self.end, self.ready, self.corrid) if n)


class _Sequence(_Table, title="[runner.sequence]"):
    idle_timeout_s: Annotated[float, Field(gt=0, le=MAX_IDLE_S)] = 60.0
    """A sequence with no request for this long ends, and its state is dropped."""
    max_sequences: Annotated[int, Field(ge=1, le=MAX_SEQUENCES)] = 1024
    """Sequences alive at once; a start beyond them is refused (429)."""
    state: Annotated[list[_State], Field(max_length=checks.MAX_ITEMS)] = []
    """The tensors kept for each sequence: from a model output to the next request's
    input, or from a request input's last samples (a context)."""
    controls: SequenceControls = SequenceControls()
    """The control inputs the server feeds each request of a sequence."""

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        """Each state has an input (and an output) of its own; a context is kept from an
        input the client sends; each control is an input of its own."""
        specs = [state.spec() for state in self.state]
        states = [s for s in specs if isinstance(s, StateSpec)]
        inputs, outputs = [s.input for s in specs], [s.output for s in states]
        if len(set(inputs)) != len(inputs) or len(set(outputs)) != len(outputs):
            raise checks.ValueProblem("state", "each state needs an input and an output of its own")
        contexts = [s for s in specs if isinstance(s, ContextSpec)]
        fed = {
            *(s.input for s in states),
            *outputs,
            *(c.input for c in contexts if not c.prepended),
        }
        for index, spec in enumerate(specs):
            if isinstance(spec, ContextSpec) and spec.source in fed:
                raise checks.ValueProblem(f"state[{index}].from_input", f"{spec.source!r} is a "
                                          "tensor the server feeds or keeps; from_input names an "
                                          "input each request sends")  # fmt: skip
        names = self.controls.names
        if len(set(names)) < len(names) or set(names) & {
            *inputs,
            *outputs,
            *(c.source for c in contexts),
        }:
            raise checks.ValueProblem("controls", "each control names an input of its own, no "
                                      "state's nor one a state is kept from")  # fmt: skip
        return self

    def section(self) -> SequenceSection:
        specs = [state.spec() for state in self.state]
        return SequenceSection(
            idle_timeout_s=self.idle_timeout_s,
            max_sequences=self.max_sequences,
            states=tuple(s for s in specs if isinstance(s, StateSpec)),
            contexts=tuple(s for s in specs if isinstance(s, ContextSpec)),
            controls=self.controls,
        )


class _InputBatching(_Table, title="[runner.batching.inputs.<name>]"):
    axis: Axis = 0
    """The axis its rows are on: requests are concatenated along it."""
    shared: bool = False
    """One value for the whole batch: requests whose values differ never batch together."""
    ragged: Literal["pad", "concat"] | None = None
    """``pad``: requests may differ on the ``ragged_axes``, padded with ``pad_value`` to the
    batch's largest; ``concat``: each request's tensor flattened and concatenated (a
    request is then one row)."""
    ragged_axes: Annotated[list[Axis], Field(max_length=MAX_AXIS)] = []
    """A padded input's axes whose sizes may differ between requests, in the order its
    ``lengths`` gives them; requests that differ on any other axis never share a batch."""
    pad_value: Number = 0.0
    """What a padded input is padded with."""
    lengths: Text | None = None
    """A ragged input's companion input, made by the server (INT64): each row's size on its
    ragged axis (``pad`` with one ragged axis: shape ``[N]``), on each of its ``k`` ragged
    axes (``pad`` with several: ``[N, k]``), or each request's element count (``concat``)."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        given, axes = self.model_fields_set, self.ragged_axes
        if self.shared and (self.ragged is not None or "axis" in given):
            raise checks.ValueProblem(
                "shared", "a shared input has no batch axis: no axis, no ragged"
            )
        if self.ragged == "concat" and "axis" in given:
            raise checks.ValueProblem("axis", "a concatenated input is flattened: no axis")
        if self.ragged is None and {"pad_value", "lengths"} & given:
            raise checks.ValueProblem("ragged", "pad_value and lengths are for a ragged input")
        if self.ragged != "pad" and "ragged_axes" in given:
            raise checks.ValueProblem("ragged_axes", 'ragged_axes are for ragged = "pad"')
        if self.ragged == "pad" and not axes:
            raise checks.ValueProblem("ragged_axes", "a padded input names the axes that may "
                                      "differ between requests: a list such as [1]")  # fmt: skip
        if len(set(axes)) != len(axes) or self.axis in axes:
            raise checks.ValueProblem("ragged_axes", "must be distinct axes other than the batch "
                                      f"axis {self.axis}")  # fmt: skip
        if self.ragged == "concat" and self.lengths is None:
            raise checks.ValueProblem("lengths", "a concatenated input needs its lengths input, "
                                      "which tells the runner where each request's elements "
                                      "end")  # fmt: skip
        return self


class _OutputBatching(_Table, title="[runner.batching.outputs.<name>]"):
    axis: Axis = 0
    """The axis its rows are on."""


class _Check(_Table, title="[runner.batching.check]"):
    rtol: Annotated[float, Field(ge=0, le=1)] = 1e-5
    """An answer batched is within ``atol + rtol * |alone|`` of the one it gets alone."""
    atol: Annotated[float, Field(ge=0, le=checks.MAX_NUMBER)] = 1e-5
    seed: Annotated[int, Field(ge=0, le=checks.MAX_INTEGER)] = 0
    """Of the random sample requests made from the runner's declared inputs."""
    sample: InFolder | None = None
    """A ``.npz`` of sample inputs instead, in the plugin folder."""


class _Batching(_Table, title="[runner.batching]"):
    inputs: dict[TensorName, _InputBatching] = {}
    """How each input joins a batch (an input not named: its rows on axis 0)."""
    outputs: dict[TensorName, _OutputBatching] = {}
    """Each output's batch axis (an output not named: its rows on axis 0)."""
    check: Annotated[_Check | None, BeforeValidator(_true_false_or_table)] = Field(
        default=None, json_schema_extra=_or_true_false
    )
    """At load, check that batching keeps the runner's answers: the same sample requests
    alone and batched, each answer within ``atol + rtol * |alone|``; batching is turned off
    (with a warning naming the outputs) when it changes them."""

    @model_validator(mode="after")
    def _made_once(self) -> Self:
        made = [spec.lengths for spec in self.inputs.values() if spec.lengths]
        clash = set(made) & set(self.inputs) or {m for m in made if made.count(m) > 1}
        if clash:
            raise checks.ValueProblem("inputs", f"{sorted(clash)[0]!r}: a lengths input is the "
                                      "server's to make, once")  # fmt: skip
        return self

    def section(self, folder: Path) -> BatchingSection:
        inputs = {
            name: InputBatching(**{**spec.model_dump(), "ragged_axes": tuple(spec.ragged_axes)})
            for name, spec in self.inputs.items()
        }
        check = None
        if self.check is not None:
            sample = None if self.check.sample is None else folder / self.check.sample
            check = BatchCheckSpec(self.check.rtol, self.check.atol, self.check.seed, sample)
        outputs = {name: spec.axis for name, spec in self.outputs.items()}
        return BatchingSection(MappingProxyType(inputs), MappingProxyType(outputs), check)


def _own_keys_only(schema: dict[str, Any]) -> None:
    """Without ``backend``, plugserve's keys only."""
    schema["if"] = {"not": {"required": ["backend"]}}
    schema["then"] = {"propertyNames": {"enum": sorted(schema["properties"])}}


class _Runner(_Table, title="[runner]", extra="allow", json_schema_extra=_own_keys_only):
    """The ``[runner]`` table: plugserve's keys; a backend declares its own
    (``runner_keys``), checked at load (:func:`check_runner_keys`)."""

    backend: Text | None = None
    """The backend that builds the runner (``onnxruntime``, ``tensorrt``, a plugin's);
    omitted, ``module`` builds it."""
    model: InFolder | None = None
    """``file.onnx`` (in the plugin folder), ``models:<name>``,
    ``models:<name>/<version>[/<file>]``."""
    providers: Annotated[list[Provider], Field(max_length=64)] = []
    """Execution providers, by name or as a table of a ``name`` and its options."""
    max_batch_size: Annotated[int, Field(ge=0, le=MAX_BATCH_SIZE)] = 0
    """Rows per batch; 0 turns dynamic batching off."""
    max_queue_delay_ms: Annotated[float, Field(ge=0, le=MAX_QUEUE_DELAY_MS)] = 0.0
    """The longest the oldest queued request waits for a batch to fill."""
    instances: Annotated[int, Field(ge=1, le=MAX_INSTANCES)] = 1
    """Concurrent executions of this runner."""
    max_queue_size: Annotated[int, Field(ge=0, le=checks.MAX_INTEGER)] = 0
    """Queued (not yet executing) requests before 429; 0: unbounded."""
    preferred_batch_sizes: Annotated[list[Count], Field(max_length=1000)] = []
    """Batches are cut to these sizes when they can be filled."""
    priority_levels: Annotated[int, Field(ge=1, le=MAX_PRIORITY_LEVELS)] = 1
    """v2 ``priority`` levels 1..N, 1 highest."""
    default_priority_level: Annotated[int, Field(ge=1, le=MAX_PRIORITY_LEVELS)] | None = None
    """A request's level when it gives none; default: the lowest (``priority_levels``)."""
    tenant_weights: dict[
        Annotated[str, Field(max_length=256), AfterValidator(_text)],
        Annotated[float, Field(gt=0, le=1e6)],
    ] = {}
    """Fair queueing between ``X-Tenant-ID`` values; a tenant not named weighs 1."""
    inline_budget_us: Annotated[int, Field(ge=0, le=60_000_000)] = 250
    """Small batches proven cheaper than this run without a thread hop."""
    max_streams: Count = 64
    """A streaming runner's streams in progress at once (more wait in its queue)."""
    breaker_failures: Annotated[int, Field(ge=0, le=1_000_000)] = 5
    """Plugin errors in a row that open the circuit; 0: no breaker."""
    breaker_reset_s: Seconds = 10.0
    """How long the circuit stays open before a probe."""
    cast_inputs: bool = False
    """Take other request datatypes, cast when no value changes."""
    isolation: Literal["none", "process"] = "none"
    """In the worker (``none``) or in runner processes of its own."""
    device: Device | None = None
    """With ``isolation = "process"``: the GPU its processes see (``cuda:N``)."""
    devices: Annotated[list[Device], Field(max_length=MAX_LIST)] = []
    """Or one per instance, in turn."""
    response_cache: bool = False
    """Answer a repeated request from the response cache: whole responses of the routes
    this runner serves (server/dataplane/cache.py)."""
    formats: dict[TensorName, Literal["FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW"]] = {}
    """An image input's layout, as Triton's model configuration names it (and shows it)."""
    labels: dict[TensorName, Annotated[InFolder, AfterValidator(_a_file)]] = {}
    """An output's class names: a file in the plugin folder (UTF-8, at most 16 MiB), one
    label a line; line ``i`` names class ``i``."""
    sequence: _Sequence | None = None
    """The runner serves sequences (correlated requests), each with its state kept in the
    server."""
    batching: _Batching | None = None
    """Each input's and output's batch axis, shared and ragged inputs."""
    load: Literal["eager", "on_demand"] | None = None
    """At start and on every change (``eager``), or on its first request; default: the
    server's ``default_load``."""
    pinned: bool = False
    """Never evicted to make room under the memory budget."""

    @model_validator(mode="wrap")
    @classmethod
    def _own_keys(cls, data: Any, handler: pydantic.ModelWrapValidatorHandler[Self]) -> Self:
        """Without a backend, plugserve's keys only (a typo such as ``max_batch_sise`` must
        not pass silently): unknown keys are reported with the other problems."""
        unknown = []
        if isinstance(data, dict) and data.get("backend") is None:
            unknown = [key for key in data if key not in cls.model_fields]
        try:
            runner = handler(data)
        except pydantic.ValidationError as exc:
            errors: list[Any] = exc.errors()
        else:
            errors = []
        if not unknown and not errors:
            return runner
        extra: list[Any] = [
            {"type": "extra_forbidden", "loc": (key,), "input": data[key]} for key in unknown
        ]
        raise pydantic.ValidationError.from_exception_data(cls.__name__, [*errors, *extra])

    @model_validator(mode="after")
    def _together(self) -> Self:
        """A default level among the levels; GPUs for runner processes, one per instance at
        most; no cached answers for a sequence's requests."""
        if self.default_priority_level is not None:
            checks.integer(self.default_priority_level, "default_priority_level", low=1,
                           high=self.priority_levels)  # fmt: skip
        if "device" in self.model_fields_set and "devices" in self.model_fields_set:
            raise checks.ValueProblem("devices", "give device or devices, not both")
        where, devices = ("device", [self.device]) if self.device else ("devices", self.devices)
        if len(devices) > self.instances:
            raise checks.ValueProblem(where, f"lists {len(devices)} devices for {self.instances} "
                                      "instance(s): one per instance at most")  # fmt: skip
        if devices and self.isolation != "process":
            raise checks.ValueProblem(
                where, 'sets a runner process\'s GPU: needs isolation = "process"'
            )
        if self.sequence is not None and self.response_cache:
            raise checks.ValueProblem(
                "sequence", "a sequence's answers depend on its state: no response_cache"
            )
        return self


RUNNER_KEYS = frozenset(_Runner.model_fields)
"""The ``[runner]`` keys plugserve reads itself; a backend declares its own (``runner_keys``)."""


class _Route(_Table, title="[route]"):
    name: Name | None = None
    """The route it serves; default: the runner's name."""
    preprocess: Annotated[list[PluginRef], Field(max_length=MAX_LIST)] = []
    """Preprocessors in order: ``@version`` pins one; none floats to the highest ready."""
    postprocess: Annotated[list[PluginRef], Field(max_length=MAX_LIST)] = []
    """Postprocessors in order, as ``preprocess``."""
    rate_limit: (
        Annotated[RateLimit, PlainValidator(RateLimit.parse), WithJsonSchema(_RATE_LIMIT)] | None
    ) = None
    """Requests a second (``rps``) and at once (``burst``; default: ``rps``); 429 over it."""
    openai: Annotated[list[OpenAIKind], BeforeValidator(_one_or_more)] = Field(
        default=[], json_schema_extra=_or_one
    )
    """Served at ``/v1/<kind>`` as ``model``: ``embeddings``, or ``chat`` and
    ``completions`` (one or both)."""

    @field_validator("openai")
    @classmethod
    def _apart(cls, kinds: list[str]) -> list[str]:
        if "embeddings" in kinds and len(set(kinds)) > 1:
            raise checks.ValueProblem("", "embeddings does not mix with text generation")
        return list(dict.fromkeys(kinds))


class ProcessorSection(_Table, title="[processor]"):
    """The ``[processor]`` table of a preprocessor or postprocessor."""

    cost: Literal["content", "size"] = "content"
    """What a synchronous call's cost follows. ``content``: what the request holds
    (compressed data, a count it asks for), so every call runs on the processor's thread;
    ``size``: at most in proportion to the call's size (the request's bytes and the
    tensors it is handed), so calls measured cheap for their size may run on the event
    loop."""

    @property
    def sized(self) -> bool:
        return self.cost == "size"


class _File(_Table, title="plugin.toml"):
    """A plugin's ``plugin.toml``: ``<type>/<name>/<version>/plugin.toml`` in the plugins
    folder."""

    plugin: _Plugin
    """What the plugin is: its name, version, type and code."""
    config: dict[str, Any] = {}
    """Free-form, handed to ``plugserve_create_component``."""
    runner: _Runner | None = None
    """Runners only."""
    route: _Route | None = None
    """Runners only: the route the runner serves and the chain around it."""
    processor: ProcessorSection = ProcessorSection()
    """Preprocessors and postprocessors only."""


# -- the records ----------------------------------------------------------------------------
# What the rest of plugserve reads, built from the valid tables (``SequenceControls`` and
# ``ProcessorSection`` are their tables themselves).


@dataclass(frozen=True)
class StateSpec:
    """One ``[[runner.sequence.state]]``: a tensor the server keeps for each sequence,
    fed to the runner as ``input`` and replaced by its ``output`` after each request."""

    input: str
    output: str
    datatype: str
    shape: tuple[int, ...]
    """One sequence's state without the batch axis (axis 0, the rows of a batch, unless
    ``[runner.batching]`` declares another for ``input`` and ``output``)."""
    initial: float = 0.0
    """Every element's value at the sequence's start."""


@dataclass(frozen=True)
class ContextSpec:
    """A ``[[runner.sequence.state]]`` with ``from_input``: the last samples of a request
    input, kept for the sequence's next request (a streaming model's left context).

    Each request's model input is the concatenation ``[context, chunk]`` along ``axis``
    (``chunk``: the request's ``source`` tensor); the next context is the last
    ``length`` samples of it along ``axis``, as a streaming wrapper keeps them. The context
    reaches the model prepended to ``source`` (``input == source``) or as an input of its
    own (``input``)."""

    input: str
    """The model input it is fed as: ``source`` itself (prepended) or an input of its own."""
    source: str
    """The request input whose samples it keeps (the client sends it)."""
    axis: int
    """The axis of ``source`` (its batch axis counted) that the samples run along."""
    datatype: str
    shape: tuple[int, ...]
    """One sequence's context without the batch axis; its size on ``axis`` (counted with
    the batch axis in place) is how many samples it keeps."""
    initial: float = 0.0
    """Every element's value at the sequence's start."""

    @property
    def prepended(self) -> bool:
        """Whether it reaches the model in front of the request's own samples."""
        return self.input == self.source

    def length(self, row_axis: int) -> int:
        """Samples it keeps, with the batch axis of ``source`` at ``row_axis``."""
        return (*self.shape[:row_axis], 1, *self.shape[row_axis:])[self.axis]


@dataclass(frozen=True)
class InputBatching:
    """How one input joins a batch: ``[runner.batching.inputs.<name>]``, each field as
    :class:`_InputBatching` declares it."""

    axis: int = 0
    shared: bool = False
    ragged: str | None = None
    ragged_axes: tuple[int, ...] = ()
    pad_value: float = 0.0
    lengths: str | None = None


DEFAULT_INPUT_BATCHING = InputBatching()


@dataclass(frozen=True)
class BatchCheckSpec:
    """How to check that batching keeps a runner's answers (``[runner.batching] check``, or
    ``plugserve validate --batching``): the same sample requests alone and batched, each
    answer within ``atol + rtol * |alone|`` of the one it gets alone."""

    rtol: float = 1e-5
    atol: float = 1e-5
    seed: int = 0
    """Of the random sample requests made from the runner's declared inputs."""
    sample: Path | None = None
    """A ``.npz`` of sample inputs instead."""


@dataclass(frozen=True)
class BatchingSection:
    """The ``[runner.batching]`` table: each input's and output's batch axis, shared and
    ragged inputs. Inputs and outputs it does not name have their rows on axis 0."""

    inputs: Mapping[str, InputBatching] = field(default_factory=lambda: MappingProxyType({}))
    outputs: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Output name: the axis its rows are on."""
    check: BatchCheckSpec | None = None
    """``check``: at load, run :class:`BatchCheckSpec`'s check; batching is turned off (with
    a warning naming the outputs) when it changes answers."""

    def input(self, name: str) -> InputBatching:
        return self.inputs.get(name, DEFAULT_INPUT_BATCHING)

    @property
    def made_inputs(self) -> tuple[str, ...]:
        """The ``lengths`` inputs the server makes: the client never sends them."""
        return tuple(spec.lengths for spec in self.inputs.values() if spec.lengths)


@dataclass(frozen=True)
class SequenceSection:
    """The ``[runner.sequence]`` table (:class:`_Sequence`): the runner serves sequences
    (correlated requests, as Triton's sequence batcher), each with its state kept in the
    server."""

    idle_timeout_s: float = 60.0
    max_sequences: int = 1024
    states: tuple[StateSpec, ...] = ()
    """The states carried from a model output to the next request's input."""
    contexts: tuple[ContextSpec, ...] = ()
    """The states kept from a request input's last samples (``from_input``)."""
    controls: SequenceControls = field(default_factory=SequenceControls)

    @property
    def tensors(self) -> frozenset[str]:
        """The inputs and outputs the server feeds and keeps, never a client's: states,
        contexts fed as inputs of their own, controls. A prepended context's input is
        the client's (its chunk), so it is not one of them."""
        return frozenset(
            (
                *(s.input for s in self.states),
                *(s.output for s in self.states),
                *(c.input for c in self.contexts if not c.prepended),
                *self.controls.names,
            )
        )


@dataclass(frozen=True)
class RunnerSection:
    """The ``[runner]`` table, each field as :class:`_Runner` declares it but for those said
    here. ``table`` is the whole table, handed to backend factories."""

    backend: str | None = None
    model: str | None = None
    providers: tuple[str, ...] = ()
    max_batch_size: int = 0
    max_queue_delay_ms: float = 0.0
    instances: int = 1
    max_queue_size: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    priority_levels: int = 1
    default_priority_level: int | None = None
    tenant_weights: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    inline_budget_us: int = 250
    max_streams: int = 64
    breaker_failures: int = 5
    breaker_reset_s: float = 10.0
    cast_inputs: bool = False
    isolation: str = "none"
    devices: tuple[str, ...] = ()
    """``cuda:N`` per instance, in turn (``device`` is one for all); ``()``: unset."""
    response_cache: bool = False
    formats: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    label_files: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Output name: its labels file, relative to the plugin folder."""
    labels: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    """Output name: its labels, one per class index (read from ``label_files`` at load)."""
    sequence: SequenceSection | None = None
    """``[runner.sequence]``: the runner serves sequences (``None``: independent requests)."""
    batching: BatchingSection | None = None
    """``[runner.batching]``: how inputs join a batch (``None``: every row on axis 0)."""
    load: str | None = None
    pinned: bool = False
    table: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def isolated(self) -> bool:
        return self.isolation == "process"


@dataclass(frozen=True)
class RouteSection:
    """The ``[route]`` table of a runner: the route it serves and the chain around it."""

    name: str | None = None
    preprocess: tuple[Ref, ...] = ()
    postprocess: tuple[Ref, ...] = ()
    rate_limit: RateLimit | None = None
    openai: tuple[str, ...] = ()
    """``embeddings``, ``chat``, ``completions``: served at ``/v1/<kind>`` as ``model``."""


@dataclass(frozen=True)
class Manifest:
    """A validated ``plugin.toml`` and the folder it was read from."""

    path: Path
    type: PluginType
    name: str
    version: Version
    module: str | None = None
    description: str = ""
    config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    requires: tuple[str, ...] = ()
    """``[plugin] requires`` (:class:`_Plugin`)."""
    runner: RunnerSection | None = None
    route: RouteSection = field(default_factory=RouteSection)
    processor: ProcessorSection = field(default_factory=ProcessorSection)

    @property
    def key(self) -> tuple[PluginType, str, Version]:
        return (self.type, self.name, self.version)

    @property
    def label(self) -> str:
        """``type/name@version``, the way logs, errors and metrics name a plugin."""
        return f"{self.type}/{self.name}@{self.version}"

    @property
    def route_name(self) -> str:
        return self.route.name or self.name


# -- reading the file, building the records --------------------------------------------------


def load_manifest(
    folder: Path, runner_overrides: Mapping[str, Any] | None = None, check_layout: bool = True
) -> Manifest:
    """Read and validate ``folder/plugin.toml``.

    ``folder`` must be ``<plugins_dir>/<type>/<name>/<version>``: the manifest's
    type, name and version must equal those folder names (unless not
    ``check_layout``: a package staged anywhere, as ``plugserve validate``
    checks it). ``runner_overrides`` replace ``[runner]`` keys before validation
    (a model repository load's ``config``), checked as if the file held them.
    """
    raw = _read(folder)
    if runner_overrides and isinstance(raw.get("runner", {}), dict):
        raw = {**raw, "runner": {**raw.get("runner", {}), **runner_overrides}}
    return parse_manifest(raw, folder, check_layout)


def _read(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST_NAME
    try:
        return checks.read_toml(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise ManifestError(path, "no plugin.toml in the plugin folder") from None
    except checks.ValueProblem as exc:
        raise ManifestError(path, exc.reason) from None


def manifest_problems(folder: Path, check_layout: bool = True) -> tuple[Manifest | None, list[str]]:
    """Every problem of ``folder/plugin.toml``, not only the first (``plugserve validate``):
    each field's that its table's declaration finds, or else the first of the checks
    between tables; at most :data:`MAX_PROBLEMS`. The manifest, when there is none."""
    try:
        raw = _read(folder)
    except ManifestError as exc:
        return None, [exc.message]
    manifest, problems = _checked(raw, folder, check_layout)
    return manifest, [problem.message for problem in problems[:MAX_PROBLEMS]]


def parse_manifest(raw: Mapping[str, Any], folder: Path, check_layout: bool = True) -> Manifest:
    """Validate a parsed manifest ``raw`` from ``folder``; raises :class:`ManifestError` only
    (its first problem)."""
    manifest, problems = _checked(raw, folder, check_layout)
    if manifest is None:
        raise problems[0]
    return manifest


def _checked(
    raw: Mapping[str, Any], folder: Path, check_layout: bool
) -> tuple[Manifest | None, list[ManifestError]]:
    """The manifest, or its problems: every field's, or the first between tables."""
    path = folder / MANIFEST_NAME
    try:
        checks.shallow(raw)
        tables = _File.model_validate(dict(raw), context=folder)
        return _manifest(tables, raw, folder, check_layout), []
    except pydantic.ValidationError as exc:
        problems = checks.field_problems(exc, _File)
        return None, [ManifestError(path, p.reason, p.field or None) for p in problems]
    except ManifestError as exc:
        return None, [exc]
    except checks.ValueProblem as exc:
        return None, [ManifestError(path, exc.reason, exc.field or None)]
    except Exception as exc:  # outside data: whatever a check missed is this file's error
        return None, [ManifestError(path, f"invalid: {type(exc).__name__}: {exc}")]


def check_runner_keys(manifest: Manifest, backend: str, declared: Iterable[str]) -> None:
    """Refuse ``[runner]`` keys that neither plugserve nor the backend reads (a typo such
    as ``max_batch_sise`` must not pass silently); ``declared`` is the backend's ``runner_keys``."""
    if manifest.runner is None:
        return
    try:
        checks.known_keys(manifest.runner.table, "runner", RUNNER_KEYS | set(declared))
    except checks.ValueProblem as exc:
        raise ManifestError(
            manifest.path / MANIFEST_NAME, f"{exc.reason} (with backend {backend!r})", "runner"
        ) from None


def declared_batching(runner: Mapping[str, Any], folder: Path) -> BatchingSection | None:
    """The ``[runner.batching]`` of the checked manifest in ``folder``, from its ``[runner]``
    table (what a backend factory is handed), or ``None``."""
    if "batching" not in runner:
        return None
    try:
        table = _Batching.model_validate(runner["batching"], context=folder)
    except pydantic.ValidationError as exc:
        problem = checks.field_problems(exc, _Batching)[0]
        field = checks.dotted("runner.batching", problem.field)
        raise ManifestError(folder / MANIFEST_NAME, problem.reason, field) from None
    return table.section(folder)


def _manifest(tables: _File, raw: Mapping[str, Any], folder: Path, check_layout: bool) -> Manifest:
    """The records of valid tables, once the checks between them pass."""
    path, plugin = folder / MANIFEST_NAME, tables.plugin
    if check_layout:
        _check_layout(path, folder, plugin)
    if plugin.type != "runner":
        for table in ("runner", "route"):
            if table in raw:
                raise ManifestError(path, f"only runners have a [{table}] table", table)
        if plugin.module is None:
            raise ManifestError(path, f"a {plugin.type} needs a module", "plugin.module")
    elif "processor" in raw:
        raise ManifestError(path, "only processors have a [processor] table", "processor")
    runner = None
    if plugin.type == "runner":
        runner = _runner(path, tables.runner or _Runner(), raw.get("runner", {}), folder)
        if runner.backend is None and plugin.module is None:
            raise ManifestError(path, "a runner needs a backend or a module", "runner.backend")
    route = tables.route or _Route()
    return Manifest(
        path=folder,
        type=plugin.type,
        name=plugin.name,
        version=Version.parse(plugin.version),
        module=plugin.module,
        description=plugin.description,
        requires=tuple(plugin.requires),
        config=MappingProxyType(dict(tables.config)),
        runner=runner,
        route=RouteSection(**{key: _frozen(value) for key, value in route}),
        processor=tables.processor,
    )


def _check_layout(path: Path, folder: Path, plugin: _Plugin) -> None:
    """``folder`` is ``<type>/<name>/<version>`` as the manifest says."""
    for key, value, expected in (
        ("plugin.type", plugin.type, folder.parent.parent.name),
        ("plugin.name", plugin.name, folder.parent.name),
        ("plugin.version", plugin.version, folder.name),
    ):
        if value != expected:
            raise ManifestError(path, f"{value!r} differs from folder {expected!r}", key)


def _runner(path: Path, table: _Runner, raw: Mapping[str, Any], folder: Path) -> RunnerSection:
    """The record of a valid ``[runner]``: its keys as given (lists as tuples, tables
    read-only), its labels files read, its sequence's states checked against its batching."""
    batching = None if table.batching is None else table.batching.section(folder)
    sequence = None if table.sequence is None else table.sequence.section()
    if sequence is not None:
        _check_state_axes(path, sequence, batching)
    labels = {output: _read_labels(path, folder, file) for output, file in table.labels.items()}
    fields = {f.name for f in dataclasses.fields(RunnerSection)}
    record = {name: _frozen(value) for name, value in table if name in fields}
    record.update(
        preferred_batch_sizes=tuple(sorted(set(table.preferred_batch_sizes))),
        devices=(table.device,) if table.device else tuple(table.devices),
        label_files=MappingProxyType(dict(table.labels)),
        labels=MappingProxyType(labels),
        sequence=sequence,
        batching=batching,
        table=MappingProxyType(dict(raw)),
    )
    return RunnerSection(**record)


def _frozen(value: Any) -> Any:
    """A list as a tuple, a table read-only."""
    if isinstance(value, list):
        return tuple(value)
    return MappingProxyType(dict(value)) if isinstance(value, dict) else value


def _read_labels(path: Path, folder: Path, relative: str) -> tuple[str, ...]:
    """One label a line (UTF-8); the line's index is the class index it names."""
    where = "runner.labels"
    if (folder / relative).stat().st_size > MAX_LABELS_BYTES:
        raise ManifestError(path, f"{relative!r} is over {MAX_LABELS_BYTES} bytes", where)
    try:
        text = (folder / relative).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(path, f"{relative!r} cannot be read: {exc}", where) from None
    return tuple(line.rstrip("\r") for line in text.removesuffix("\n").split("\n"))


def _check_state_axes(
    path: Path, sequence: SequenceSection, batching: BatchingSection | None
) -> None:
    """A state's row goes on its declared axis (at most its rank): never shared or ragged.
    A context's samples run along an axis other than its input's batch axis, and a context
    fed as an input of its own has its rows where that input has them."""
    batching = batching or BatchingSection()
    for context in sequence.contexts:
        _check_context_axes(path, context, batching)
    for spec in sequence.states:
        declared = batching.input(spec.input)
        axes = (declared.axis, batching.outputs.get(spec.output, 0))
        if declared.shared or declared.ragged or max(axes) > len(spec.shape):
            raise ManifestError(
                path, f"state {spec.input!r} of shape {list(spec.shape)} has its rows on an "
                "axis from 0 to its rank, and is neither shared nor ragged", "runner.batching",
            )  # fmt: skip


def _check_context_axes(path: Path, spec: ContextSpec, batching: BatchingSection) -> None:
    source = batching.input(spec.source)
    where = f"runner.batching.inputs.{spec.source}"
    if source.shared or source.ragged == "concat" or spec.source in batching.made_inputs:
        raise ManifestError(path, f"input {spec.source!r} keeps a context: its rows are on "
                            "an axis (neither shared nor concatenated)", where)  # fmt: skip
    if source.axis > len(spec.shape):
        raise ManifestError(path, f"input {spec.source!r} keeps a context of shape "
                            f"{list(spec.shape)}: its rows are on an axis from 0 to "
                            f"{len(spec.shape)}", where)  # fmt: skip
    if spec.axis == source.axis:
        raise ManifestError(path, f"axis {spec.axis} holds the rows of input "
                            f"{spec.source!r} (its batch axis): its context's samples run "
                            "along another", "runner.sequence.state")  # fmt: skip
    if spec.prepended:
        return
    fed = batching.input(spec.input)
    if fed.shared or fed.ragged or fed.axis != source.axis:
        raise ManifestError(path, f"context input {spec.input!r} has its rows where "
                            f"{spec.source!r} has them (axis {source.axis}), neither shared "
                            f"nor ragged", f"runner.batching.inputs.{spec.input}")  # fmt: skip


def _holds(datatype: str, value: float) -> bool:
    """Whether ``value`` is one of ``datatype``'s: exactly for integers and booleans,
    within range for floats (which round to their nearest)."""
    dtype = np.dtype("bool" if datatype == "BOOL" else datatype.lower().replace("fp", "float"))
    with np.errstate(all="ignore"):
        held = np.array(value).astype(dtype)
    if dtype.kind == "f":
        return bool(np.isfinite(held))
    return float(held) == value


def tensor_name(value: Any, field: str) -> str:
    """A tensor's name as a manifest gives it (a table's key, a state's input): a string of
    at most :data:`MAX_TENSOR_NAME` characters without control characters, so that it
    reads the same in logs, metadata and every file written from it."""
    return checks.text(value, field, max_length=MAX_TENSOR_NAME)


def tensor_names(table: Any, field: str) -> None:
    """Check the keys of a table keyed by tensor name (what is not a table is the
    table's own check's to refuse)."""
    if isinstance(table, Mapping):
        for name in table:
            tensor_name(name, field)


def manifest_schema() -> dict[str, Any]:
    """The JSON Schema of ``plugin.toml`` (``docs/schemas/plugin.schema.json``), for editors:
    what no one key says alone (paths inside the folder, axes against shapes) is the
    server's to check."""
    checks.with_docstrings(_File)
    schema = _File.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    for table in (schema, *schema["$defs"].values()):
        for key in table.get("properties", {}).values():
            key.pop("title", None)
            if {"type": "null"} in key.get("anyOf", ()):  # TOML has no null: the key is left out
                key["anyOf"].remove({"type": "null"})
                if len(key["anyOf"]) == 1:
                    key.update(key.pop("anyOf")[0])
                if key.get("default", 0) is None:
                    del key["default"]
    return schema


if __name__ == "__main__":
    json.dump(manifest_schema(), sys.stdout, indent=2)
    sys.stdout.write("\n")
