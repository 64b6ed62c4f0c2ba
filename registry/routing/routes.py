"""The route table: which chain serves each route, rebuilt whole whenever anything changes.

Every runner declares a route (``[route] name`` of its highest eligible version,
else its own name) whose chain is its ``preprocess`` list, the runner and its
``postprocess`` list. ``routes.toml`` adds routes or overrides declared ones.
A runner version is eligible to serve a route only once its whole chain can be
built: every stage, pinned or floating, has a ready version. A ready runner
version whose chain is not whole waits (``RouteEntry.waiting`` says for what)
while the route stays on the highest version whose chain is whole; every
rebuild looks again, so the route moves as soon as the missing stage is ready.
The table is an immutable snapshot: a request resolves its chain with dict
lookups, and a rebuild replaces the whole snapshot in one assignment.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from plugserve.registry import checks
from plugserve.registry.errors import (
    NotLoaded,
    PlugserveError,
    RouteNotFound,
    RoutesFileError,
    Unavailable,
    VersionNotFound,
)
from plugserve.registry.execution.chain import Chain
from plugserve.registry.execution.components.base import LoadedPlugin
from plugserve.registry.execution.components.streaming import StreamingRunner
from plugserve.registry.execution.graph import Graph, Step
from plugserve.registry.ratelimit import RateLimit
from plugserve.registry.refs import NAME_PATTERN, Ref, is_valid_name
from plugserve.registry.routing.records import VersionRecord
from plugserve.registry.routing.rollout import Rollout, RolloutError, parse_rollout
from plugserve.registry.routing.variants import Candidate, WeightedChoice, salt_of, sticky_key
from plugserve.registry.versions import Version

ROUTES_FILE = "routes.toml"
_ROUTE_KEYS = {
    "runner", "preprocess", "postprocess", "sticky", "rate_limit", "steps", "outputs", "rollout",
}  # fmt: skip
_STEP_KEYS = {"runner", "processor", "route", "inputs", "outputs"}
STEP_KINDS = ("runner", "processor", "route")
MAX_TENSOR_NAME = 256
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}")  # fullmatch: no trailing newline
MAX_ROUTES = 10_000
MAX_CHAIN = 64


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
        checks.known_keys(entry, "", _ROUTE_KEYS)
        return _parse_route(name, entry, source)
    except RouteSpecError:
        raise
    except checks.ValueProblem as exc:
        raise RouteSpecError(
            f".{exc.field}: {exc.reason}" if exc.field else f": {exc.reason}"
        ) from None
    except Exception as exc:  # outside data: whatever a check missed is this entry's error
        raise RouteSpecError(f": invalid: {type(exc).__name__}: {exc}") from None


def _parse_route(name: str, entry: dict[str, Any], source: str) -> RouteSpec:
    runner = entry.get("runner")
    variants: tuple[Variant, ...] = ()
    steps: tuple[StepSpec, ...] = ()
    outputs: tuple[str, ...] = ()
    rollout: Rollout | None = None
    if "steps" in entry:
        if runner is not None:
            raise RouteSpecError(".runner: a graph route names its runners in its steps")
        steps, outputs = _graph(name, entry)
        runner_ref = next(s.ref for s in reversed(steps) if s.kind == "runner")
    elif "outputs" in entry:
        raise RouteSpecError(".outputs: only a graph route (steps) names its outputs")
    if "rollout" in entry:
        if steps:
            raise RouteSpecError(".rollout: a graph route has no canary of its own")
        try:
            rollout = parse_rollout(entry["rollout"], runner, source)
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
        try:
            runner_ref = Ref.parse(checks.text(runner, "", max_length=256))
        except ValueError as exc:
            raise RouteSpecError(f".runner: {exc}") from None
    else:
        raise RouteSpecError(
            ".runner: is required: a runner name, name@version, or a table of name@version = weight"
        )
    sticky = entry.get("sticky")
    if sticky is not None and (not isinstance(sticky, str) or not _HEADER_NAME.fullmatch(sticky)):
        raise RouteSpecError(".sticky: must be an HTTP header name, such as x-user-id")

    def refs(key: str) -> tuple[Ref, ...] | None:
        if key not in entry:
            return None
        value = entry[key]
        if (
            not isinstance(value, list)
            or len(value) > MAX_CHAIN
            or not all(isinstance(v, str) and len(v) <= 256 for v in value)
        ):
            raise RouteSpecError(f".{key}: must be a list of at most {MAX_CHAIN} plugin names")
        try:
            return tuple(Ref.parse(v) for v in value)
        except ValueError as exc:
            raise RouteSpecError(f".{key}: {exc}") from None

    try:
        rate_limit = RateLimit.parse(entry["rate_limit"]) if "rate_limit" in entry else None
    except checks.ValueProblem as exc:
        where = f".rate_limit.{exc.field}" if exc.field else ".rate_limit"
        raise RouteSpecError(f"{where}: {exc.reason}") from None
    return RouteSpec(
        name,
        runner_ref,
        refs("preprocess"),
        refs("postprocess"),
        source,
        rate_limit,
        variants,
        sticky.lower() if sticky else None,
        steps=steps,
        outputs=outputs,
        rollout=rollout,
    )


def _graph(name: str, entry: dict[str, Any]) -> tuple[tuple[StepSpec, ...], tuple[str, ...]]:
    """A graph route's ``steps`` and ``outputs``: every tensor given by one step only, read
    only by steps after it; at least one runner; outputs given by some step (default:
    every tensor no step reads)."""
    raw = entry["steps"]
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_CHAIN:
        raise RouteSpecError(f".steps: must be a list of 1 to {MAX_CHAIN} step tables")
    steps = tuple(_step(name, i, item) for i, item in enumerate(raw))
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
    if "outputs" in entry:
        outputs = tuple(_tensor_names(entry["outputs"], ".outputs"))
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


def _step(route: str, index: int, raw: Any) -> StepSpec:
    where = f".steps[{index}]"
    if not isinstance(raw, dict):
        raise RouteSpecError(f"{where}: must be a table")
    unknown = sorted(set(raw) - _STEP_KEYS)
    if unknown:
        raise RouteSpecError(f"{where}: unknown key(s) {unknown}; known: {sorted(_STEP_KEYS)}")
    kinds = [k for k in STEP_KINDS if k in raw]
    if len(kinds) != 1:
        raise RouteSpecError(f"{where}: names one of runner, processor or route")
    kind = kinds[0]
    target = raw[kind]
    if not isinstance(target, str) or len(target) > 256:
        raise RouteSpecError(f"{where}.{kind}: must be a name")
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
        _mapping(raw.get("inputs"), f"{where}.inputs"),
        _mapping(raw.get("outputs"), f"{where}.outputs"),
    )


def _mapping(raw: Any, where: str) -> tuple[tuple[str, str], ...]:
    """``{ stage_name = "route_tensor" }``, or a list of names the stage and the route share."""
    if isinstance(raw, list):
        pairs = [(n, n) for n in _tensor_names(raw, where)]
    elif isinstance(raw, dict) and 0 < len(raw) <= checks.MAX_ITEMS:
        pairs = [
            (checks.text(k, where[1:], max_length=MAX_TENSOR_NAME),
             checks.text(v, f"{where[1:]}.{checks.shown(k)}", max_length=MAX_TENSOR_NAME))
            for k, v in raw.items()
        ]  # fmt: skip
    else:
        raise RouteSpecError(
            f"{where}: is required: a table of stage tensor = route tensor, or a list of names"
        )
    if not pairs or any(not a or not b for a, b in pairs):
        raise RouteSpecError(f"{where}: names at least one tensor, none empty")
    return tuple(pairs)


def _tensor_names(raw: Any, where: str) -> list[str]:
    if not isinstance(raw, list) or len(raw) > checks.MAX_ITEMS:
        raise RouteSpecError(f"{where}: must be a list of tensor names")
    names = [checks.text(n, where[1:], max_length=MAX_TENSOR_NAME) for n in raw]
    if len(set(names)) < len(names):
        raise RouteSpecError(f"{where}: a tensor is named twice")
    return names


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
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= 1_000_000:
            raise RouteSpecError(f"{where}: the weight must be an integer from 0 to 1000000")
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


@dataclass(frozen=True)
class _Failure:
    """An error to raise for a route; a fresh exception each time, so tracebacks never pile up."""

    kind: type[PlugserveError]
    message: str
    waiting_for: tuple[str, ...] = ()
    """For a ready runner version whose chain is not whole: each stage that is missing."""
    demand: tuple[tuple[str, str, str], ...] = ()
    """Runner versions that load on their first request and would serve: a request
    loads them (:class:`NotLoaded`) and resolves again."""

    def error(self) -> PlugserveError:
        if self.demand:
            return NotLoaded(self.message, self.demand)
        return self.kind(self.message)


@dataclass(frozen=True)
class RouteEntry:
    spec: RouteSpec
    default: Chain | _Failure
    by_version: Mapping[str, Chain | _Failure]
    known_versions: Mapping[str, VersionRecord]
    choice: WeightedChoice[Chain] | None = None
    """For a weighted route: its variants ready on this server, by weight."""

    @property
    def waiting(self) -> dict[str, tuple[str, ...]]:
        """Ready runner versions not eligible for this route, by version: the stages of
        their chain that are not ready (missing, failed, loading or unloaded)."""
        return {
            version: target.waiting_for
            for version, target in self.by_version.items()
            if isinstance(target, _Failure) and target.waiting_for
        }

    @property
    def rate_limit(self) -> RateLimit | None:
        """The routes file's limit, else the serving runner manifest's ``[route] rate_limit``."""
        if self.spec.rate_limit is not None:
            return self.spec.rate_limit
        if isinstance(self.default, Chain):
            return self.default.runner.manifest.route.rate_limit
        return None

    def chain(
        self,
        version: str | None,
        headers: Mapping[str, str] | None = None,
        key: bytes | None = None,
    ) -> Chain:
        """The chain for a request with ``headers``; ``headers`` None (no request to place:
        metadata, readiness) gives a weighted route's primary variant, the one of highest
        weight ready here. ``key``: the request's own sticky key (its sequence), used when
        the route names no ``sticky`` header or the request does not send it."""
        if version is None:
            if self.choice and headers is not None:
                return self._pick(self.choice, headers, key)
            target = self.default
        else:
            target = (
                self.by_version.get(version)
                or self._alias(version)
                or self._version_failure(version)
            )
        if isinstance(target, _Failure):
            raise target.error()
        return target

    def _pick(
        self, choice: WeightedChoice[Chain], headers: Mapping[str, str], key: bytes | None
    ) -> Chain:
        """A variant for this request: by its sticky header, else by ``key``, else at random
        by weight.

        A variant whose circuit breaker is rejecting requests hands its share to
        the others (unless every variant is rejecting: then the breaker answers).
        """
        for candidate in choice.candidates:
            if candidate.target.runner.rejecting:  # rare: build the reduced choice only then
                rejecting = {c.label for c in choice.candidates if c.target.runner.rejecting}
                if len(rejecting) < len(choice.candidates):
                    choice = choice.without(rejecting)
                break
        return choice.pick(sticky_key(self.spec.sticky, headers) or key).target

    def _alias(self, version: str) -> Chain | None:
        """``N`` (ASCII digits) not found as such: the highest ready release ``N.x.y``, so
        that Triton's integer versions (``model_version="1"``) address semantic ones."""
        major = _major(version)
        if major is None:
            return None
        matching = [
            chain
            for chain in self.by_version.values()
            if isinstance(chain, Chain)
            and chain.runner.manifest.version.major == major
            and not chain.runner.manifest.version.prerelease
        ]
        return max(matching, key=lambda c: c.runner.manifest.version, default=None)

    def _version_failure(self, version: str) -> _Failure:
        spec = self.spec
        record = self.known_versions.get(version)
        major = _major(version)
        if record is None and major is not None:  # an alias: its highest known N.x.y says why
            known = [
                r
                for r in self.known_versions.values()
                if (v := r.sort_version) is not None and v.major == major and not v.prerelease
            ]
            record = max(known, key=lambda r: r.sort_version or Version(0, 0, 0), default=None)
        if spec.variants:
            if version not in {str(v.runner.version) for v in spec.variants}:
                names = ", ".join(v.label for v in spec.variants)
                return _Failure(VersionNotFound, f"route {spec.name!r} is split between {names}")
        elif spec.runner.version is not None and str(spec.runner.version) != version:
            return _Failure(VersionNotFound, f"route {spec.name!r} is pinned to {spec.runner}")
        if record is None:
            kind = Unavailable if spec.variants else VersionNotFound
            message = f"route {spec.name!r} has no runner version {version!r}"
            if major is None and not _is_version(version):  # Triton's words, which clients check
                message = (
                    f"failed to get model version from specified version string {version!r}: "
                    f"{message} (a version is MAJOR.MINOR.PATCH, or a major number N)"
                )
            return _Failure(kind, message)
        return _Failure(Unavailable, _not_ready(record), demand=_demand(record))

    @property
    def versions(self) -> list[str]:
        return list(self.by_version)

    def describe(self) -> dict[str, Any]:
        spec = self.spec
        out: dict[str, Any] = {
            "name": spec.name,
            "source": spec.source,
            "runner": spec.as_entry().get("runner", str(spec.runner)),
            "preprocess": None if spec.preprocess is None else [str(r) for r in spec.preprocess],
            "postprocess": None if spec.postprocess is None else [str(r) for r in spec.postprocess],
            "sticky": spec.sticky,
            "versions": self.versions,
            "rate_limit": None if self.rate_limit is None else vars(self.rate_limit),
            "waiting": [
                {"runner": f"{spec.runner.name}@{version}", "waiting_for": list(reasons)}
                for version, reasons in self.waiting.items()
            ],
        }
        if spec.revision is not None:
            out["revision"] = spec.revision
        if spec.steps:
            out["steps"] = [step.as_entry() for step in spec.steps]
            out["outputs"] = list(spec.outputs)
        if spec.variants:
            choice = self.choice
            out["variants"] = [
                {
                    "runner": v.label,
                    "weight": v.weight,
                    "ready": isinstance(self.by_version.get(str(v.runner.version)), Chain),
                    "share": round(choice.share(v.label), 6) if choice is not None else 0.0,
                }
                for v in spec.variants
            ]
        if spec.rollout is not None:
            out["rollout"] = spec.rollout.as_json()
        if isinstance(self.default, Chain):
            out["serving"] = self.default.describe()
            out["ready"] = True
        else:
            out["ready"] = False
            out["error"] = self.default.message
        return out


