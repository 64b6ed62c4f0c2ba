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

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from plugserve.registry.errors import (
    NotLoaded,
    PlugserveError,
    RouteNotFound,
    Unavailable,
    VersionNotFound,
)
from plugserve.registry.execution.chain import Chain
from plugserve.registry.execution.components.base import LoadedPlugin
from plugserve.registry.execution.components.streaming import StreamingRunner
from plugserve.registry.execution.graph import Graph, Step
from plugserve.registry.ratelimit import RateLimit
from plugserve.registry.refs import Ref
from plugserve.registry.routing.records import VersionRecord
from plugserve.registry.routing.route_specs import RouteSpec, StepSpec
from plugserve.registry.routing.variants import Candidate, WeightedChoice, salt_of, sticky_key
from plugserve.registry.versions import Version


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
