"""Route entries: what a route is made of (:class:`RouteSpec`), read from ``routes.toml``,
the admin API or etcd, every value checked (types, bounds, names, nesting) before the route
table (``routes.py``) is built from them."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from plugserve.registry import checks
from plugserve.registry.errors import RoutesFileError
from plugserve.registry.ratelimit import MAX_BURST, MAX_RPS, MIN_RPS, RateLimit
from plugserve.registry.refs import NAME_PATTERN, Ref, is_valid_name
from plugserve.registry.routing.rollout import Rollout, RolloutError, parse_rollout

ROUTES_FILE = "routes.toml"
STEP_KINDS = ("runner", "processor", "route")
MAX_TENSOR_NAME = 256
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}")  # fullmatch: no trailing newline
MAX_ROUTES = 10_000
MAX_CHAIN = 64
MAX_WEIGHT = 1_000_000


class RouteSpecError(ValueError):
    """A route entry that is not valid; the message starts at the entry (``.runner: ...``)."""


@dataclass(frozen=True)
class Variant:
    """One runner version of a weighted route and its weight."""

    runner: Ref
    weight: int

    @property
    def label(self) -> str:
        return str(self.runner)


@dataclass(frozen=True)
class StepSpec:
    """One step of a graph route: a runner, a processor or another route, and the names
    its tensors take (``inputs``: its input <- a route tensor; ``outputs``: its output ->
    a route tensor)."""

    kind: str
    target: str
    """``name`` or ``name@version`` (a runner, a processor), or a route's name."""
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]

    @property
    def ref(self) -> Ref:
        return Ref.parse(self.target)

    def as_entry(self) -> dict[str, Any]:
        return {self.kind: self.target, "inputs": dict(self.inputs), "outputs": dict(self.outputs)}


@dataclass(frozen=True)
class RouteSpec:
    """What a route is made of. ``None`` chains come from the runner version's manifest.

    A weighted route has ``variants`` (pinned versions of one runner, named by
    ``runner``); a plain one serves ``runner``, floating or pinned.
    """

    name: str
    runner: Ref
    preprocess: tuple[Ref, ...] | None = None
    postprocess: tuple[Ref, ...] | None = None
    source: str = ROUTES_FILE
    rate_limit: RateLimit | None = None
    variants: tuple[Variant, ...] = ()
    sticky: str | None = None
    revision: int | None = None
    """For a runtime entry (admin API or etcd): the revision it was written at."""
    steps: tuple[StepSpec, ...] = ()
    """A graph route's steps (``graph.py``); ``runner`` is then its last runner step's."""
    outputs: tuple[str, ...] = ()
    """The route tensors a graph answers."""
    rollout: Rollout | None = None
    """A canary's rollout (``rollout.py``): ``variants`` are then its stable and canary
    versions, weighted as its status says."""

    def as_entry(self) -> dict[str, Any]:
        """The entry in the shape ``routes.toml`` and ``PUT /admin/routes/{route}`` take."""
        out: dict[str, Any]
        if self.steps:
            out = {"steps": [step.as_entry() for step in self.steps], "outputs": list(self.outputs)}
        else:
            out = {
                "runner": {v.label: v.weight for v in self.variants}
                if self.variants
                else str(self.runner)
            }
        for key, refs in (("preprocess", self.preprocess), ("postprocess", self.postprocess)):
            if refs is not None:
                out[key] = [str(r) for r in refs]
        if self.sticky is not None:
            out["sticky"] = self.sticky
        if self.rollout is not None:
            out["rollout"] = self.rollout.as_json()
        if self.rate_limit is not None:
            out["rate_limit"] = {"rps": self.rate_limit.rps, "burst": self.rate_limit.burst}
        return out


def with_rollout(spec: RouteSpec, rollout: Rollout) -> RouteSpec:
    """``spec`` with ``rollout`` in place of its own, weighted as its status says."""
    return replace(spec, rollout=rollout, variants=_variants(rollout.weights()))


