"""The route table, kept in step with what it is built from: the versions' records (the
routes their runners declare), ``routes.toml`` (:class:`RoutesFile`) and the runtime layer
(admin API, etcd); each rebuild's rate-limit buckets, and what the table says of the routes
(runner versions waiting for their chain, routes that cannot serve, whether every route
has served once)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog

from plugserve.registry.errors import RoutesFileError
from plugserve.registry.execution.chain import Chain
from plugserve.registry.lifecycle.lifecycle_events import Key
from plugserve.registry.plugins.fingerprint import Fingerprinter
from plugserve.registry.ratelimit import SharedTokenBucket, TokenBucket, shared_bucket_path
from plugserve.registry.refs import PLUGIN_TYPES
from plugserve.registry.routing.records import VersionRecord
from plugserve.registry.routing.route_specs import ROUTES_FILE, RouteSpec, load_routes_file
from plugserve.registry.routing.routes import RouteTable, build_route_table
from plugserve.registry.versions import Version

log = structlog.get_logger("plugserve.registry")


class RoutesFile:
    """``routes.toml`` at ``path``: its routes as last read valid, or why it is invalid
    now; ``applied`` is called once valid routes were read."""

    def __init__(
        self, path: Path, fingerprinter: Fingerprinter, applied: Callable[[], None]
    ) -> None:
        self.path = path
        self.fingerprinter = fingerprinter
        self.applied = applied
        self.routes: dict[str, RouteSpec] = {}
        self.error: str | None = None
        self._fingerprint: str | None = None
        self._reading = asyncio.Lock()
        """One read of ``routes.toml`` at a time: an older read never lands after a newer."""

    async def sync(self) -> str:
        """Re-read ``routes.toml`` if its content changed: unchanged, applied or invalid.

        Its digest and its parse (of at most 16 MiB) cost as much as the file is
        long: both run on a thread, and the event loop only applies the result.
        The content counts as seen only once it has been judged, so a read that
        did not finish is tried again by the next rescan.
        """
        async with self._reading:
            read = await asyncio.to_thread(self._read, self._fingerprint)
            if read is None:
                return "unchanged"
            fingerprint, parsed = read
            applied = self._apply(parsed)
            self._fingerprint = fingerprint
            return "applied" if applied else "invalid"

    async def reload(self) -> bool:
        """Re-read ``routes.toml`` whether or not it changed (on a thread, as :meth:`sync`
        does); an invalid file keeps the previous routes and says why (:attr:`error`: in
        ``GET /admin/routes`` and the log)."""
        async with self._reading:
            return self._apply(await asyncio.to_thread(self._parse))

    def _read(self, seen: str | None) -> tuple[str, dict[str, RouteSpec] | RoutesFileError] | None:
        """``routes.toml``'s digest and parse, or ``None`` when its digest is ``seen``
        (blocking)."""
        fingerprint = self.fingerprinter.file(self.path)
        if fingerprint == seen:
            return None
        return fingerprint, self._parse()

    def _parse(self) -> dict[str, RouteSpec] | RoutesFileError:
        """``routes.toml``'s routes, or why it is invalid (blocking)."""
        try:
            return load_routes_file(self.path)
        except RoutesFileError as exc:
            return exc

    def _apply(self, parsed: dict[str, RouteSpec] | RoutesFileError) -> bool:
        """Serve ``routes.toml``'s routes, or keep the previous ones and say why."""
        if isinstance(parsed, RoutesFileError):
            self.error = parsed.message
            log.error("routes_file_invalid", error=parsed.message)
            return False
        self.routes = parsed
        self.error = None
        self.applied()
        log.info("routes_file_applied", routes=sorted(self.routes))
        return True