def _major(version: str) -> int | None:
    """The ``N`` of an integer version alias (ASCII digits, no leading zero), else ``None``."""
    plain = version == "0" or not version.startswith("0")
    if 0 < len(version) <= 18 and version.isascii() and version.isdigit() and plain:
        return int(version)
    return None


def _not_ready(record: VersionRecord) -> str:
    if record.state == "available":
        return f"{record.label} loads on its first request (load = on_demand)"
    detail = f": {record.last_error}" if record.last_error else ""
    return f"{record.label} is {record.state}{detail}"


def _demand(record: VersionRecord) -> tuple[tuple[str, str, str], ...]:
    """The version, if a request loads it: it loads on demand and is not loaded (or is
    loading, or being evicted: the request waits for that, then for its load)."""
    if record.state == "available" or (
        record.on_demand and record.current is None and record.state in ("loading", "draining")
    ):
        return (record.key,)
    return ()


@dataclass(frozen=True)
class RouteTable:
    """An immutable snapshot of every route and the chain that serves it."""

    entries: Mapping[str, RouteEntry] = field(default_factory=dict)
    errors: tuple[str, ...] = ()

    def resolve(
        self,
        route: str,
        version: str | None = None,
        headers: Mapping[str, str] | None = None,
        key: bytes | None = None,
    ) -> Chain:
        """The chain serving ``route`` (``version``: that runner version's). A weighted
        route places a request by its ``headers`` (the ``sticky`` one, else ``key``, else at
        random); without ``headers`` it gives its primary variant.

        Raises :class:`RouteNotFound`, :class:`VersionNotFound` or :class:`Unavailable`.
        """
        entry = self.entries.get(route)
        if entry is None:
            raise RouteNotFound(route)
        return entry.chain(version, headers, key)

    def describe(self) -> list[dict[str, Any]]:
        return [self.entries[name].describe() for name in sorted(self.entries)]

    def unserved(self) -> dict[str, str]:
        """Each route that cannot serve a request now, and why: its runner failed, is not
        installed or waits for a stage. One whose runner loads on its first request serves."""
        return {
            name: entry.default.message
            for name, entry in sorted(self.entries.items())
            if isinstance(entry.default, _Failure) and not entry.default.demand
        }

    def waiting(self) -> dict[tuple[str, str], tuple[str, ...]]:
        """What each waiting runner version (``name@version``) of each route waits for."""
        return {
            (route, f"{entry.spec.runner.name}@{version}"): reasons
            for route, entry in self.entries.items()
            for version, reasons in entry.waiting.items()
        }


