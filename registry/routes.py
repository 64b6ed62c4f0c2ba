"""The route table: which chain serves each route, rebuilt whole whenever anything changes.

Every runner declares a route (``[route] name`` of its highest ready version,
else its own name) whose chain is its ``preprocess`` list, the runner and its
``postprocess`` list. ``routes.toml`` adds routes or overrides declared ones.
The table is an immutable snapshot: a request resolves its chain with dict
lookups, and a rebuild replaces the whole snapshot in one assignment.
"""

from __future__ import annotations

import tomllib
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from registry.chain import Chain
from registry.components import LoadedPlugin
from registry.errors import (
    PlugserveError,
    RouteNotFound,
    RoutesFileError,
    Unavailable,
    VersionNotFound,
)
from registry.ratelimit import RateLimit
from registry.records import VersionRecord
from registry.refs import NAME_PATTERN, Ref, is_valid_name

ROUTES_FILE = "routes.toml"
_ROUTE_KEYS = {"runner", "preprocess", "postprocess", "sticky", "rate_limit"}


@dataclass(frozen=True)
class RouteSpec:
    """What a route is made of. ``None`` chains come from the runner version's manifest."""

    name: str
    runner: Ref
    preprocess: tuple[Ref, ...] | None = None
    postprocess: tuple[Ref, ...] | None = None
    source: str = ROUTES_FILE
    rate_limit: RateLimit | None = None


def load_routes_file(path: Path) -> dict[str, RouteSpec]:
    """Parse ``routes.toml``; an absent file is no routes. Raises :class:`RoutesFileError`.

    In an entry, a missing ``preprocess`` or ``postprocess`` keeps the runner
    manifest's list; an empty list means none.
    """
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise RoutesFileError(f"{path}: {exc}", file=str(path)) from None
    unknown = sorted(set(raw) - {"routes"})
    if unknown:
        raise RoutesFileError(f"{path}: unknown table(s) {unknown}; known: routes", file=str(path))
    routes = raw.get("routes", {})
    if not isinstance(routes, dict):
        raise RoutesFileError(f"{path}: routes must be a table", file=str(path))
    return {name: _route_entry(path, name, entry) for name, entry in routes.items()}


def _route_entry(path: Path, name: str, entry: Any) -> RouteSpec:
    where = f"{path}: routes.{name}"

    def fail(message: str) -> RoutesFileError:
        return RoutesFileError(f"{where}{message}", file=str(path), route=name)

    if not is_valid_name(name):
        raise fail(f": the route name must match {NAME_PATTERN}")
    if not isinstance(entry, dict):
        raise fail(": must be a table")
    unknown = sorted(set(entry) - _ROUTE_KEYS)
    if unknown:
        raise fail(f": unknown key(s) {unknown}; known: {', '.join(sorted(_ROUTE_KEYS))}")
    runner = entry.get("runner")
    if isinstance(runner, dict):
        raise fail(".runner: weighted runners are not supported yet; name one runner")
    if not isinstance(runner, str):
        raise fail(".runner: is required, a runner name or name@version")
    if "sticky" in entry:
        raise fail(".sticky: sticky routing needs weighted runners, not supported yet")

    def refs(key: str) -> tuple[Ref, ...] | None:
        if key not in entry:
            return None
        value = entry[key]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise fail(f".{key}: must be a list of plugin names")
        try:
            return tuple(Ref.parse(v) for v in value)
        except ValueError as exc:
            raise fail(f".{key}: {exc}") from None

    try:
        runner_ref = Ref.parse(runner)
        rate_limit = RateLimit.parse(entry["rate_limit"]) if "rate_limit" in entry else None
    except ValueError as exc:
        raise fail(f": {exc}") from None
    return RouteSpec(
        name, runner_ref, refs("preprocess"), refs("postprocess"), ROUTES_FILE, rate_limit
    )


@dataclass(frozen=True)
class _Failure:
    """An error to raise for a route; a fresh exception each time, so tracebacks never pile up."""

    kind: type[PlugserveError]
    message: str

    def error(self) -> PlugserveError:
        return self.kind(self.message)


