"""Where runtime route changes live: in this process (the default) or in etcd (a fleet).

``PUT /admin/routes/{route}`` and ``DELETE /admin/routes/{route}`` go through a
store. Each entry carries a revision; a write may name the revision it expects
(``If-Match``) and fails with 409 when the entry moved on. The store hands the
registry its whole runtime layer at once, so every change is one table rebuild.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from registry.errors import Conflict, NotFound
from registry.registry import Registry
from registry.routes import RouteSpec


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
    """In-process runtime routes: the default. Changes last until the server stops."""

    mode = "local"

    def __init__(self, registry: Registry, replica: Replica) -> None:
        self.registry = registry
        self.replica = replica
        self.revision = 0

    async def start(self) -> None:
        """Called once plugins are loaded, before the server takes traffic."""

    async def close(self) -> None:
        """Called at shutdown."""

    @property
    def ready(self) -> bool:
        """Whether the route table may be served (a fleet replica: once synced)."""
        return True

    def health(self) -> dict[str, Any]:
        return {"mode": self.mode, "revision": self.revision}

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
        self.revision += 1
        stored = replace(spec, source="admin", revision=self.revision)
        self.registry.set_runtime_routes({**self.registry.runtime_routes, spec.name: stored})
        return stored

    async def delete(self, name: str, if_revision: int | None = None) -> int:
        """Remove the runtime entry of ``name``; returns the revision of the deletion."""
        if name not in self.registry.runtime_routes:
            raise NotFound(f"route {name!r} has no runtime entry to delete")
        self._check(name, if_revision)
        self.revision += 1
        routes = dict(self.registry.runtime_routes)
        del routes[name]
        self.registry.set_runtime_routes(routes)
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