class _Index:
    """Ready instances and known records by ``(type, name)``, highest version first."""

    def __init__(self, records: Iterable[VersionRecord]) -> None:
        self.ready: dict[tuple[str, str], list[LoadedPlugin]] = defaultdict(list)
        self.known: dict[tuple[str, str], dict[str, VersionRecord]] = defaultdict(dict)
        for record in records:
            self.known[(record.type, record.name)][record.version] = record
            if record.state == "ready" and record.current is not None:
                self.ready[(record.type, record.name)].append(record.current)
        for instances in self.ready.values():
            instances.sort(key=lambda p: p.manifest.version, reverse=True)

    def pick(self, kind: str, ref: Ref) -> LoadedPlugin | _Failure:
        instances = self.ready.get((kind, ref.name), [])
        for instance in instances:
            if ref.version is None or instance.manifest.version == ref.version:
                return instance
        known = self.known.get((kind, ref.name), {})
        if ref.version is not None and str(ref.version) in known:
            record = known[str(ref.version)]
            return _Failure(Unavailable, _not_ready(record), demand=_demand(record))
        available = [r for r in known.values() if _demand(r)]
        if ref.version is None and available:  # none ready: the highest that loads on demand
            record = max(available, key=lambda r: r.sort_version or Version(0, 0, 0))
            return _Failure(Unavailable, _not_ready(record), demand=_demand(record))
        if not known:
            return _Failure(Unavailable, f"{kind} {ref} is not installed")
        states = "; ".join(
            f"{v} {r.state}" + (f": {r.last_error}" if r.last_error else "")
            for v, r in sorted(known.items())
        )
        wanted = f"version {ref.version}" if ref.version else "ready version"
        return _Failure(Unavailable, f"{kind} {ref.name} has no {wanted} ({states})")