def load_routes_file(path: Path) -> dict[str, RouteSpec]:
    """Parse ``routes.toml``; an absent file is no routes. Raises :class:`RoutesFileError`.

    In an entry, a missing ``preprocess`` or ``postprocess`` keeps the runner
    manifest's list; an empty list means none.
    """
    try:
        raw = checks.read_toml(path)
    except FileNotFoundError:
        return {}
    except checks.ValueProblem as exc:
        raise RoutesFileError(f"{path}: {exc}", file=str(path)) from None
    unknown = sorted(set(raw) - {"routes"})
    if unknown:
        raise RoutesFileError(f"{path}: unknown table(s) {unknown}; known: routes", file=str(path))
    routes = raw.get("routes", {})
    if not isinstance(routes, dict) or len(routes) > MAX_ROUTES:
        raise RoutesFileError(
            f"{path}: routes must be a table of at most {MAX_ROUTES} routes", file=str(path)
        )
    specs = {}
    for name, entry in routes.items():
        try:
            specs[name] = parse_route(name, entry, ROUTES_FILE)
            if specs[name].rollout is not None:
                raise RouteSpecError(
                    ".rollout: a rollout is a runtime entry (PUT /admin/routes/{route}): "
                    "the server writes its steps where runtime routes live"
                )
        except RouteSpecError as exc:
            shown = name if is_valid_name(name) else checks.shown(name)
            raise RoutesFileError(
                f"{path}: routes.{shown}{exc}", file=str(path), route=shown
            ) from None
    return specs


# -- an entry, declared ---------------------------------------------------------------------

PluginText = Annotated[str, Field(max_length=256)]
"""A plugin's ``name`` or ``name@version`` (a route's name, for a route step)."""
TensorName = Annotated[str, Field(min_length=1, max_length=MAX_TENSOR_NAME)]
TensorNames = Annotated[list[TensorName], Field(min_length=1, max_length=checks.MAX_ITEMS)]
TensorMap = Annotated[
    dict[TensorName, TensorName], Field(min_length=1, max_length=checks.MAX_ITEMS)
]


