"""What the registry knows of each plugin version: state, error, the instance serving."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from plugserve.registry.execution.components.base import LoadedPlugin
from plugserve.registry.refs import PluginType
from plugserve.registry.versions import Version

State = Literal["loading", "ready", "failed", "draining", "unloaded", "available"]
"""``available``: a runner version that loads on its first request (``load = "on_demand"``),
registered and listed, not loaded."""


@dataclass(eq=False)
class VersionRecord:
    """One plugin version folder, across its loads.

    ``current`` is the instance that serves; ``state`` says where the version
    stands. A reload that fails while ``current`` keeps serving leaves the
    state ``ready`` with the failure in ``last_error``. ``lock`` serialises the
    lifecycle operations (load, reload, unload) of this one version.
    """

    type: PluginType
    name: str
    version: str
    folder: Path
    state: State = "loading"
    current: LoadedPlugin | None = None
    last_error: str | None = None
    fingerprint: str | None = field(default=None, repr=False)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    draining: list[LoadedPlugin] = field(default_factory=list, repr=False)
    memory_bytes: int | None = None
    """Under a memory budget: what the loaded version was measured to cost."""
    on_demand: bool = False
    """It loads on its first request (``[runner] load = "on_demand"``, or the server's
    default); once loaded it reloads on change like any other version."""
    isolated: bool = False
    """Its runner runs in processes of its own (``[runner] isolation = "process"``)."""

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.type, self.name, self.version)

    @property
    def label(self) -> str:
        return f"{self.type}/{self.name}@{self.version}"

    @property
    def sort_version(self) -> Version | None:
        try:
            return Version.parse(self.version)
        except ValueError:
            return None

    def as_json(self) -> dict[str, Any]:
        current = self.current
        return {
            "type": self.type,
            "name": self.name,
            "version": self.version,
            "state": self.state,
            "path": str(self.folder),
            "loaded_at": _iso(current.loaded_at) if current else None,
            "in_flight": sum(
                p.in_flight for p in [*self.draining, *([current] if current else [])]
            ),
            "last_error": self.last_error,
            **({"memory_bytes": self.memory_bytes} if self.memory_bytes is not None else {}),
            "description": current.manifest.description if current else None,
            "backend": current.manifest.runner.backend
            if current and current.manifest.runner
            else None,
            **(current.describe() if current else {}),
            **_runtime(current),
        }


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="milliseconds")


def _runtime(current: LoadedPlugin | None) -> dict[str, Any]:
    """Where a runner executes (device, providers, threads), as its backend reports it."""
    metadata = (current.metadata() if current else None) or {}
    keys = ("device", "providers", "requested_providers", "threads")
    return {k: metadata[k] for k in keys if k in metadata}