def build_route_table(
    records: Iterable[VersionRecord], file_routes: Mapping[str, RouteSpec]
) -> RouteTable:
    """Compute the table from the registry's records and the parsed routes file."""
    index = _Index(records)
    specs: dict[str, RouteSpec] = {}
    errors: list[str] = []
    for kind, name in sorted(index.known):
        if kind != "runner":
            continue
        instances = index.ready.get((kind, name))
        route = _declared_route(instances, index) if instances else name
        if route in specs:
            errors.append(
                f"route {route!r} is declared by runner {name} and by runner "
                f"{specs[route].runner.name}; {specs[route].runner.name} serves it"
            )
            continue
        specs[route] = RouteSpec(route, Ref(name), source=f"runner/{name}")
    specs.update(file_routes)
    entries = {name: _entry(spec, index) for name, spec in specs.items() if not spec.steps}
    graphs = {name: spec for name, spec in specs.items() if spec.steps}
    for name in graphs:
        _build_graph(name, graphs, index, entries, ())
    return RouteTable({name: entries[name] for name in specs}, tuple(errors))


def _build_graph(
    name: str,
    graphs: Mapping[str, RouteSpec],
    index: _Index,
    entries: dict[str, RouteEntry],
    calling: tuple[str, ...],
) -> None:
    """``name``'s entry, once every graph route its steps call has one (a loop of routes
    calling each other fails each route in it)."""
    if name in entries:
        return
    spec = graphs[name]
    for step in spec.steps:
        called = step.target
        if step.kind != "route" or called not in graphs or called in entries:
            continue
        if called in calling or called == name:
            loop = " -> ".join((*calling, name, called))
            failure = _Failure(Unavailable, f"route {name!r}: routes call each other: {loop}")
            entries[name] = RouteEntry(spec, failure, {}, {})
            return
        _build_graph(called, graphs, index, entries, (*calling, name))
    entries[name] = _graph_entry(spec, index, entries)


