"""``plugin.toml``: parsing and validation into typed, immutable records.

Every error names the file and the field, so that an operator reading the admin
API or the log knows what to fix.
"""

from __future__ import annotations

import ast
import copy
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from plugserve.registry import checks, requirements
from plugserve.registry.errors import ManifestError
from plugserve.registry.ratelimit import RateLimit
from plugserve.registry.refs import NAME_PATTERN, PLUGIN_TYPES, PluginType, Ref, is_valid_name
from plugserve.registry.versions import Version

MANIFEST_NAME = "plugin.toml"
MAX_MANIFEST_BYTES = 1024 * 1024
"""Largest ``plugin.toml`` read: a manifest is a few KiB; data files (labels, models) lie
beside it."""

_PLUGIN_KEYS = {"name", "version", "type", "module", "description", "requires"}
_ROUTE_KEYS = {"name", "preprocess", "postprocess", "rate_limit", "openai"}
_TABLES = {"plugin", "config", "runner", "route", "processor"}
_PROCESSOR_KEYS = {"cost"}
COSTS = ("content", "size")
"""``[processor] cost``: what a synchronous call's cost follows. ``content``: what the
request holds (compressed data, a count it asks for), so every call runs on the processor's
thread; ``size``: at most in proportion to the call's size (the request's bytes and the
tensors it is handed), so calls measured cheap for their size may run on the event loop."""
RUNNER_KEYS = frozenset(
    {
        "backend",
        "model",
        "providers",
        "max_batch_size",
        "max_queue_delay_ms",
        "instances",
        "max_queue_size",
        "preferred_batch_sizes",
        "priority_levels",
        "default_priority_level",
        "tenant_weights",
        "inline_budget_us",
        "max_streams",
        "breaker_failures",
        "breaker_reset_s",
        "cast_inputs",
        "isolation",
        "device",
        "devices",
        "response_cache",
        "formats",
        "labels",
        "sequence",
        "batching",
        "load",
        "pinned",
    }
)
"""The ``[runner]`` keys plugserve reads itself; a backend declares its own (``runner_keys``)."""

# Bounds of the [runner] numbers: generous, but finite and far from overflowing anything.
MAX_BATCH_SIZE = 1_000_000
MAX_INSTANCES = 1024
MAX_QUEUE_DELAY_MS = 3_600_000.0
MAX_PRIORITY_LEVELS = 1000
LOADS = ("eager", "on_demand")
"""``[runner] load``: at start and on every change (``eager``), or on its first request."""
ISOLATIONS = ("none", "process")
"""``[runner] isolation``: in the worker (``none``) or in runner processes of its own."""
FORMATS = ("FORMAT_NONE", "FORMAT_NHWC", "FORMAT_NCHW")
"""``[runner] formats``: an image input's layout, as Triton's model configuration names it."""
MAX_LABELS_BYTES = 16 * 1024 * 1024
OPENAI_KINDS = ("embeddings", "chat", "completions")
"""``[route] openai``: the OpenAI-compatible routes (``/v1/...``) a route is served at."""


SEQUENCE_KEYS = frozenset({"idle_timeout_s", "max_sequences", "state", "controls"})
CONTROL_KEYS = frozenset({"start", "end", "ready", "corrid", "corrid_datatype"})
CORRID_DATATYPES = ("BYTES", "UINT64", "INT64")
STATE_KEYS = frozenset({"input", "output", "from_input", "axis", "datatype", "shape", "initial"})
MAX_SEQUENCES = 1_000_000
MAX_IDLE_S = 7 * 86_400.0
MAX_STATE_ELEMENTS = 1 << 24
"""Elements of one sequence's state tensor at most (64 MiB of FP32)."""


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


BATCHING_KEYS = frozenset({"inputs", "outputs", "check"})
CHECK_KEYS = frozenset({"rtol", "atol", "seed", "sample"})
INPUT_BATCHING_KEYS = frozenset({"axis", "shared", "ragged", "ragged_axes", "pad_value", "lengths"})
RAGGED = ("pad", "concat")
"""``ragged``: pad each request's tensor to the batch's largest, or concatenate them flat."""
MAX_AXIS = 15


@dataclass(frozen=True)
class InputBatching:
    """How one input joins a batch (``[runner.batching.inputs]``)."""

    axis: int = 0
    """The axis its rows are on: requests are concatenated along it."""
    shared: bool = False
    """One value for the whole batch: requests whose values differ never batch together."""
    ragged: str | None = None
    """``pad``: requests may differ on the ``ragged_axes``, padded with ``pad_value`` to the
    batch's largest; ``concat``: each request's tensor flattened and concatenated (a
    request is then one row)."""
    ragged_axes: tuple[int, ...] = ()
    """A padded input's axes whose sizes may differ between requests, in the order its
    ``lengths`` gives them; requests that differ on any other axis never share a batch."""
    pad_value: float = 0.0
    lengths: str | None = None
    """A ragged input's companion input, made by the server (INT64): each row's size on its
    ragged axis (``pad`` with one ragged axis: shape ``[N]``), on each of its ``k`` ragged
    axes (``pad`` with several: ``[N, k]``), or each request's element count (``concat``)."""


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
    """A ``.npz`` of sample inputs instead (the manifest's: relative to the plugin folder)."""


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
class SequenceControls:
    """``[runner.sequence.controls]``: the control inputs the server feeds each request of a
    sequence, as Triton's sequence batcher does (each ``[1, 1]``, one row a request); the
    names of the runner's inputs, ``None`` for a control it does not take."""

    start: str | None = None
    """INT32: 1 on the sequence's first request, else 0."""
    end: str | None = None
    """INT32: 1 on its last request, else 0."""
    ready: str | None = None
    """INT32: 1 (every row is a request)."""
    corrid: str | None = None
    """The sequence id: its text (BYTES), or an integer (``corrid_datatype``)."""
    corrid_datatype: str = "BYTES"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.start, self.end, self.ready, self.corrid) if n)


