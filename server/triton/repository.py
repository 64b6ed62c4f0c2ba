"""Triton's model repository extension: index, load and unload of routes, over reload and unload.

A route is Triton's model: loading it loads (again, from its files) every
version of its runner the route can serve, unloading it unloads them; the
route stays in the table, not ready, until a load or a change to its files.
:class:`LocalRepository` does it on this process's registry (a single
process, and each worker when its supervisor tells it to);
``server/processes/supervised.py`` hands it to the supervisor, which makes every
worker do it. Callers check the admin rules first (``server/http/auth.py``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any, Protocol

from aiohttp import web

from plugserve.registry import checks
from plugserve.registry.errors import (
    Conflict,
    Forbidden,
    InvalidInput,
    ModelLoadFailed,
    NotFound,
    PlugserveError,
    RouteNotFound,
    TooManyRequests,
    Unauthorized,
    Unavailable,
)
from plugserve.registry.execution.chain import Chain
from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.manifest import load_manifest
from plugserve.registry.routing.records import VersionRecord
from plugserve.registry.routing.routes import RouteEntry

STATES = {
    "ready": "READY",
    "loading": "LOADING",
    "draining": "UNLOADING",
    "failed": "UNAVAILABLE",
    "unloaded": "UNAVAILABLE",
    "available": "UNAVAILABLE",
}
"""Triton's model states, by a runner version's state."""
DERIVED = frozenset(
    {"platform", "backend", "version_policy", "output", "runtime", "model_transaction_policy"}
)
"""Configuration fields plugserve derives from the runner itself: a load ignores them."""


class ModelRepository(Protocol):
    """What the repository extension does, whichever process does it."""

    async def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Every route with its versions' states: ``[{"name", "version", "state", "reason"}]``."""
        ...

    async def load(self, route: str, config: str | None = None) -> dict[str, Any]:
        """Load ``route`` from its files (``config``: Triton's JSON configuration overriding
        the runner's settings for this load); raises :class:`ModelLoadFailed`."""
        ...

    async def unload(self, route: str) -> dict[str, Any]:
        """Unload every version of ``route``'s runner; raises :class:`RouteNotFound`."""
        ...