def _graph_entry(spec: RouteSpec, index: _Index, entries: Mapping[str, RouteEntry]) -> RouteEntry:
    """A graph route serves only once every step (and processor around it) is ready: until
    then its failure names each one it waits for."""
    missing: list[str] = []
    demand: list[tuple[str, str, str]] = []
    steps: list[Step] = []
    runner: LoadedPlugin | None = None
    for step in spec.steps:
        target = _step_target(step, index, entries)
        if isinstance(target, _Failure):
            missing.append(target.message)
            demand.extend(target.demand)
            continue
        if step.kind == "runner":
            assert isinstance(target, LoadedPlugin)
            runner = target
        steps.append(Step(target, step.inputs, step.outputs))
    pre, post, absent = _stages(spec.preprocess or (), spec.postprocess or (), index)
    missing.extend(absent)
    known = index.known.get(("runner", spec.runner.name), {})
    if missing or runner is None:
        message = f"route {spec.name!r} waits for its graph: {'; '.join(missing)}"
        whole = len(demand) == len(missing)  # loading what loads on demand makes it whole
        failure = _Failure(Unavailable, message, tuple(missing), tuple(demand) if whole else ())
        return RouteEntry(spec, failure, {}, known)
    graph = Graph(spec.name, pre, runner, post, steps=tuple(steps), answers=spec.outputs)
    return RouteEntry(spec, graph, {runner.version: graph}, known)