@dataclass(frozen=True)
class SequenceSection:
    """The ``[runner.sequence]`` table: the runner serves sequences (correlated requests,
    as Triton's sequence batcher), each with its state kept in the server."""

    idle_timeout_s: float = 60.0
    """A sequence with no request for this long ends, and its state is dropped."""
    max_sequences: int = 1024
    """Sequences alive at once; a start beyond them is refused (429)."""
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
    """The ``[runner]`` table. ``table`` is the whole table, handed to backend factories."""

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
    """A streaming runner's streams in progress at once (more wait in its queue)."""
    breaker_failures: int = 5
    breaker_reset_s: float = 10.0
    cast_inputs: bool = False
    isolation: str = "none"
    devices: tuple[str, ...] = ()
    """``cuda:N`` per instance, in turn (``device`` is one for all); ``()``: unset."""
    response_cache: bool = False
    """Cache whole responses of the routes this runner serves (server/dataplane/cache.py)."""
    formats: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Input name: ``FORMAT_NCHW`` or ``FORMAT_NHWC`` (shown in the model configuration)."""
    label_files: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Output name: its labels file, relative to the plugin folder."""
    labels: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    """Output name: its labels, one per class index (read from ``label_files`` at load)."""
    sequence: SequenceSection | None = None
    """``[runner.sequence]``: the runner serves sequences (``None``: independent requests)."""
    batching: BatchingSection | None = None
    """``[runner.batching]``: how inputs join a batch (``None``: every row on axis 0)."""
    load: str | None = None
    """``eager`` or ``on_demand`` (``None``: the server's ``default_load``)."""
    pinned: bool = False
    """Never evicted to make room under the memory budget."""
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
class ProcessorSection:
    """The ``[processor]`` table of a preprocessor or postprocessor."""

    cost: str = "content"
    """One of ``COSTS``: whether a call's cost is bounded by its size (``size``)."""

    @property
    def sized(self) -> bool:
        return self.cost == "size"


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
    """``[plugin] requires``: the Python packages the plugin needs (PEP 508 requirements, or
    alternatives of them separated by ``|``), checked against the server's environment at
    load (``registry/requirements.py``)."""
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
    path = folder / MANIFEST_NAME
    try:
        raw = checks.read_toml(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise ManifestError(path, "no plugin.toml in the plugin folder") from None
    except checks.ValueProblem as exc:
        raise ManifestError(path, exc.reason) from None
    if runner_overrides and isinstance(raw.get("runner", {}), dict):
        raw = {**raw, "runner": {**raw.get("runner", {}), **runner_overrides}}
    return parse_manifest(raw, folder, check_layout)


MAX_PROBLEMS = 64
_STEP = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
_UNKNOWN = re.compile(r"unknown key\(s\) (\[.*?\]);")


def manifest_problems(folder: Path, check_layout: bool = True) -> tuple[Manifest | None, list[str]]:
    """Every problem of ``folder/plugin.toml``, not only the first: after each, the field
    at fault is set aside and the rest checked again (``plugserve validate``). The
    manifest, when there is none."""
    try:
        return load_manifest(folder, check_layout=check_layout), []
    except ManifestError as first:
        problems = [first.message]
        field, message = first.fields.get("field"), first.message
    try:
        raw: Any = copy.deepcopy(checks.read_toml(folder / MANIFEST_NAME, MAX_MANIFEST_BYTES))
    except (FileNotFoundError, checks.ValueProblem):
        return None, problems  # unreadable: the one problem there is
    while len(problems) < MAX_PROBLEMS and _set_aside(raw, field, message):
        try:
            parse_manifest(raw, folder, check_layout)
            break
        except ManifestError as exc:
            if exc.message in problems:
                break
            problems.append(exc.message)
            field, message = exc.fields.get("field"), exc.message
    return None, problems


def _set_aside(raw: Any, field: str | None, message: str) -> bool:
    """Remove what ``field`` names from ``raw`` (its unknown keys, for an unknown-keys
    problem); ``False`` when that cannot go on (a required or ``[plugin]`` field)."""
    steps: list[str | int] = [
        name if name else int(index) for name, index in _STEP.findall(field or "")
    ]
    unknown = _UNKNOWN.search(message)
    if unknown and field is not None:
        try:
            keys = ast.literal_eval(unknown.group(1))
        except (ValueError, SyntaxError):
            return False
        container = _walk(raw, steps)
        if not isinstance(container, dict):
            return False
        for key in keys:
            container.pop(key, None)
        return True
    if not field or field.split(".")[0] == "plugin" or "is required" in message:
        return False
    parent = _walk(raw, steps[:-1])
    last = steps[-1] if steps else None
    if isinstance(parent, dict) and last in parent:
        del parent[last]
        return True
    if isinstance(parent, list) and isinstance(last, int) and last < len(parent):
        del parent[last]
        return True
    return False


def _walk(raw: Any, steps: list[str | int]) -> Any:
    node = raw
    for step in steps:
        in_list = isinstance(node, list) and isinstance(step, int) and step < len(node)
        if not (in_list or (isinstance(node, dict) and step in node)):
            return None
        node = node[step]
    return node


def parse_manifest(raw: Mapping[str, Any], folder: Path, check_layout: bool = True) -> Manifest:
    """Validate a parsed manifest ``raw`` from ``folder``; raises :class:`ManifestError` only."""
    path = folder / MANIFEST_NAME
    try:
        checks.shallow(raw)
        return _parse(raw, folder, _Fields(path), check_layout)
    except ManifestError:
        raise
    except checks.ValueProblem as exc:
        raise ManifestError(path, exc.reason, exc.field or None) from None
    except Exception as exc:  # outside data: whatever a check missed is this file's error
        raise ManifestError(path, f"invalid: {type(exc).__name__}: {exc}") from None


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


def _parse(raw: Mapping[str, Any], folder: Path, p: _Fields, check_layout: bool) -> Manifest:
    path = p.path
    p.no_unknown_keys(raw, "", _TABLES)
    plugin = p.table(raw, "plugin", required=True)
    p.no_unknown_keys(plugin, "plugin", _PLUGIN_KEYS)

    kind = p.required_string(plugin, "plugin.type")
    if kind not in PLUGIN_TYPES:
        raise ManifestError(path, f"must be one of {', '.join(PLUGIN_TYPES)}", "plugin.type")
    name = p.required_string(plugin, "plugin.name")
    if not is_valid_name(name):
        raise ManifestError(path, f"{name!r} must match {NAME_PATTERN}", "plugin.name")
    version_text = p.required_string(plugin, "plugin.version")
    try:
        version = Version.parse(version_text)
    except ValueError as exc:
        raise ManifestError(path, str(exc), "plugin.version") from None

    if check_layout:
        _check_layout(path, folder, kind, name, version_text)

    module = p.string(plugin, "plugin.module")
    if module is not None:
        checks.relative_path(module, "plugin.module")
        _check_relative(path, folder, module, "plugin.module")
    runner = _runner_section(p, raw, folder) if kind == "runner" else None
    if kind != "runner":
        for table in ("runner", "route"):
            if table in raw:
                raise ManifestError(path, f"only runners have a [{table}] table", table)
    elif "processor" in raw:
        raise ManifestError(path, "only processors have a [processor] table", "processor")
    elif runner is not None and runner.backend is None and module is None:
        raise ManifestError(path, "a runner needs a backend or a module", "runner.backend")
    if kind != "runner" and module is None:
        raise ManifestError(path, f"a {kind} needs a module", "plugin.module")

    return Manifest(
        path=folder,
        type=kind,
        name=name,
        version=version,
        module=module,
        description=p.string(plugin, "plugin.description", multiline=True) or "",
        requires=_requires(p, plugin),
        config=MappingProxyType(dict(p.table(raw, "config"))),
        runner=runner,
        route=_route_section(p, raw) if kind == "runner" else RouteSection(),
        processor=_processor_section(p, raw),
    )


def _processor_section(p: _Fields, raw: Mapping[str, Any]) -> ProcessorSection:
    table = p.table(raw, "processor")
    p.no_unknown_keys(table, "processor", _PROCESSOR_KEYS)
    cost = p.string(table, "processor.cost") or "content"
    if cost not in COSTS:
        raise ManifestError(p.path, f"must be one of {', '.join(COSTS)}", "processor.cost")
    return ProcessorSection(cost=cost)


def _check_layout(path: Path, folder: Path, kind: str, name: str, version: str) -> None:
    """``folder`` is ``<type>/<name>/<version>`` as the manifest says."""
    folders = {"plugin.version": folder.name, "plugin.name": folder.parent.name}
    folders["plugin.type"] = folder.parent.parent.name
    for key, value in (("plugin.type", kind), ("plugin.name", name)):
        if value != folders[key]:
            raise ManifestError(path, f"{value!r} differs from folder {folders[key]!r}", key)
    if version != folder.name:
        raise ManifestError(
            path, f"{version!r} differs from folder {folder.name!r}", "plugin.version"
        )


def _runner_section(p: _Fields, raw: Mapping[str, Any], folder: Path) -> RunnerSection:
    table = p.table(raw, "runner")
    backend = p.string(table, "runner.backend")
    if backend is None:  # a backend declares more keys: the loader checks those (check_runner_keys)
        p.no_unknown_keys(table, "runner", RUNNER_KEYS)
    model = p.string(table, "runner.model")
    if model is not None:
        checks.relative_path(model, "runner.model")
    if model is not None and not model.startswith("models:"):
        _check_relative(p.path, folder, model, "runner.model")
    providers = _provider_names(p, table)
    files = _label_files(p, table, folder)
    levels = p.integer(table, "runner.priority_levels", 1, 1, MAX_PRIORITY_LEVELS)
    return RunnerSection(
        backend=backend,
        model=model,
        providers=tuple(providers),
        max_batch_size=p.integer(table, "runner.max_batch_size", 0, 0, MAX_BATCH_SIZE),
        max_queue_delay_ms=p.number(table, "runner.max_queue_delay_ms", 0.0, MAX_QUEUE_DELAY_MS),
        instances=p.integer(table, "runner.instances", 1, 1, MAX_INSTANCES),
        max_queue_size=p.integer(table, "runner.max_queue_size", 0, 0, checks.MAX_INTEGER),
        preferred_batch_sizes=_preferred_sizes(p, table),
        priority_levels=levels,
        default_priority_level=_default_level(p, table, levels),
        tenant_weights=_tenant_weights(p, table),
        inline_budget_us=p.integer(table, "runner.inline_budget_us", 250, 0, 60_000_000),
        max_streams=p.integer(table, "runner.max_streams", 64, 1, MAX_BATCH_SIZE),
        breaker_failures=p.integer(table, "runner.breaker_failures", 5, 0, 1_000_000),
        breaker_reset_s=p.number(table, "runner.breaker_reset_s", 10.0, 86_400.0),
        cast_inputs=p.boolean(table, "runner.cast_inputs", False),
        isolation=_isolation(p, table),
        devices=_devices(p, table),
        response_cache=p.boolean(table, "runner.response_cache", False),
        formats=_formats(p, table),
        label_files=MappingProxyType(files),
        labels=MappingProxyType(
            {output: _read_labels(p, folder, f) for output, f in files.items()}
        ),
        sequence=_check_state_axes(p, _sequence(p, table), _batching(p, table)),
        batching=_batching(p, table),
        load=_load_mode(p, table),
        pinned=p.boolean(table, "runner.pinned", False),
        table=MappingProxyType(dict(table)),
    )


def _requires(p: _Fields, plugin: Mapping[str, Any]) -> tuple[str, ...]:
    """PEP 508 requirements, or alternatives of them separated by ``|``, each parsed whole
    and its markers evaluated here, as the loader evaluates them: a requirement that parses
    but whose marker cannot be evaluated (``~=`` on a name that is no version) is this
    file's error, not the load's (``registry/requirements.py``)."""
    texts = p.string_list(plugin, "plugin.requires")
    for index, text in enumerate(texts):
        try:
            requirements.parse_entry(text)
        except requirements.RequirementTextError as exc:
            raise ManifestError(p.path, str(exc), f"plugin.requires[{index}]") from None
    return tuple(texts)


def _sequence(p: _Fields, runner: Mapping[str, Any]) -> SequenceSection | None:
    if "sequence" not in runner:
        return None
    if p.boolean(runner, "runner.response_cache", False):
        raise ManifestError(p.path, "a sequence's answers depend on its state: no response_cache",
                            "runner.sequence")  # fmt: skip
    table = p.table(runner, "runner.sequence")
    p.no_unknown_keys(table, "runner.sequence", SEQUENCE_KEYS)
    raw_states = table.get("state", [])
    if not isinstance(raw_states, list) or len(raw_states) > checks.MAX_ITEMS:
        raise ManifestError(p.path, "must be a list of [[runner.sequence.state]] tables",
                            "runner.sequence.state")  # fmt: skip
    parsed = [_state(p, raw, f"runner.sequence.state[{i}]") for i, raw in enumerate(raw_states)]
    states = [s for s in parsed if isinstance(s, StateSpec)]
    contexts = [s for s in parsed if isinstance(s, ContextSpec)]
    inputs, outputs = [s.input for s in parsed], [s.output for s in states]
    if len(set(inputs)) != len(inputs) or len(set(outputs)) != len(outputs):
        raise ManifestError(p.path, "each state needs an input and an output of its own",
                            "runner.sequence.state")  # fmt: skip
    fed = {*(s.input for s in states), *outputs, *(c.input for c in contexts if not c.prepended)}
    for index, spec in enumerate(parsed):
        if isinstance(spec, ContextSpec) and spec.source in fed:
            raise ManifestError(p.path, f"{spec.source!r} is a tensor the server feeds or "
                                "keeps; from_input names an input each request sends",
                                f"runner.sequence.state[{index}].from_input")  # fmt: skip
    return SequenceSection(
        idle_timeout_s=checks.number(
            table.get("idle_timeout_s", 60.0), "runner.sequence.idle_timeout_s",
            low=0.0, high=MAX_IDLE_S, above=True,
        ),
        max_sequences=p.integer(table, "runner.sequence.max_sequences", 1024, 1, MAX_SEQUENCES),
        states=tuple(states),
        contexts=tuple(contexts),
        controls=_controls(p, table, {*inputs, *outputs, *(c.source for c in contexts)}),
    )  # fmt: skip


def _controls(p: _Fields, sequence: Mapping[str, Any], states: set[str]) -> SequenceControls:
    where = "runner.sequence.controls"
    table = p.table(sequence, where)
    p.no_unknown_keys(table, where, CONTROL_KEYS)
    datatype = p.string(table, f"{where}.corrid_datatype") or "BYTES"
    if datatype not in CORRID_DATATYPES:
        raise ManifestError(p.path, f"must be one of {', '.join(CORRID_DATATYPES)}",
                            f"{where}.corrid_datatype")  # fmt: skip
    controls = SequenceControls(
        start=p.string(table, f"{where}.start"),
        end=p.string(table, f"{where}.end"),
        ready=p.string(table, f"{where}.ready"),
        corrid=p.string(table, f"{where}.corrid"),
        corrid_datatype=datatype,
    )
    names = controls.names
    if len(set(names)) < len(names) or set(names) & states:
        raise ManifestError(p.path, "each control names an input of its own, no state's "
                            "nor one a state is kept from", where)  # fmt: skip
    return controls


def _check_state_axes(
    p: _Fields, sequence: SequenceSection | None, batching: BatchingSection | None
) -> SequenceSection | None:
    """A state's row goes on its declared axis (at most its rank): never shared or ragged.
    A context's samples run along an axis other than its input's batch axis, and a context
    fed as an input of its own has its rows where that input has them."""
    if sequence is None:
        return sequence
    for context in sequence.contexts:
        _check_context_axes(p, context, batching or BatchingSection())
    if batching is None:
        return sequence
    for spec in sequence.states:
        declared = batching.input(spec.input)
        axes = (declared.axis, batching.outputs.get(spec.output, 0))
        if declared.shared or declared.ragged or max(axes) > len(spec.shape):
            raise ManifestError(
                p.path, f"state {spec.input!r} of shape {list(spec.shape)} has its rows on an "
                "axis from 0 to its rank, and is neither shared nor ragged", "runner.batching",
            )  # fmt: skip
    return sequence


def _check_context_axes(p: _Fields, spec: ContextSpec, batching: BatchingSection) -> None:
    source = batching.input(spec.source)
    where = f"runner.batching.inputs.{spec.source}"
    if source.shared or source.ragged == "concat" or spec.source in batching.made_inputs:
        raise ManifestError(p.path, f"input {spec.source!r} keeps a context: its rows are on "
                            "an axis (neither shared nor concatenated)", where)  # fmt: skip
    if source.axis > len(spec.shape):
        raise ManifestError(p.path, f"input {spec.source!r} keeps a context of shape "
                            f"{list(spec.shape)}: its rows are on an axis from 0 to "
                            f"{len(spec.shape)}", where)  # fmt: skip
    if spec.axis == source.axis:
        raise ManifestError(p.path, f"axis {spec.axis} holds the rows of input "
                            f"{spec.source!r} (its batch axis): its context's samples run "
                            "along another", "runner.sequence.state")  # fmt: skip
    if spec.prepended:
        return
    fed = batching.input(spec.input)
    if fed.shared or fed.ragged or fed.axis != source.axis:
        raise ManifestError(p.path, f"context input {spec.input!r} has its rows where "
                            f"{spec.source!r} has them (axis {source.axis}), neither shared "
                            f"nor ragged", f"runner.batching.inputs.{spec.input}")  # fmt: skip


def _batching(p: _Fields, runner: Mapping[str, Any]) -> BatchingSection | None:
    if "batching" not in runner:
        return None
    table = p.table(runner, "runner.batching")
    p.no_unknown_keys(table, "runner.batching", BATCHING_KEYS)
    for kind in ("inputs", "outputs"):
        tensor_names(table.get(kind), f"runner.batching.{kind}")
    inputs = {
        name: _input_batching(p, raw, f"runner.batching.inputs.{name}")
        for name, raw in p.table(table, "runner.batching.inputs").items()
    }
    outputs = {}
    for name, raw in p.table(table, "runner.batching.outputs").items():
        where = f"runner.batching.outputs.{name}"
        spec = checks.table(raw, where)
        p.no_unknown_keys(spec, where, {"axis"})
        outputs[name] = p.integer(spec, f"{where}.axis", 0, 0, MAX_AXIS)
    made = [spec.lengths for spec in inputs.values() if spec.lengths]
    clash = set(made) & set(inputs) or ({m for m in made if made.count(m) > 1})
    if clash:
        raise ManifestError(p.path, f"{sorted(clash)[0]!r}: a lengths input is the server's "
                            "to make, once", "runner.batching.inputs")  # fmt: skip
    check = _batch_check(p, table)
    return BatchingSection(MappingProxyType(inputs), MappingProxyType(outputs), check)


def declared_batching(runner: Mapping[str, Any], folder: Path) -> BatchingSection | None:
    """The ``[runner.batching]`` of the checked manifest in ``folder``, from its ``[runner]``
    table (what a backend factory is handed), or ``None``."""
    return _batching(_Fields(folder / MANIFEST_NAME), runner)


def _batch_check(p: _Fields, table: Mapping[str, Any]) -> BatchCheckSpec | None:
    """``check = true``, or a table of :data:`CHECK_KEYS`."""
    raw = table.get("check", False)
    if raw is False:
        return None
    if raw is True:
        return BatchCheckSpec()
    where = "runner.batching.check"
    if not isinstance(raw, dict):
        raise ManifestError(p.path, "must be true, false or a table of rtol, atol, seed and "
                            "sample", where)  # fmt: skip
    spec = checks.table(raw, where)
    p.no_unknown_keys(spec, where, CHECK_KEYS)
    sample = p.string(spec, f"{where}.sample")
    if sample is not None:
        _check_relative(p.path, p.path.parent, sample, f"{where}.sample")
    return BatchCheckSpec(
        rtol=p.number(spec, f"{where}.rtol", BatchCheckSpec.rtol, 1.0),
        atol=p.number(spec, f"{where}.atol", BatchCheckSpec.atol, checks.MAX_NUMBER),
        seed=p.integer(spec, f"{where}.seed", 0, 0, checks.MAX_INTEGER),
        sample=None if sample is None else p.path.parent / sample,
    )


def _input_batching(p: _Fields, raw: Any, where: str) -> InputBatching:
    table = checks.table(raw, where)
    p.no_unknown_keys(table, where, INPUT_BATCHING_KEYS)
    shared = p.boolean(table, f"{where}.shared", False)
    ragged = p.string(table, f"{where}.ragged")
    if ragged is not None and ragged not in RAGGED:
        raise ManifestError(p.path, f"must be one of {', '.join(RAGGED)}", f"{where}.ragged")
    if shared and (ragged is not None or "axis" in table):
        raise ManifestError(p.path, "a shared input has no batch axis: no axis, no ragged",
                            f"{where}.shared")  # fmt: skip
    if ragged == "concat" and "axis" in table:
        raise ManifestError(p.path, "a concatenated input is flattened: no axis", f"{where}.axis")
    if ragged is None and ("pad_value" in table or "lengths" in table):
        raise ManifestError(p.path, "pad_value and lengths are for a ragged input",
                            f"{where}.ragged")  # fmt: skip
    axis = p.integer(table, f"{where}.axis", 0, 0, MAX_AXIS)
    ragged_axes = _ragged_axes(p, table, f"{where}.ragged_axes", ragged, axis)
    if ragged == "concat" and "lengths" not in table:
        raise ManifestError(p.path, "a concatenated input needs its lengths input, which "
                            "tells the runner where each request's elements end",
                            f"{where}.lengths")  # fmt: skip
    pad_value = table.get("pad_value", 0.0)
    return InputBatching(
        axis=axis,
        shared=shared,
        ragged=ragged,
        ragged_axes=ragged_axes,
        pad_value=checks.number(pad_value, f"{where}.pad_value", low=-checks.MAX_NUMBER),
        lengths=p.string(table, f"{where}.lengths"),
    )


def _ragged_axes(
    p: _Fields, table: Mapping[str, Any], where: str, ragged: str | None, axis: int
) -> tuple[int, ...]:
    """A padded input's ragged axes: required, distinct, none its batch axis."""
    if ragged != "pad":
        if "ragged_axes" in table:
            raise ManifestError(p.path, 'ragged_axes are for ragged = "pad"', where)
        return ()
    raw = table.get("ragged_axes")
    if not isinstance(raw, list) or not raw or len(raw) > MAX_AXIS:
        raise ManifestError(p.path, "a padded input names the axes that may differ between "
                            "requests: a list such as [1]", where)  # fmt: skip
    axes = tuple(checks.integer(a, where, low=0, high=MAX_AXIS) for a in raw)
    if len(set(axes)) != len(axes) or axis in axes:
        raise ManifestError(p.path, f"must be distinct axes other than the batch axis {axis}",
                            where)  # fmt: skip
    return axes


def _state(p: _Fields, raw: Any, where: str) -> StateSpec | ContextSpec:
    table = checks.table(raw, where)
    p.no_unknown_keys(table, where, STATE_KEYS)
    if ("output" in table) == ("from_input" in table):
        raise ManifestError(p.path, "a state is kept either from a model output (output) or "
                            "from the last samples of a request input (from_input)",
                            where)  # fmt: skip
    if "axis" in table and "output" in table:
        raise ManifestError(p.path, "axis is for a state kept from an input (from_input)",
                            f"{where}.axis")  # fmt: skip
    datatype = p.required_string(table, f"{where}.datatype")
    if datatype not in STATE_DATATYPES:
        raise ManifestError(p.path, f"must be one of {', '.join(STATE_DATATYPES)}",
                            f"{where}.datatype")  # fmt: skip
    shape = table.get("shape")
    if not isinstance(shape, list) or len(shape) > 16:
        raise ManifestError(p.path, "must be a list of at most 16 dimensions", f"{where}.shape")
    dims = tuple(checks.integer(d, f"{where}.shape", low=1, high=MAX_STATE_ELEMENTS) for d in shape)
    if math.prod(dims) > MAX_STATE_ELEMENTS:
        raise ManifestError(p.path, f"holds {math.prod(dims)} elements a sequence; at most "
                            f"{MAX_STATE_ELEMENTS}", f"{where}.shape")  # fmt: skip
    initial = checks.number(table.get("initial", 0.0), f"{where}.initial", low=-checks.MAX_NUMBER)
    if not _holds(datatype, initial):
        raise ManifestError(p.path, f"{initial:g} is not a {datatype} value", f"{where}.initial")
    name = p.required_string(table, f"{where}.input")
    if "output" in table:
        output = p.required_string(table, f"{where}.output")
        return StateSpec(name, output, datatype, dims, initial)
    if not dims:
        raise ManifestError(p.path, "a context holds samples along an axis: at least one "
                            "dimension", f"{where}.shape")  # fmt: skip
    return ContextSpec(
        input=name,
        source=p.required_string(table, f"{where}.from_input"),
        # The last axis unless told: audio [N, samples], features [N, channels, frames].
        axis=p.integer(table, f"{where}.axis", len(dims), 0, len(dims)),
        datatype=datatype,
        shape=dims,
        initial=initial,
    )


def _holds(datatype: str, value: float) -> bool:
    """Whether ``value`` is one of ``datatype``'s: exactly for integers and booleans,
    within range for floats (which round to their nearest)."""
    dtype = np.dtype("bool" if datatype == "BOOL" else datatype.lower().replace("fp", "float"))
    with np.errstate(all="ignore"):
        cast = np.array(value).astype(dtype)
    if dtype.kind == "f":
        return bool(np.isfinite(cast))
    return float(cast) == value


STATE_DATATYPES = ("BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32",
                   "UINT64", "FP16", "FP32", "FP64")  # fmt: skip
"""What a state may hold: any numeric v2 datatype."""


MAX_TENSOR_NAME = 256


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


def _formats(p: _Fields, table: Mapping[str, Any]) -> Mapping[str, str]:
    """``formats = { image = "FORMAT_NCHW" }``: the layout of image inputs, by input name."""
    formats = {}
    for name, value in p.table(table, "runner.formats").items():
        where = f"runner.formats.{tensor_name(name, 'runner.formats')}"
        if value not in FORMATS:
            raise ManifestError(p.path, f"must be one of {', '.join(FORMATS)}", where)
        formats[name] = value
    return MappingProxyType(formats)


def _label_files(p: _Fields, table: Mapping[str, Any], folder: Path) -> dict[str, str]:
    """``labels = { scores = "labels.txt" }``: a file in the plugin folder per output."""
    files = {}
    for name, value in p.table(table, "runner.labels").items():
        where = f"runner.labels.{tensor_name(name, 'runner.labels')}"
        relative = checks.relative_path(checks.text(value, where), where)
        _check_relative(p.path, folder, relative, where)
        if not (folder / relative).is_file():
            raise ManifestError(p.path, f"{relative!r} is not a file in the plugin folder", where)
        files[name] = relative
    return files


def _read_labels(p: _Fields, folder: Path, relative: str) -> tuple[str, ...]:
    """One label a line (UTF-8); the line's index is the class index it names."""
    where = "runner.labels"
    path = folder / relative
    if path.stat().st_size > MAX_LABELS_BYTES:
        raise ManifestError(p.path, f"{relative!r} is over {MAX_LABELS_BYTES} bytes", where)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(p.path, f"{relative!r} cannot be read: {exc}", where) from None
    return tuple(line.rstrip("\r") for line in text.removesuffix("\n").split("\n"))


def _load_mode(p: _Fields, table: Mapping[str, Any]) -> str | None:
    load = p.string(table, "runner.load")
    if load is not None and load not in LOADS:
        raise ManifestError(p.path, f"must be one of {', '.join(LOADS)}", "runner.load")
    return load


def _isolation(p: _Fields, table: Mapping[str, Any]) -> str:
    value = p.string(table, "runner.isolation") or "none"
    if value not in ISOLATIONS:
        raise ManifestError(p.path, f"must be one of {', '.join(ISOLATIONS)}", "runner.isolation")
    return value


def _devices(p: _Fields, table: Mapping[str, Any]) -> tuple[str, ...]:
    """``device = "cuda:1"`` or ``devices = ["cuda:0", "cuda:1"]`` (GPUs for runner processes)."""
    if "device" in table and "devices" in table:
        raise ManifestError(p.path, "give device or devices, not both", "runner.devices")
    if "device" in table:
        devices, where = [p.required_string(table, "runner.device")], "runner.device"
    else:
        devices, where = p.string_list(table, "runner.devices"), "runner.devices"
    for device in devices:
        if re.fullmatch(r"cuda:[0-9]{1,4}", device) is None:
            raise ManifestError(p.path, f"{device!r} is not a device such as 'cuda:0'", where)
    instances = table.get("instances", 1)
    if isinstance(instances, int) and len(devices) > instances:
        many = f"lists {len(devices)} devices for {instances} instance(s): one per instance at most"
        raise ManifestError(p.path, many, where)
    if devices and table.get("isolation", "none") != "process":
        raise ManifestError(
            p.path, 'sets a runner process\'s GPU: needs isolation = "process"', where
        )
    return tuple(devices)


def _provider_names(p: _Fields, table: Mapping[str, Any]) -> list[str]:
    """Provider names; an entry may be a table with a ``name`` and the provider's options."""
    items = table.get("providers", [])
    names = [
        i if isinstance(i, str) else i.get("name") if isinstance(i, dict) else None
        for i in (items if isinstance(items, list) and len(items) <= 64 else [None])
    ]
    if not all(isinstance(n, str) for n in names):
        raise ManifestError(
            p.path, "must be a list of names or tables with a 'name'", "runner.providers"
        )
    return [checks.text(n, f"runner.providers[{i}]", max_length=256) for i, n in enumerate(names)]


def _preferred_sizes(p: _Fields, table: Mapping[str, Any]) -> tuple[int, ...]:
    sizes = table.get("preferred_batch_sizes", [])
    if not isinstance(sizes, list) or len(sizes) > 1000:
        raise ManifestError(
            p.path, "must be a list of positive integers", "runner.preferred_batch_sizes"
        )
    where = "runner.preferred_batch_sizes"
    return tuple(sorted({checks.integer(n, where, low=1, high=MAX_BATCH_SIZE) for n in sizes}))


def _default_level(p: _Fields, table: Mapping[str, Any], levels: int) -> int | None:
    if "default_priority_level" not in table:
        return None
    return p.integer(table, "runner.default_priority_level", levels, 1, levels)


def _tenant_weights(p: _Fields, table: Mapping[str, Any]) -> Mapping[str, float]:
    weights = p.table(table, "runner.tenant_weights")
    return MappingProxyType(
        {
            checks.text(k, "runner.tenant_weights", max_length=256): checks.number(
                w, f"runner.tenant_weights.{k}", low=0.0, high=1e6, above=True
            )
            for k, w in weights.items()
        }
    )


def _route_section(p: _Fields, raw: Mapping[str, Any]) -> RouteSection:
    table = p.table(raw, "route")
    p.no_unknown_keys(table, "route", _ROUTE_KEYS)
    name = p.string(table, "route.name")
    if name is not None and not is_valid_name(name):
        raise ManifestError(p.path, f"{name!r} must match {NAME_PATTERN}", "route.name")
    rate_limit = None
    if "rate_limit" in table:
        try:
            rate_limit = RateLimit.parse(table["rate_limit"])
        except checks.ValueProblem as exc:
            field = f"route.rate_limit.{exc.field}" if exc.field else "route.rate_limit"
            raise ManifestError(p.path, exc.reason, field) from None
    return RouteSection(
        name=name,
        preprocess=p.refs(table, "route.preprocess"),
        postprocess=p.refs(table, "route.postprocess"),
        rate_limit=rate_limit,
        openai=_openai(p, table),
    )


def _openai(p: _Fields, table: Mapping[str, Any]) -> tuple[str, ...]:
    """``openai = "chat"`` or a list (``["chat", "completions"]``); embeddings stands alone."""
    value = table.get("openai")
    if isinstance(value, list):
        kinds = p.string_list(table, "route.openai")
    elif value is None or isinstance(value, str):
        kinds = [] if value is None else [value]
    else:
        raise ManifestError(p.path, "must be a name or a list of names", "route.openai")
    for kind in kinds:
        if kind not in OPENAI_KINDS:
            raise ManifestError(
                p.path, f"{kind!r} is not one of {', '.join(OPENAI_KINDS)}", "route.openai"
            )
    if "embeddings" in kinds and len(set(kinds)) > 1:
        raise ManifestError(p.path, "embeddings does not mix with text generation", "route.openai")
    return tuple(dict.fromkeys(kinds))


def _check_relative(path: Path, folder: Path, relative: str, key: str) -> None:
    # Lexically: symlinks are the registry's to judge (they may point into the models dir).
    target = Path(os.path.normpath(folder / relative))
    if Path(relative).is_absolute() or not target.is_relative_to(folder):
        raise ManifestError(path, f"{relative!r} must stay inside the plugin folder", key)


@dataclass(frozen=True)
class _Fields:
    """Typed field access over :mod:`plugserve.registry.checks`; problems name the
    dotted field."""

    path: Path

    def _get(self, table: Mapping[str, Any], dotted: str, required: bool) -> Any:
        key = dotted.rsplit(".", 1)[-1]
        if key not in table:
            if required:
                raise ManifestError(self.path, "is required", dotted)
            return None
        return table[key]

    def table(self, raw: Mapping[str, Any], key: str, required: bool = False) -> Mapping[str, Any]:
        value = self._get(raw, key, required)
        return {} if value is None else checks.table(value, key)

    def string(
        self, table: Mapping[str, Any], key: str, required: bool = False, multiline: bool = False
    ) -> str | None:
        value = self._get(table, key, required)
        if value is None:
            return None
        return checks.text(
            value, key, max_length=65_536 if multiline else 1024, multiline=multiline
        )

    def required_string(self, table: Mapping[str, Any], key: str) -> str:
        value = self.string(table, key, required=True)
        assert value is not None  # _get raised when it is missing
        return value

    def string_list(self, table: Mapping[str, Any], key: str) -> list[str]:
        value = self._get(table, key, False)
        return [] if value is None else checks.text_list(value, key, max_items=256)

    def integer(
        self, table: Mapping[str, Any], key: str, default: int, minimum: int, maximum: int
    ) -> int:
        value = self._get(table, key, False)
        return default if value is None else checks.integer(value, key, low=minimum, high=maximum)

    def boolean(self, table: Mapping[str, Any], key: str, default: bool) -> bool:
        value = self._get(table, key, False)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ManifestError(self.path, "must be true or false", key)
        return value

    def number(self, table: Mapping[str, Any], key: str, default: float, maximum: float) -> float:
        value = self._get(table, key, False)
        return default if value is None else checks.number(value, key, low=0.0, high=maximum)

    def refs(self, table: Mapping[str, Any], key: str) -> tuple[Ref, ...]:
        refs = []
        for text in self.string_list(table, key):
            try:
                refs.append(Ref.parse(text))
            except ValueError as exc:
                raise ManifestError(self.path, str(exc), key) from None
        return tuple(refs)

    def no_unknown_keys(self, table: Mapping[str, Any], name: str, known: Iterable[str]) -> None:
        checks.known_keys(table, name, known)