class LocalRepository:
    """The repository extension on this process's registry."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        rows = []
        for name, entry in sorted(self.registry.routes.entries.items()):
            rows.extend(_rows(name, entry))
        return [r for r in rows if r["state"] == "READY"] if ready_only else rows

    async def load(self, route: str, config: str | None = None) -> dict[str, Any]:
        registry = self.registry
        entry = registry.routes.entries.get(route)
        versions = None if entry is None else _versions(entry)
        runner = entry.spec.runner.name if entry is not None else await _declaring(registry, route)
        if runner is None:
            raise ModelLoadFailed(route, "failed to poll from model repository")
        overrides = runner_overrides(route, config) if config is not None else None
        folders = [
            f
            for f in registry.discover()
            if registry.key_of(f)[:2] == ("runner", runner)
            and (versions is None or f.name in versions)
        ]
        if not folders:
            raise ModelLoadFailed(route, f"runner {runner} has no version to load")
        outcomes: dict[str, list[str]] = {}
        for folder in sorted(folders):
            outcome = await registry.load(folder, explicit=True, overrides=overrides)
            record = registry.records[registry.key_of(folder)]
            outcomes.setdefault(outcome, []).append(record.label)
            if outcome == "failed":
                raise ModelLoadFailed(route, record.last_error or "its load failed")
        try:
            registry.routes.resolve(route)
        except PlugserveError as exc:  # its runner loaded, another stage of its chain did not
            raise ModelLoadFailed(route, exc.message) from None
        return {"name": route, **outcomes}

    async def unload(self, route: str) -> dict[str, Any]:
        registry = self.registry
        entry = registry.routes.entries.get(route)
        if entry is None:
            raise RouteNotFound(route)
        unloaded = []
        for record in _records(entry):
            if record.state != "unloaded" and record.key in registry.records:
                await registry.unload(record.key)
                unloaded.append(record.label)
        return {"name": route, "unloaded": unloaded}


async def _declaring(registry: Registry, route: str) -> str | None:
    """The runner whose files declare ``route`` (``[route] name``): a route named apart from
    its runner leaves the table while none of its versions is loaded."""

    def find() -> str | None:
        for folder in registry.discover():
            kind, name, _ = registry.key_of(folder)
            if kind == "runner":
                try:
                    if load_manifest(folder).route_name == route:
                        return name
                except PlugserveError:
                    continue
        return None

    return await asyncio.to_thread(find)


_BY_STATUS: dict[int, type[PlugserveError]] = {
    400: InvalidInput,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    429: TooManyRequests,
    503: Unavailable,
}


def relayed(status: int, message: str) -> PlugserveError:
    """An error another process answered, as the error of its status here."""
    return _BY_STATUS.get(status, PlugserveError)(message)


def load_request(body: bytes) -> str | None:
    """The ``config`` of a load request's body (``{"parameters": {"config": "<JSON>"}}``).

    Triton's file overrides (``file:<path>`` parameters) are refused: a route's
    files are its plugin folder.
    """
    doc = _body(body)
    parameters = doc.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be an object")
    files = sorted(k for k in parameters if isinstance(k, str) and k.startswith("file:"))
    if files:
        raise InvalidInput(f"file overrides are not supported ({', '.join(files)})")
    config = parameters.get("config")
    if config is not None and not isinstance(config, str):
        raise InvalidInput("parameter 'config' must be a string holding the JSON configuration")
    return config


def index_request(body: bytes) -> bool:
    """Whether an index request asks for ready models only (``{"ready": true}``)."""
    ready = _body(body).get("ready", False)
    if not isinstance(ready, bool):
        raise InvalidInput("'ready' must be true or false")
    return ready


def _body(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        doc = checks.parse_json(body)
    except checks.ValueProblem as exc:
        raise InvalidInput(f"the body must be a JSON object: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput("the body must be a JSON object")
    return doc


def runner_overrides(route: str, config: str) -> dict[str, Any]:
    """The ``[runner]`` keys a load's Triton ``config`` sets; raises :class:`ModelLoadFailed`.

    Read as protobuf's JSON reads a ``ModelConfig`` (integers may be strings):
    ``max_batch_size``, ``dynamic_batching`` (``max_queue_delay_microseconds``,
    ``preferred_batch_size``, ``priority_levels``, ``default_priority_level``),
    ``instance_group`` (the counts, summed) and the inputs' ``format``. What the
    runner itself decides (platform, backend, outputs, version and transaction policy)
    is ignored; any other field is refused.
    """
    try:
        doc = checks.parse_json(config.encode("utf-8", "surrogatepass"))
    except checks.ValueProblem as exc:
        raise ModelLoadFailed(route, f"the config is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ModelLoadFailed(route, "the config must be a JSON object")
    try:
        return _overrides(route, doc)
    except (InvalidInput, TypeError, ValueError) as exc:
        raise ModelLoadFailed(route, f"invalid config: {exc}") from None


def _overrides(route: str, doc: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key in DERIVED:
            continue
        if key == "name":
            if value != route:
                raise ValueError(f"name {value!r} is not the route {route!r}")
        elif key == "max_batch_size":
            out["max_batch_size"] = _integer(value, key)
        elif key == "dynamic_batching":
            out.update(_dynamic_batching(_object(value, key)))
        elif key == "instance_group":
            groups = value if isinstance(value, list) else []
            out["instances"] = sum(_integer(_object(g, key).get("count", 1), key) for g in groups)
        elif key == "input":
            formats = _formats(value)
            if formats:
                out["formats"] = formats
        else:
            raise ValueError(f"field {key!r} is not supported")
    return out


def _dynamic_batching(doc: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        where = f"dynamic_batching.{key}"
        if key == "max_queue_delay_microseconds":
            out["max_queue_delay_ms"] = _integer(value, where) / 1000
        elif key == "preferred_batch_size":
            sizes = value if isinstance(value, list) else [value]
            out["preferred_batch_sizes"] = [_integer(v, where) for v in sizes]
        elif key in ("priority_levels", "default_priority_level"):
            out[key] = _integer(value, where)
        else:
            raise ValueError(f"field {where!r} is not supported")
    return out


def _formats(inputs: Any) -> dict[str, str]:
    formats = {}
    for item in inputs if isinstance(inputs, list) else []:
        spec = _object(item, "input")
        if "format" in spec and "name" in spec:
            formats[str(spec["name"])] = str(spec["format"])
    return formats


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object")
    return value


def _integer(value: Any, where: str) -> int:
    """An integer as protobuf's JSON takes one: a number without a fraction, or its text."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit() and len(value) < 20:
        return int(value)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and math.isfinite(value) and value == int(value):
        return int(value)
    raise ValueError(f"{where} must be an integer, not {checks.shown(value)}")


def _versions(entry: RouteEntry) -> set[str] | None:
    """The runner versions a route can serve: the pinned or weighted ones; ``None``: any."""
    spec = entry.spec
    if spec.variants:
        return {str(v.runner.version) for v in spec.variants}
    if spec.runner.version is not None:
        return {str(spec.runner.version)}
    return None


def _records(entry: RouteEntry) -> list[VersionRecord]:
    """The route's runner versions this server knows, highest first."""
    versions = _versions(entry)
    records = [r for v, r in entry.known_versions.items() if versions is None or v in versions]
    return sorted(records, key=lambda r: (r.sort_version is not None, r.sort_version), reverse=True)


def _rows(name: str, entry: RouteEntry) -> list[dict[str, Any]]:
    records = _records(entry)
    if not records:
        reason = entry.default.message if not isinstance(entry.default, Chain) else ""
        return [{"name": name, "version": "", "state": "UNAVAILABLE", "reason": reason}]
    rows = []
    for record in records:
        target = entry.by_version.get(record.version)
        state, reason = STATES[record.state], record.last_error or ""
        if isinstance(target, Chain):
            state = "READY"
        elif record.state == "ready":  # the runner is, another stage of its chain is not
            state = "UNAVAILABLE"
            if target is not None:  # what this version waits for
                reason = target.message
            elif not isinstance(entry.default, Chain):
                reason = entry.default.message
        elif record.state == "unloaded":
            reason = reason or "unloaded"
        elif record.state == "available":
            reason = "loads on its first request (load = on_demand)"
        rows.append({"name": name, "version": record.version, "state": state, "reason": reason})
    return rows


REPOSITORY: web.AppKey[ModelRepository] = web.AppKey("repository")
"""Triton's model repository extension: this registry's, or through the supervisor."""
