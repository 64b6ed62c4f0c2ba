"""Where runtime route changes live: in this process (the default) or in etcd (a fleet).

``PUT /admin/routes/{route}`` and ``DELETE /admin/routes/{route}`` go through a
store. Each entry carries a revision; a write may name the revision it expects
(``If-Match``) and fails with 409 when the entry moved on. The store hands the
registry its whole runtime layer at once, so every change is one table rebuild.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import structlog

from plugserve.registry import checks
from plugserve.registry.errors import ConfigError, Conflict, NotFound, Unavailable
from plugserve.registry.lifecycle.lifecycle_events import Key, LifecycleEvent
from plugserve.registry.routing.records import VersionRecord
from plugserve.registry.routing.route_specs import RouteSpec, RouteSpecError, parse_route

log = structlog.get_logger("plugserve.routes")
_T = TypeVar("_T")


class RouteTarget(Protocol):
    """What a route store applies runtime routes to: the registry, or a supervisor's workers."""

    listeners: list[Callable[[LifecycleEvent], None]]

    @property
    def records(self) -> Mapping[Key, VersionRecord]: ...
    @property
    def runtime_routes(self) -> Mapping[str, RouteSpec]: ...

    def set_runtime_routes(self, routes: Mapping[str, RouteSpec]) -> None: ...


@dataclass(frozen=True)
class Replica:
    """This server as the fleet sees it."""

    id: str
    url: str
    started_at: float = field(default_factory=time.time)

    @classmethod
    def default(cls, host: str, port: int, replica_id: str | None = None) -> Replica:
        shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
        return cls(replica_id or f"{socket.gethostname()}:{port}", f"http://{shown}:{port}")

    def describe(self, registry: RouteTarget) -> dict[str, Any]:
        """The record a replica publishes: who it is and which versions are ready on it."""
        return {
            "id": self.id,
            "url": self.url,
            "started_at": self.started_at,
            "updated_at": time.time(),
            "ready": sorted(r.label for r in registry.records.values() if r.state == "ready"),
        }