def _step_target(
    step: StepSpec, index: _Index, entries: Mapping[str, RouteEntry]
) -> LoadedPlugin | Chain | _Failure:
    if step.kind == "route":
        entry = entries.get(step.target)
        if entry is None:
            return _Failure(Unavailable, f"route {step.target} does not exist")
        if isinstance(entry.default, _Failure):
            called = entry.default
            return _Failure(Unavailable, f"route {step.target} is not ready", demand=called.demand)
        if entry.default.streaming:
            return _Failure(
                Unavailable, f"route {step.target} streams: a graph's steps answer once"
            )
        return entry.default
    if step.kind == "runner":
        picked = index.pick("runner", step.ref)
        if isinstance(picked, StreamingRunner):
            return _Failure(
                Unavailable, f"runner {step.target} streams: a graph's steps answer once"
            )
        return picked
    picked = index.pick("preprocessor", step.ref)
    if isinstance(picked, _Failure) and (("postprocessor", step.ref.name) in index.known):
        return index.pick("postprocessor", step.ref)
    return picked


def _entry(spec: RouteSpec, index: _Index) -> RouteEntry:
    if spec.variants:
        return _weighted_entry(spec, index)
    runners = [
        r
        for r in index.ready.get(("runner", spec.runner.name), [])
        if spec.runner.version is None or r.manifest.version == spec.runner.version
    ]
    by_version = {r.version: _chain(spec, r, index) for r in runners}  # highest first
    default: Chain | _Failure
    if runners:
        # The highest eligible version; with none, the highest one's failure says what it lacks.
        eligible = (c for c in by_version.values() if isinstance(c, Chain))
        default = next(eligible, by_version[runners[0].version])
    else:
        picked = index.pick("runner", spec.runner)
        assert isinstance(picked, _Failure)
        default = _Failure(
            Unavailable, f"route {spec.name!r}: {picked.message}", demand=picked.demand
        )
    known = index.known.get(("runner", spec.runner.name), {})
    return RouteEntry(spec, default, by_version, known)