@dataclass(frozen=True)
class RouteEntry:
    spec: RouteSpec
    default: Chain | _Failure
    by_version: Mapping[str, Chain | _Failure]
    known_versions: Mapping[str, VersionRecord]

    @property
    def rate_limit(self) -> RateLimit | None:
        """The routes file's limit, else the serving runner manifest's ``[route] rate_limit``."""
        if self.spec.rate_limit is not None:
            return self.spec.rate_limit
        if isinstance(self.default, Chain):
            return self.default.runner.manifest.route.rate_limit
        return None

    def chain(self, version: str | None) -> Chain:
        target = self.default if version is None else self.by_version.get(version)
        if target is None:
            target = self._version_failure(str(version))
        if isinstance(target, _Failure):
            raise target.error()
        return target

    def _version_failure(self, version: str) -> _Failure:
        runner = self.spec.runner
        record = self.known_versions.get(version)
        if runner.version is not None and str(runner.version) != version:
            return _Failure(VersionNotFound, f"route {self.spec.name!r} is pinned to {runner}")
        if record is None:
            return _Failure(
                VersionNotFound, f"route {self.spec.name!r} has no runner version {version!r}"
            )
        return _Failure(Unavailable, _not_ready(record))

    @property
    def versions(self) -> list[str]:
        return list(self.by_version)

    def describe(self) -> dict[str, Any]:
        spec = self.spec
        out: dict[str, Any] = {
            "name": spec.name,
            "source": spec.source,
            "runner": str(spec.runner),
            "preprocess": None if spec.preprocess is None else [str(r) for r in spec.preprocess],
            "postprocess": None if spec.postprocess is None else [str(r) for r in spec.postprocess],
            "versions": self.versions,
            "rate_limit": None if self.rate_limit is None else vars(self.rate_limit),
        }
        if isinstance(self.default, Chain):
            out["serving"] = self.default.describe()
            out["ready"] = True
        else:
            out["ready"] = False
            out["error"] = self.default.message
        return out


def _not_ready(record: VersionRecord) -> str:
    detail = f": {record.last_error}" if record.last_error else ""
    return f"{record.label} is {record.state}{detail}"


@dataclass(frozen=True)
class RouteTable:
    """An immutable snapshot of every route and the chain that serves it."""

    entries: Mapping[str, RouteEntry] = field(default_factory=dict)
    errors: tuple[str, ...] = ()

    def resolve(self, route: str, version: str | None = None) -> Chain:
        """The chain serving ``route`` (``version``: that runner version's).

        Raises :class:`RouteNotFound`, :class:`VersionNotFound` or :class:`Unavailable`.
        """
        entry = self.entries.get(route)
        if entry is None:
            raise RouteNotFound(f"unknown route {route!r}")
        return entry.chain(version)

    def describe(self) -> list[dict[str, Any]]:
        return [self.entries[name].describe() for name in sorted(self.entries)]


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
            return _Failure(Unavailable, _not_ready(known[str(ref.version)]))
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
        route = instances[0].manifest.route_name if instances else name
        if route in specs:
            errors.append(
                f"route {route!r} is declared by runner {name} and by runner "
                f"{specs[route].runner.name}; {specs[route].runner.name} serves it"
            )
            continue
        specs[route] = RouteSpec(route, Ref(name), source=f"runner/{name}")
    specs.update(file_routes)
    entries = {name: _entry(spec, index) for name, spec in specs.items()}
    return RouteTable(entries, tuple(errors))


def _entry(spec: RouteSpec, index: _Index) -> RouteEntry:
    runners = [
        r
        for r in index.ready.get(("runner", spec.runner.name), [])
        if spec.runner.version is None or r.manifest.version == spec.runner.version
    ]
    by_version = {r.version: _chain(spec, r, index) for r in runners}
    default: Chain | _Failure
    if runners:
        default = by_version[runners[0].version]
    else:
        picked = index.pick("runner", spec.runner)
        assert isinstance(picked, _Failure)
        default = _Failure(Unavailable, f"route {spec.name!r}: {picked.message}")
    known = index.known.get(("runner", spec.runner.name), {})
    return RouteEntry(spec, default, by_version, known)


def _chain(spec: RouteSpec, runner: LoadedPlugin, index: _Index) -> Chain | _Failure:
    declared = runner.manifest.route
    pre_refs = declared.preprocess if spec.preprocess is None else spec.preprocess
    post_refs = declared.postprocess if spec.postprocess is None else spec.postprocess
    stages: list[list[LoadedPlugin]] = [[], []]
    for slot, kind, refs in ((0, "preprocessor", pre_refs), (1, "postprocessor", post_refs)):
        for ref in refs:
            picked = index.pick(kind, ref)
            if isinstance(picked, _Failure):
                return _Failure(Unavailable, f"route {spec.name!r}: {picked.message}")
            stages[slot].append(picked)
    return Chain(spec.name, tuple(stages[0]), runner, tuple(stages[1]))