Weight = Annotated[Any, WithJsonSchema({"type": "integer", "minimum": 0, "maximum": MAX_WEIGHT})]
"""A variant's weight: checked with its variant's name (``_variants``)."""
Weights = Annotated[dict[str, Weight], Field(max_length=MAX_CHAIN)]
"""Pinned versions of one runner (``name@version``) and their weights."""


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, defer_build=True)

    @field_validator("*", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        """Every text free of control characters (a name reads the same in every log)."""
        for where, text in _texts(value):
            checks.text(text, where, max_length=len(text))
        return value


class StepEntry(_Table):
    """One step of a graph route (``[[routes.<name>.steps]]``): exactly one of ``runner``,
    ``processor`` or ``route``, and the names its tensors take."""

    runner: PluginText | None = None
    processor: PluginText | None = None
    route: PluginText | None = None
    """Another route, run whole as a step."""
    inputs: TensorMap | TensorNames = Field(union_mode="left_to_right")
    """``{ step input = "route tensor" }``, or names the step and the route share."""
    outputs: TensorMap | TensorNames = Field(union_mode="left_to_right")
    """``{ step output = "route tensor" }``, or names the step and the route share."""


class RateLimitEntry(_Table):
    """``{ rps = <per second>, burst = <requests> }``: a token bucket for the route."""

    rps: Annotated[float, Field(ge=MIN_RPS, le=MAX_RPS, allow_inf_nan=False)]
    burst: Annotated[int, Field(ge=1, le=MAX_BURST)] | None = None
    """Default: ``rps`` rounded down, at least 1."""


class RouteEntryBody(_Table):
    """A route entry: ``[routes.<name>]`` in ``routes.toml``, the body of
    ``PUT /admin/routes/{route}``, a runtime route in etcd."""

    runner: PluginText | Weights | None = Field(default=None, union_mode="left_to_right")
    """A runner (``name``, floating, or ``name@version``), or pinned versions of one runner
    and their weights (``{ "iris@1.0.0" = 90, "iris@2.0.0" = 10 }``)."""
    preprocess: Annotated[list[PluginText], Field(max_length=MAX_CHAIN)] | None = None
    """The chain's preprocessors, in order (absent: the runner manifest's; ``[]``: none)."""
    postprocess: Annotated[list[PluginText], Field(max_length=MAX_CHAIN)] | None = None
    """The chain's postprocessors, in order (absent: the runner manifest's; ``[]``: none)."""
    sticky: Annotated[str, Field(pattern=f"^{_HEADER_NAME.pattern}$")] | None = None
    """A weighted route's header whose value keeps a client on one variant."""
    rate_limit: RateLimitEntry | None = None
    steps: Annotated[list[StepEntry], Field(min_length=1, max_length=MAX_CHAIN)] | None = None
    """A graph route's steps, run in waves as their inputs are ready."""
    outputs: Annotated[list[TensorName], Field(max_length=checks.MAX_ITEMS)] | None = None
    """The route tensors a graph answers (default: those no step reads)."""
    rollout: dict[str, Any] | None = None
    """A canary's rollout (runtime entries only): its stable and canary versions, steps and
    gates (``rollout.py``)."""


def _texts(value: Any) -> list[tuple[str, str]]:
    """The texts of a value and where each is (a table's by its key): itself, a list's
    items, a table's keys and values."""
    if isinstance(value, str):
        return [("", value)]
    if isinstance(value, list):
        return [("", item) for item in value if isinstance(item, str)]
    if isinstance(value, dict):
        return [
            (checks.shown(key), text)
            for key, item in value.items()
            for text in (key, item)
            if isinstance(text, str)
        ]
    return []


def route_entry_schema(ref_template: str = "#/$defs/{model}") -> dict[str, Any]:
    """The JSON Schema of a route entry (``PUT /admin/routes/{route}``'s body)."""
    checks.with_docstrings(RouteEntryBody)
    return RouteEntryBody.model_json_schema(ref_template=ref_template)


def routes_file_schema() -> dict[str, Any]:
    """The JSON Schema of ``routes.toml``: a ``[routes]`` table of entries, by route name."""
    entry = route_entry_schema()
    defs = entry.pop("$defs", {})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "routes.toml",
        "description": "plugserve's routes file: routes besides the plugins' own, or over them",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "routes": {
                "type": "object",
                "maxProperties": MAX_ROUTES,
                "propertyNames": {"pattern": f"^{NAME_PATTERN}$"},
                "additionalProperties": {"$ref": "#/$defs/RouteEntryBody"},
            }
        },
        "$defs": {**defs, "RouteEntryBody": entry},
    }


# -- an entry, read --------------------------------------------------------------------------


def parse_route(name: str, entry: Any, source: str) -> RouteSpec:
    """One route entry, from ``routes.toml``, the admin API or etcd.

    Every value is checked (types, bounds, names, nesting); raises
    :class:`RouteSpecError` and nothing else, whatever ``entry`` holds.
    """
    if not isinstance(name, str) or not is_valid_name(name):
        raise RouteSpecError(f": the route name must match {NAME_PATTERN}")
    try:
        checks.table(entry, "")
        checks.shallow(entry)
        declared = RouteEntryBody.model_validate(entry)
        return _parse_route(name, declared, source)
    except RouteSpecError:
        raise
    except pydantic.ValidationError as exc:
        raise RouteSpecError(_at_entry(checks.schema_problems(exc, RouteEntryBody)[0])) from None
    except checks.ValueProblem as exc:
        raise RouteSpecError(
            f".{exc.field}: {exc.reason}" if exc.field else f": {exc.reason}"
        ) from None
    except Exception as exc:  # outside data: whatever a check missed is this entry's error
        raise RouteSpecError(f": invalid: {type(exc).__name__}: {exc}") from None