def _weighted_entry(spec: RouteSpec, index: _Index) -> RouteEntry:
    """Only variants whose whole chain is ready here take traffic; the rest hand their share on.

    Zero-weight variants take none, unless no weighted variant is ready here. A
    ready variant whose chain is not whole keeps its failure in ``by_version``
    (what it waits for).
    """
    by_version: dict[str, Chain | _Failure] = {}
    candidates: list[Candidate[Chain]] = []
    failures: list[str] = []
    demand: tuple[tuple[str, str, str], ...] = ()
    for variant in spec.variants:
        picked = index.pick("runner", variant.runner)
        chain = picked if isinstance(picked, _Failure) else _chain(spec, picked, index)
        if isinstance(chain, _Failure):
            failures.append(chain.message)
            if variant.weight and not demand:  # the weightiest that loads on demand
                demand = chain.demand
            if chain.waiting_for:
                by_version[str(variant.runner.version)] = chain
            continue
        by_version[chain.runner.version] = chain
        candidates.append(Candidate(variant.label, variant.weight, chain, salt_of(variant.label)))
    choice = WeightedChoice(candidates)
    if not choice and candidates:
        # No weighted variant is ready here: rather than fail, the route stays on
        # the zero-weight versions it has (a rollout at 100 % to a version this
        # replica lacks leaves it serving what it had), evenly.
        choice = WeightedChoice([replace(c, weight=1) for c in candidates])
    default: Chain | _Failure
    if choice:
        default = choice.candidates[0].target
    else:
        why = "; ".join(failures)
        default = _Failure(
            Unavailable, f"route {spec.name!r}: no variant is ready ({why})", demand=demand
        )
    known = index.known.get(("runner", spec.runner.name), {})
    return RouteEntry(spec, default, by_version, known, choice)


def _chain(spec: RouteSpec, runner: LoadedPlugin, index: _Index) -> Chain | _Failure:
    """The runner's chain on ``spec``'s route, or, when some stage is not ready, a
    failure naming every stage the runner version waits for."""
    declared = runner.manifest.route
    pre_refs = declared.preprocess if spec.preprocess is None else spec.preprocess
    post_refs = declared.postprocess if spec.postprocess is None else spec.postprocess
    pre, post, missing = _stages(pre_refs, post_refs, index)
    if missing:
        label = f"{runner.manifest.name}@{runner.version}"
        message = f"route {spec.name!r}: {label} waits for its chain: {'; '.join(missing)}"
        return _Failure(Unavailable, message, tuple(missing))
    return Chain(spec.name, pre, runner, post)


def _stages(
    pre_refs: Iterable[Ref], post_refs: Iterable[Ref], index: _Index
) -> tuple[tuple[LoadedPlugin, ...], tuple[LoadedPlugin, ...], list[str]]:
    """The ready instances for a chain's processors, and why each stage that has none lacks it."""
    missing: list[str] = []
    stages: list[list[LoadedPlugin]] = [[], []]
    for slot, kind, refs in ((0, "preprocessor", pre_refs), (1, "postprocessor", post_refs)):
        for ref in refs:
            picked = index.pick(kind, ref)
            if isinstance(picked, _Failure):
                missing.append(picked.message)
            else:
                stages[slot].append(picked)
    return tuple(stages[0]), tuple(stages[1]), missing


def _declared_route(instances: list[LoadedPlugin], index: _Index) -> str:
    """The route a runner declares: that of its highest version whose own chain is whole,
    else (none is eligible yet) that of its highest ready version."""
    for instance in instances:
        declared = instance.manifest.route
        if not _stages(declared.preprocess, declared.postprocess, index)[2]:
            return instance.manifest.route_name
    return instances[0].manifest.route_name


def _is_version(text: str) -> bool:
    """Whether ``text`` is a semantic version (known here or not)."""
    try:
        Version.parse(text)
    except ValueError:
        return False
    return True