class RouteKeeper:
    """The versions' records and the route table built from them and the route layers.

    Layers, lowest first: routes runners declare, ``routes.toml``, runtime entries.
    Each change to one rebuilds the table in one step (:meth:`_rebuild`).
    ``shared_buckets``: with several workers, the folder of the rate-limit state they
    share; ``served_marker``: with several workers, the file that says every route has
    served once, for the whole server.
    """

    def __init__(
        self,
        plugins_dir: Path,
        fingerprinter: Fingerprinter,
        shared_buckets: Path | None = None,
        served_marker: Path | None = None,
    ) -> None:
        self.records: dict[Key, VersionRecord] = {}
        self.routes = RouteTable()
        self.waiting: dict[tuple[str, str], tuple[str, ...]] = {}
        """What each ready runner version not yet eligible for its route waits for, by
        ``(route, name@version)``: the table's :meth:`RouteTable.waiting`, logged on change."""
        self.routes_toml = RoutesFile(plugins_dir / ROUTES_FILE, fingerprinter, self._rebuild)
        self.runtime_routes: Mapping[str, RouteSpec] = {}
        self.on_routes: list[Callable[[], None]] = []
        """Called after every rebuild of the route table."""
        self.buckets: dict[str, TokenBucket | SharedTokenBucket] = {}
        self.shared_buckets = shared_buckets
        """With several workers: the folder of the rate-limit state they share."""
        self.started = False
        self.closing = False
        self.unserved: dict[str, str] = {}
        """Each route that cannot serve, and why (:meth:`RouteTable.unserved`), once started."""
        self.served = False
        """Every route has served once since start (strict readiness holds until then)."""
        self.served_marker = served_marker
        """With several workers: the file that says so for the whole server."""

    @property
    def routes_file(self) -> Path:
        return self.routes_toml.path

    @property
    def file_routes(self) -> dict[str, RouteSpec]:
        """``routes.toml``'s routes, as last read valid."""
        return self.routes_toml.routes

    @property
    def routes_file_error(self) -> str | None:
        """Why ``routes.toml`` is invalid now, if it is (the previous routes serve)."""
        return self.routes_toml.error

    async def sync_routes_file(self) -> str:
        """:meth:`RoutesFile.sync`: unchanged, applied or invalid."""
        return await self.routes_toml.sync()

    async def reload_routes_file(self) -> bool:
        """:meth:`RoutesFile.reload`: whether the file was valid."""
        return await self.routes_toml.reload()

    def set_runtime_routes(self, routes: Mapping[str, RouteSpec]) -> None:
        """Replace the runtime layer (admin API, etcd) in one step: one table rebuild.

        A runtime entry wins over a ``routes.toml`` entry of the same name until it
        is deleted, whatever the file does meanwhile.
        """
        self.runtime_routes = dict(routes)
        self._rebuild()

    def _rebuild(self) -> None:
        # One assignment: a request sees the old table or the new one, never a mix.
        specs = {**self.file_routes, **self.runtime_routes}
        self.routes = build_route_table(self.records.values(), specs)
        self._note_waiting()
        if self.started and not self.closing:
            self._note_unserved()
        buckets = {}
        for name, entry in self.routes.entries.items():
            limit = entry.rate_limit
            if limit is not None:
                kept = self.buckets.get(name)
                if kept is not None and kept.limit == limit:
                    buckets[name] = kept
                elif self.shared_buckets is not None:
                    path = shared_bucket_path(self.shared_buckets, name, limit)
                    buckets[name] = SharedTokenBucket(limit, path)
                else:
                    buckets[name] = TokenBucket(limit)
        self.buckets = buckets
        for listener in self.on_routes:
            listener()

    def _note_waiting(self) -> None:
        """Log each runner version that starts waiting for its chain (or waits for something
        else), and each that stops waiting: its chain is whole and it serves its route.

        A warning once the registry has started; at start, while versions load side by
        side, a runner often waits a moment for its processors: info.
        """
        waiting = self.routes.waiting()
        note = log.warning if self.started else log.info
        for (route, runner), reasons in waiting.items():
            if self.waiting.get((route, runner)) != reasons:
                serving = self.routes.entries[route].default
                note(
                    "route_waiting",
                    route=route,
                    runner=runner,
                    waiting_for=list(reasons),
                    serving=serving.label if isinstance(serving, Chain) else None,
                )
        for route, runner in self.waiting.keys() - waiting.keys():
            entry = self.routes.entries.get(route)
            chain = entry.by_version.get(runner.rpartition("@")[2]) if entry else None
            if isinstance(chain, Chain):
                log.info("route_chain_whole", route=route, runner=runner, chain=chain.label)
        self.waiting = waiting

    def _note_unserved(self) -> None:
        """Log each route that cannot serve (at start, then as one starts or stops failing)."""
        unserved = self.routes.unserved()
        for route, why in unserved.items():
            if self.unserved.get(route) != why:
                log.warning("route_cannot_serve", route=route, why=why)
        for route in self.unserved.keys() - unserved.keys():
            if route in self.routes.entries:
                log.info("route_serves", route=route)
        self.unserved = unserved
        if not unserved and not self.served:
            self.served = True
            if self.served_marker is not None:
                with contextlib.suppress(OSError):  # readiness then stays this worker's own
                    self.served_marker.touch()

    def has_served(self) -> bool:
        """Whether every route has served once since start: here, or (with several
        workers) in another worker of this server, as :attr:`served_marker` says."""
        if not self.served and self.served_marker is not None:
            self.served = self.served_marker.exists()
        return self.served

    def plugins(self) -> list[VersionRecord]:
        """Every version's record, by type, name and version."""
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