class RouteStore:
    """In-process runtime routes: the default.

    Changes last until the server stops, or, with ``state_file``, across restarts:
    each change is written there (to a temporary file, then renamed) before it is
    applied, and the file is read back at start. Changes are made one at a time
    (check, save, apply), so revisions never repeat and ``If-Match`` is exact.
    """

    mode = "local"

    def __init__(
        self, registry: RouteTarget, replica: Replica, state_file: Path | None = None
    ) -> None:
        self.registry = registry
        self.replica = replica
        self.state_file = state_file
        self.revision = 0
        self.invalid: dict[str, dict[str, Any]] = {}
        """Saved entries that are no longer valid: kept in the file, not served, by route."""
        self._lock = asyncio.Lock()  # check, save and apply: one change at a time
        self._saving: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        """Called once plugins are loaded, before the server takes traffic.

        Raises :class:`ConfigError` when the state file exists but cannot be read
        as one: starting empty would drop its entries at the next change.
        """
        if self.state_file is not None:
            self.registry.set_runtime_routes(await asyncio.to_thread(self._read_state))

    def _read_state(self) -> dict[str, RouteSpec]:
        """The saved entries; an entry no longer valid is kept aside in :attr:`invalid`."""
        assert self.state_file is not None
        bound = log.bind(file=str(self.state_file))
        try:
            saved = _saved_state(self.state_file.read_bytes())
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise ConfigError(
                f"runtime_routes_file {self.state_file}: cannot be read: {exc.strerror}"
            ) from None
        except Exception as exc:  # outside data: whatever parsing raises, the file is bad
            raise ConfigError(
                f"runtime_routes_file {self.state_file}: not a saved route state ({exc}); "
                "fix or remove it"
            ) from None
        revision, items = saved
        routes = {}
        for name, (entry, entry_revision) in items.items():
            self.revision = max(self.revision, entry_revision)
            try:
                spec = parse_route(name, entry, "admin")
            except Exception as exc:  # a saved entry that a stricter check now refuses
                error = f"routes.{name}{exc}" if isinstance(exc, RouteSpecError) else repr(exc)
                error = error if len(error) <= 500 else error[:497] + "..."
                self.invalid[name] = {"entry": entry, "revision": entry_revision, "error": error}
                bound.warning("runtime_route_invalid", route=name, error=error)
                continue
            routes[name] = replace(spec, revision=entry_revision)
        self.revision = max(self.revision, revision)
        bound.info("runtime_routes_restored", routes=sorted(routes), revision=self.revision)
        return routes

    async def _commit(self, routes: dict[str, RouteSpec], revision: int) -> None:
        """Save (when configured), then apply: a change that cannot be saved is not made."""
        if self.state_file is not None:
            state = {"revision": revision, "routes": self._saved_entries(routes)}
            try:
                await asyncio.to_thread(_write_atomically, self.state_file, state)
            except OSError as exc:
                raise Unavailable(
                    f"the route change could not be saved to {self.state_file}: {exc.strerror}"
                ) from None
        self.revision = revision
        self.registry.set_runtime_routes(routes)

    def _saved_entries(self, routes: Mapping[str, RouteSpec]) -> dict[str, Any]:
        """What the state file holds: every entry, the invalid ones as they were read."""
        kept = {
            name: {"entry": item["entry"], "revision": item["revision"]}
            for name, item in self.invalid.items()
            if name not in routes
        }
        return {**kept, **describe_entries(routes)}

    async def _serialized(self, change: Coroutine[Any, Any, _T]) -> _T:
        """Run ``change`` alone (check, save, apply), to its end even if the caller leaves."""
        task = asyncio.ensure_future(self._locked(change))
        self._saving.add(task)
        task.add_done_callback(self._saved)
        return await asyncio.shield(task)

    def _saved(self, task: asyncio.Task[Any]) -> None:
        self._saving.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved here too: a caller that left cannot

    async def _locked(self, change: Coroutine[Any, Any, _T]) -> _T:
        async with self._lock:
            return await change

    async def close(self) -> None:
        """Called at shutdown: a change being saved finishes first."""
        await asyncio.gather(*self._saving, return_exceptions=True)

    @property
    def ready(self) -> bool:
        """Whether the route table may be served (a fleet replica: once synced)."""
        return True

    def health(self) -> dict[str, Any]:
        saved = None if self.state_file is None else str(self.state_file)
        return {"mode": self.mode, "revision": self.revision, "state_file": saved}

    def current_revision(self, name: str) -> int:
        if name in self.invalid:
            return int(self.invalid[name]["revision"])
        spec = self.registry.runtime_routes.get(name)
        return 0 if spec is None or spec.revision is None else spec.revision

    def _check(self, name: str, if_revision: int | None) -> None:
        current = self.current_revision(name)
        if if_revision is not None and if_revision != current:
            raise Conflict(
                f"route {name!r} is at revision {current}, not {if_revision}: read it and retry",
                revision=current,
            )

    async def put(
        self, spec: RouteSpec, if_revision: int | None = None, as_decider: bool = False
    ) -> RouteSpec:
        """Set ``spec`` as the runtime entry of its route; returns it with its revision.
        ``as_decider``: a rollout's step, written only while this server decides (in a
        fleet, while it holds the decider lease; here, always)."""
        return await self._serialized(self._put(spec, if_revision))

    async def _put(self, spec: RouteSpec, if_revision: int | None) -> RouteSpec:
        self._check(spec.name, if_revision)
        revision = self.revision + 1
        stored = replace(spec, source="admin", revision=revision)
        await self._commit({**self.registry.runtime_routes, spec.name: stored}, revision)
        self.invalid.pop(spec.name, None)
        return stored

    async def delete(self, name: str, if_revision: int | None = None) -> int:
        """Remove the runtime entry of ``name``; returns the revision of the deletion."""
        return await self._serialized(self._delete(name, if_revision))

    async def _delete(self, name: str, if_revision: int | None) -> int:
        if name not in self.registry.runtime_routes and name not in self.invalid:
            raise NotFound(f"route {name!r} has no runtime entry to delete")
        self._check(name, if_revision)
        routes = dict(self.registry.runtime_routes)
        routes.pop(name, None)
        invalid = self.invalid.pop(name, None)
        try:
            await self._commit(routes, self.revision + 1)
        except Exception:
            if invalid is not None:
                self.invalid[name] = invalid
            raise
        return self.revision

    async def fleet(self) -> dict[str, Any]:
        """``GET /admin/fleet``: this server alone."""
        return {
            **self.health(),
            "replica": self.replica.id,
            "replicas": [{**self.replica.describe(self.registry), "self": True}],
            "routes": describe_entries(self.registry.runtime_routes),
            "invalid": {
                name: {"revision": item["revision"], "error": item["error"]}
                for name, item in self.invalid.items()
            },
        }


def describe_entries(routes: Mapping[str, RouteSpec]) -> dict[str, Any]:
    """Runtime entries as ``GET /admin/fleet`` lists them: entry and revision by route."""
    return {
        name: {"entry": spec.as_entry(), "revision": spec.revision}
        for name, spec in sorted(routes.items())
    }


def _saved_state(raw: bytes) -> tuple[int, dict[str, tuple[Any, int]]]:
    """The state file's revision and its entries (entry, revision) by route; raises
    ``ValueError`` when it is not one."""
    state = checks.parse_json(raw, strict=True)
    if not isinstance(state, dict) or not isinstance(state.get("routes"), dict):
        raise ValueError("expected an object with revision and routes")
    revision = _revision(state.get("revision"), "revision")
    items = {}
    for name, item in state["routes"].items():
        if not isinstance(item, dict) or "entry" not in item:
            raise ValueError(f"routes.{name}: expected an object with entry and revision")
        items[name] = (item["entry"], _revision(item.get("revision"), f"routes.{name}.revision"))
    return revision, items


def _revision(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError(f"{where} must be an integer from 0 to 2**63 - 1")
    return value


def _write_atomically(path: Path, data: Any) -> None:
    """Write JSON to ``path`` so that a crash leaves the old file or the new one, never half.

    A temporary file of its own in the same folder (two writers never share one),
    flushed to disk, renamed over ``path``; then the folder is flushed so the
    rename itself survives a power cut.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=2, sort_keys=True, allow_nan=False)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """Flush a folder's entries; where the file system cannot (some refuse), the rename stands."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
