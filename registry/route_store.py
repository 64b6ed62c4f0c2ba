"""Where runtime route changes live: in this process (the default) or in etcd (a fleet).

``PUT /admin/routes/{route}`` and ``DELETE /admin/routes/{route}`` go through a
store. Each entry carries a revision; a write may name the revision it expects
(``If-Match``) and fails with 409 when the entry moved on. The store hands the
registry its whole runtime layer at once, so every change is one table rebuild.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from registry.errors import Conflict, NotFound, Unavailable
from registry.registry import Registry
from registry.routes import RouteSpec, RouteSpecError, parse_route

log = structlog.get_logger("plugserve.routes")


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

    def describe(self, registry: Registry) -> dict[str, Any]:
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
    applied, and the file is read back at start.
    """

    mode = "local"

    def __init__(
        self, registry: Registry, replica: Replica, state_file: Path | None = None
    ) -> None:
        self.registry = registry
        self.replica = replica
        self.state_file = state_file
        self.revision = 0

    async def start(self) -> None:
        """Called once plugins are loaded, before the server takes traffic."""
        if self.state_file is not None:
            self.registry.set_runtime_routes(await asyncio.to_thread(self._read_state))

    def _read_state(self) -> dict[str, RouteSpec]:
        """The saved entries; an unreadable file or entry is logged and left out."""
        assert self.state_file is not None
        bound = log.bind(file=str(self.state_file))
        try:
            raw = json.loads(self.state_file.read_text(encoding="utf-8"))
            self.revision = int(raw["revision"])
            saved = dict(raw["routes"])
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            bound.error("runtime_routes_unreadable", error=repr(exc))
            return {}
        routes = {}
        for name, item in saved.items():
            try:
                spec = parse_route(name, item["entry"], "admin")
                routes[name] = replace(spec, revision=int(item["revision"]))
            except (RouteSpecError, KeyError, TypeError, ValueError) as exc:
                bound.error("runtime_route_invalid", route=name, error=str(exc))
        bound.info("runtime_routes_restored", routes=sorted(routes), revision=self.revision)
        return routes

    async def _commit(self, routes: dict[str, RouteSpec], revision: int) -> None:
        """Save (when configured), then apply: a change that cannot be saved is not made."""
        if self.state_file is not None:
            state = {"revision": revision, "routes": describe_entries(routes)}
            try:
                await asyncio.to_thread(_write_atomically, self.state_file, state)
            except OSError as exc:
                raise Unavailable(
                    f"the route change could not be saved to {self.state_file}: {exc.strerror}"
                ) from None
        self.revision = revision
        self.registry.set_runtime_routes(routes)

    async def close(self) -> None:
        """Called at shutdown."""

    @property
    def ready(self) -> bool:
        """Whether the route table may be served (a fleet replica: once synced)."""
        return True

    def health(self) -> dict[str, Any]:
        saved = None if self.state_file is None else str(self.state_file)
        return {"mode": self.mode, "revision": self.revision, "state_file": saved}

    def current_revision(self, name: str) -> int:
        spec = self.registry.runtime_routes.get(name)
        return 0 if spec is None or spec.revision is None else spec.revision

    def _check(self, name: str, if_revision: int | None) -> None:
        current = self.current_revision(name)
        if if_revision is not None and if_revision != current:
            raise Conflict(
                f"route {name!r} is at revision {current}, not {if_revision}: read it and retry",
                revision=current,
            )

    async def put(self, spec: RouteSpec, if_revision: int | None = None) -> RouteSpec:
        """Set ``spec`` as the runtime entry of its route; returns it with its revision."""
        self._check(spec.name, if_revision)
        revision = self.revision + 1
        stored = replace(spec, source="admin", revision=revision)
        await self._commit({**self.registry.runtime_routes, spec.name: stored}, revision)
        return stored

    async def delete(self, name: str, if_revision: int | None = None) -> int:
        """Remove the runtime entry of ``name``; returns the revision of the deletion."""
        if name not in self.registry.runtime_routes:
            raise NotFound(f"route {name!r} has no runtime entry to delete")
        self._check(name, if_revision)
        routes = dict(self.registry.runtime_routes)
        del routes[name]
        await self._commit(routes, self.revision + 1)
        return self.revision

    async def fleet(self) -> dict[str, Any]:
        """``GET /admin/fleet``: this server alone."""
        return {
            **self.health(),
            "replica": self.replica.id,
            "replicas": [{**self.replica.describe(self.registry), "self": True}],
            "routes": describe_entries(self.registry.runtime_routes),
        }


def describe_entries(routes: Mapping[str, RouteSpec]) -> dict[str, Any]:
    """Runtime entries as ``GET /admin/fleet`` lists them: entry and revision by route."""
    return {
        name: {"entry": spec.as_entry(), "revision": spec.revision}
        for name, spec in sorted(routes.items())
    }


def _write_atomically(path: Path, data: Any) -> None:
    """Write JSON to ``path`` so that a crash leaves the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w", encoding="utf-8") as out:
        json.dump(data, out, indent=2, sort_keys=True)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)