def _at_entry(problem: str) -> str:
    """A problem as the entry's: ``.field: ...`` (the caller puts the entry before it)."""
    field, _, rest = problem.partition(" must ")
    if rest and ":" not in field and " " not in field:
        return f".{field}: must {rest}"
    return f".{problem}" if not problem.startswith(":") else problem


def _parse_route(name: str, entry: RouteEntryBody, source: str) -> RouteSpec:
    runner = entry.runner
    variants: tuple[Variant, ...] = ()
    steps: tuple[StepSpec, ...] = ()
    outputs: tuple[str, ...] = ()
    rollout: Rollout | None = None
    if entry.steps is not None:
        if runner is not None:
            raise RouteSpecError(".runner: a graph route names its runners in its steps")
        steps, outputs = _graph(name, entry.steps, entry.outputs)
        runner_ref = next(s.ref for s in reversed(steps) if s.kind == "runner")
    elif entry.outputs is not None:
        raise RouteSpecError(".outputs: only a graph route (steps) names its outputs")
    if entry.rollout is not None:
        if steps:
            raise RouteSpecError(".rollout: a graph route has no canary of its own")
        try:
            rollout = parse_rollout(entry.rollout, runner, source)
        except RolloutError as exc:
            raise RouteSpecError(f".rollout{exc}") from None
        named = set(runner) if isinstance(runner, dict) else {runner} if runner else set()
        versions = {str(rollout.stable), str(rollout.canary)}
        if not named <= versions | {rollout.stable.name}:
            raise RouteSpecError(
                f".runner: a rollout's route serves its stable and canary versions "
                f"({sorted(versions)}); the rollout sets their weights"
            )
        variants = _variants(rollout.weights())
        runner_ref = Ref(rollout.stable.name)
    elif steps:
        pass
    elif isinstance(runner, dict):
        variants = _variants(runner)
        runner_ref = Ref(variants[0].runner.name)
    elif isinstance(runner, str):
        runner_ref = _ref(runner, ".runner")
    else:
        raise RouteSpecError(
            ".runner: is required: a runner name, name@version, or a table of name@version = weight"
        )
    limit = entry.rate_limit
    return RouteSpec(
        name,
        runner_ref,
        None
        if entry.preprocess is None
        else tuple(_ref(r, ".preprocess") for r in entry.preprocess),
        None
        if entry.postprocess is None
        else tuple(_ref(r, ".postprocess") for r in entry.postprocess),
        source,
        None if limit is None else RateLimit(limit.rps, limit.burst or max(1, int(limit.rps))),
        variants,
        entry.sticky.lower() if entry.sticky else None,
        steps=steps,
        outputs=outputs,
        rollout=rollout,
    )


def _refs(texts: list[str] | None, where: str) -> tuple[Ref, ...] | None:
    return None if texts is None else tuple(_ref(text, where) for text in texts)


def _ref(text: str, where: str) -> Ref:
    try:
        return Ref.parse(text)
    except ValueError as exc:
        raise RouteSpecError(f"{where}: {exc}") from None


def _graph(
    name: str, entries: list[StepEntry], named: list[str] | None
) -> tuple[tuple[StepSpec, ...], tuple[str, ...]]:
    """A graph route's ``steps`` and ``outputs``: every tensor given by one step only, read
    only by steps after it; at least one runner; outputs given by some step (default:
    every tensor no step reads)."""
    steps = tuple(_step(name, i, entry) for i, entry in enumerate(entries))
    given: dict[str, int] = {}
    for i, step in enumerate(steps):
        for _, tensor in step.outputs:
            if tensor in given:
                raise RouteSpecError(
                    f".steps[{i}].outputs: tensor {tensor!r} is given by step {given[tensor]} too"
                )
            given[tensor] = i
    for i, step in enumerate(steps):
        for _, tensor in step.inputs:
            if given.get(tensor, -1) >= i:
                raise RouteSpecError(
                    f".steps[{i}].inputs: tensor {tensor!r} is given by step {given[tensor]}: "
                    "a step reads only tensors of the request and of the steps before it"
                )
    if not any(step.kind == "runner" for step in steps):
        raise RouteSpecError(".steps: a graph route runs at least one runner")
    read = {tensor for step in steps for _, tensor in step.inputs}
    if named is not None:
        if len(set(named)) < len(named):
            raise RouteSpecError(".outputs: a tensor is named twice")
        outputs = tuple(named)
        unknown = [t for t in outputs if t not in given]
        if unknown or not outputs:
            raise RouteSpecError(
                f".outputs: {unknown[0]!r} is given by no step" if unknown else
                ".outputs: names at least one tensor"
            )  # fmt: skip
    else:
        outputs = tuple(t for t in given if t not in read)
        if not outputs:
            raise RouteSpecError(".outputs: every tensor is read by a step: name the outputs")
    return steps, outputs


