"""The registry: every plugin version's record, its lifecycle, and the route table built from them.

Lifecycle of a version (one lock each, so concurrent triggers cannot race):
load the new instance beside the old one, swap it in with one route-table
rebuild, let the old instance drain, then release it. A failed load leaves
whatever was serving untouched.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterable
from pathlib import Path

import structlog

from registry.components import LoadedPlugin
from registry.errors import NotFound, PlugserveError, RoutesFileError
from registry.loader import Loader
from registry.manager import PluginHost
from registry.manifest import load_manifest
from registry.records import VersionRecord
from registry.refs import PLUGIN_TYPES, PluginType, is_ignored_name
from registry.routes import ROUTES_FILE, RouteSpec, RouteTable, build_route_table, load_routes_file
from registry.versions import Version

log = structlog.get_logger("plugserve.registry")

Key = tuple[str, str, str]


class Registry:
    """Discovers, loads, serves and releases plugin versions."""

    def __init__(
        self,
        plugins_dir: Path,
        models_dir: Path,
        host: PluginHost | None = None,
        drain_timeout: float = 30.0,
    ) -> None:
        self.plugins_dir = plugins_dir
        self.models_dir = models_dir
        self.host = host or PluginHost()
        self.loader = Loader(self.host, models_dir)
        self.drain_timeout = drain_timeout
        self.records: dict[Key, VersionRecord] = {}
        self.routes = RouteTable()
        self.file_routes: dict[str, RouteSpec] = {}
        self.routes_file_error: str | None = None
        self.started = False

    @property
    def routes_file(self) -> Path:
        return self.plugins_dir / ROUTES_FILE

    # -- discovery ---------------------------------------------------------------------

    def discover(self) -> list[Path]:
        """Every folder ``<plugins_dir>/<type>/<name>/<version>/``, ignored names skipped."""
        found: list[Path] = []
        for kind in PLUGIN_TYPES:
            for name in _subdirs(self.plugins_dir / kind):
                found.extend(_subdirs(name))
        return found

    def key_of(self, folder: Path) -> Key:
        return (folder.parent.parent.name, folder.parent.name, folder.name)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Register built-ins and entry points, read ``routes.toml``, load every version."""
        self.host.load_builtins()
        self.host.load_entry_points()
        self.reload_routes_file()
        folders = self.discover()
        # Module plugins first: one of them may provide a backend a declarative runner uses.
        with_module: list[Path] = []
        declarative: list[Path] = []
        for folder in folders:
            (declarative if _is_declarative(folder) else with_module).append(folder)
        for batch in (with_module, declarative):
            await asyncio.gather(*(self.load(folder) for folder in batch))
        self.started = True
        log.info("registry_started", versions=len(self.records), routes=len(self.routes.entries))

    async def load(self, folder: Path) -> VersionRecord:
        """Load (or reload) the version in ``folder``; a failure keeps what was serving."""
        key = self.key_of(folder)
        record = self.records.get(key)
        if record is None:
            kind: PluginType = key[0]  # type: ignore[assignment]  # discover() yields only PLUGIN_TYPES
            record = self.records[key] = VersionRecord(kind, key[1], key[2], folder)
            self._rebuild()
        async with record.lock:
            bound = log.bind(plugin=record.label)
            try:
                new = await self.loader.load(folder)
            except PlugserveError as exc:
                record.last_error = exc.message
                if record.current is None:
                    record.state = "failed"
                bound.error(
                    "plugin_load_failed",
                    error=exc.message,
                    keeps_serving=record.current is not None,
                )
                self._rebuild()
                return record
            old = record.current
            record.current, record.state, record.last_error = new, "ready", None
            self._rebuild()
            bound.info("plugin_ready", reloaded=old is not None)
            if old is not None:
                await self._retire(record, old)
        return record

    async def unload(self, key: Key) -> VersionRecord:
        """Stop routing to a version, drain it, release it and forget its record."""
        record = self.records.get(key)
        if record is None:
            raise NotFound(f"no plugin {key[0]}/{key[1]}@{key[2]}")
        async with record.lock:
            old, record.current = record.current, None
            record.state = "draining"
            self._rebuild()
            if old is not None:
                await self._retire(record, old)
            record.state = "unloaded"
            if self.records.get(key) is record:
                del self.records[key]
            self._rebuild()
        log.info("plugin_unloaded", plugin=record.label)
        return record

    async def close(self) -> None:
        """Unload everything (at shutdown)."""
        await asyncio.gather(*(self.unload(key) for key in list(self.records)))

    async def _retire(self, record: VersionRecord, old: LoadedPlugin) -> None:
        record.draining.append(old)
        try:
            if not await old.wait_idle(self.drain_timeout):
                log.warning(
                    "drain_timeout",
                    plugin=record.label,
                    in_flight=old.in_flight,
                    timeout_s=self.drain_timeout,
                )
            await self.loader.release(old)
        finally:
            record.draining.remove(old)
        del old
        gc.collect()

    # -- routes ------------------------------------------------------------------------

    def reload_routes_file(self) -> bool:
        """Re-read ``routes.toml``; an invalid file keeps the previous routes and says why."""
        try:
            self.file_routes = load_routes_file(self.routes_file)
        except RoutesFileError as exc:
            self.routes_file_error = exc.message
            log.error("routes_file_invalid", error=exc.message)
            return False
        self.routes_file_error = None
        self._rebuild()
        return True

    def _rebuild(self) -> None:
        # One assignment: a request sees the old table or the new one, never a mix.
        self.routes = build_route_table(self.records.values(), self.file_routes)

    # -- views -------------------------------------------------------------------------

    def plugins(self) -> list[VersionRecord]:
        return sorted(
            self.records.values(),
            key=lambda r: (
                PLUGIN_TYPES.index(r.type),
                r.name,
                r.sort_version is not None,
                r.sort_version or Version(0, 0, 0),
                r.version,
            ),
        )


def _subdirs(folder: Path) -> Iterable[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and not is_ignored_name(p.name))


def _is_declarative(folder: Path) -> bool:
    """A plugin without a module; a broken manifest counts as not (it fails on load anyway)."""
    try:
        return load_manifest(folder).module is None
    except PlugserveError:
        return False