def _step(route: str, index: int, entry: StepEntry) -> StepSpec:
    where = f".steps[{index}]"
    kinds = [k for k in STEP_KINDS if getattr(entry, k) is not None]
    if len(kinds) != 1:
        raise RouteSpecError(f"{where}: names one of runner, processor or route")
    kind = kinds[0]
    target: str = getattr(entry, kind)
    try:
        if kind == "route":
            if not is_valid_name(target):
                raise ValueError(f"{target!r}: a route name must match {NAME_PATTERN}")
            if target == route:
                raise ValueError("a route cannot call itself")
        else:
            Ref.parse(target)
    except ValueError as exc:
        raise RouteSpecError(f"{where}.{kind}: {exc}") from None
    return StepSpec(
        kind,
        target,
        _mapping(entry.inputs, f"{where}.inputs"),
        _mapping(entry.outputs, f"{where}.outputs"),
    )


def _mapping(raw: dict[str, str] | list[str], where: str) -> tuple[tuple[str, str], ...]:
    """``{ stage_name = "route_tensor" }``, or a list of names the stage and the route share."""
    if isinstance(raw, dict):
        return tuple(raw.items())
    if len(set(raw)) < len(raw):
        raise RouteSpecError(f"{where}: a tensor is named twice")
    return tuple((n, n) for n in raw)


def _variants(table: dict[Any, Any]) -> tuple[Variant, ...]:
    """``{ "iris@1.0.0" = 90, "iris@2.0.0" = 10 }``: pinned versions of one runner."""
    if not table:
        raise RouteSpecError(".runner: a weighted runner table needs at least one name@version")
    if len(table) > MAX_CHAIN:
        raise RouteSpecError(f".runner: a weighted runner table has at most {MAX_CHAIN} entries")
    variants = []
    for text, weight in table.items():
        where = f".runner.{checks.shown(text)}"
        try:
            ref = Ref.parse(checks.text(text, "", max_length=256))
        except ValueError as exc:
            raise RouteSpecError(f"{where}: {exc}") from None
        if ref.version is None:
            raise RouteSpecError(f"{where}: a weighted variant names a version (name@1.2.3)")
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= MAX_WEIGHT:
            raise RouteSpecError(f"{where}: the weight must be an integer from 0 to {MAX_WEIGHT}")
        variants.append(Variant(ref, weight))
    names = sorted({v.runner.name for v in variants})
    if len(names) > 1:
        raise RouteSpecError(
            f".runner: weights split one runner's versions; this table names {names}"
        )
    if len({v.runner.version for v in variants}) < len(variants):
        raise RouteSpecError(".runner: a version is named twice")
    if not any(v.weight for v in variants):
        raise RouteSpecError(".runner: at least one weight must be above 0")
    # Highest weight first (then highest version): the first ready one is the default.
    return tuple(sorted(variants, key=lambda v: (v.weight, v.runner.version), reverse=True))


if __name__ == "__main__":
    import json
    import sys

    json.dump(routes_file_schema(), sys.stdout, indent=2)
    sys.stdout.write("\n")
