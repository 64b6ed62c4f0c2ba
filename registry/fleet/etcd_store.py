"""Fleet mode: the runtime route table in etcd, shared by every replica.

Keys under the prefix (``etcd://host:port/<prefix>``):

- ``<prefix>/routes/<route>``: a route entry as JSON, the shape of a
  ``routes.toml`` entry. Written by ``PUT``/``DELETE /admin/routes/{route}`` on any
  replica, as a compare-and-swap on the key's revision.
- ``<prefix>/replicas/<id>``: each replica's record (address, ready plugin
  versions), under a lease: it vanishes when the replica stops renewing it
  (:class:`Membership`).
- ``<prefix>/rollouts/``: who decides the rollouts, and the figures they decide
  from (:class:`RolloutDecider`).

Each replica reads the prefix, then watches it from the next revision on and
applies each watch response in one table rebuild. When etcd cannot be reached
it keeps serving the last table, reports it (readiness details, metrics,
``GET /admin/fleet``) and retries; on return it reads everything again and
watches on, so it catches up whatever it missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import unquote, urlsplit

import structlog

from plugserve.registry.errors import ConfigError, Conflict, NotFound, Unavailable
from plugserve.registry.fleet.etcd import EtcdClient, EtcdError, KeyValue, WatchBatch
from plugserve.registry.fleet.etcd_values import json_or_text, shown
from plugserve.registry.fleet.membership import Membership
from plugserve.registry.fleet.rollout_decider import RolloutDecider
from plugserve.registry.fleet.route_keys import RouteKeys
from plugserve.registry.fleet.route_store import Replica, RouteStore, RouteTarget, describe_entries
from plugserve.registry.routing.figures import WindowFigures
from plugserve.registry.routing.route_specs import RouteSpec

log = structlog.get_logger("plugserve.fleet")

DEFAULT_PREFIX = "/plugserve"


@dataclass(frozen=True)
class EtcdLocation:
    """``etcd://[user[:password]@]host:port[,host:port...]/prefix`` (``etcds://``: TLS).

    The password is better given apart from the URL (``PLUGSERVE_ETCD_PASSWORD``);
    :attr:`shown` is the URL without it, for logs.
    """

    endpoints: tuple[str, ...]
    prefix: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, url: str, password: str | None = None) -> EtcdLocation:
        try:
            parts = urlsplit(url)
        except ValueError as exc:  # e.g. an unclosed IPv6 bracket
            raise ConfigError(f"registry: not a URL: {exc}") from None
        if parts.scheme not in ("etcd", "etcds") or not parts.netloc:
            raise ConfigError("registry: expected etcd://[user@]host:port[,host:port]/prefix")
        userinfo, _, hostlist = parts.netloc.rpartition("@")
        username, _, in_url = userinfo.partition(":")
        http = "https" if parts.scheme == "etcds" else "http"
        hosts = [h.strip() for h in hostlist.split(",") if h.strip()]
        if not hosts:
            raise ConfigError("registry: no etcd host:port in the URL")
        prefix = "/" + parts.path.strip("/") if parts.path.strip("/") else DEFAULT_PREFIX
        return cls(
            tuple(f"{http}://{h}" for h in hosts),
            prefix,
            unquote(username) or None,
            password or unquote(in_url) or None,
        )

    @property
    def shown(self) -> str:
        user = f"{self.username}@" if self.username else ""
        hosts = ",".join(e.split("://", 1)[1] for e in self.endpoints)
        scheme = "etcds" if self.endpoints[0].startswith("https") else "etcd"
        return f"{scheme}://{user}{hosts}{self.prefix}"


class EtcdRouteStore(RouteStore):
    """Runtime routes kept in etcd and watched; this replica published under a lease
    (:attr:`members`), and its part in the fleet's rollouts (:attr:`decider`)."""

    mode = "etcd"

    def __init__(
        self,
        registry: RouteTarget,
        replica: Replica,
        location: EtcdLocation,
        lease_ttl_s: int = 10,
        startup_wait_s: float = 5.0,
    ) -> None:
        super().__init__(registry, replica)
        self.location = location
        self.client = EtcdClient(
            location.endpoints, username=location.username, password=location.password
        )
        self.lease_ttl_s = max(2, lease_ttl_s)
        self.startup_wait_s = startup_wait_s
        self.connected = False
        self.synced = asyncio.Event()
        self.disconnected_since: float | None = time.time()
        self.last_error: str | None = None
        self.disconnects = 0
        self.synced_count = 0
        self.apply_errors = 0
        """Keys or rebuilds whose application raised (a bug, logged with its traceback)."""
        self._seen: dict[bytes, int] = {}  # key -> revision of the last change applied
        self._task: asyncio.Task[None] | None = None
        self.publishing = False
        """Whether this replica's rollout figures are in etcd (an empty set is written once)."""
        self.log = log.bind(replica=replica.id, prefix=location.prefix)
        self.members = Membership(
            self.client, replica, registry, location.prefix, self.lease_ttl_s, self.log
        )
        self.decider = RolloutDecider(self.client, self.members, location.prefix, self.log)
        self.invalid: dict[str, dict[str, Any]] = {}
        """Route keys whose value is not a valid entry: revision and reason, by route."""
        self.keys = RouteKeys(location.prefix, self.log, self.invalid)

    @property
    def replicas(self) -> dict[str, dict[str, Any]]:
        """Every replica's record, by id (:attr:`Membership.replicas`)."""
        return self.members.replicas

    @property
    def invalid_replicas(self) -> dict[str, dict[str, Any]]:
        """Replica keys whose value is not a replica record (:attr:`Membership.invalid`)."""
        return self.members.invalid

    # -- lifetime ----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, and give the first sync ``startup_wait_s`` before serving without it."""
        self.registry.listeners.append(self.members.on_lifecycle)
        self._task = asyncio.create_task(self._run(), name="plugserve-fleet")
        try:
            await asyncio.wait_for(self.synced.wait(), self.startup_wait_s)
        except TimeoutError:
            self.log.warning(
                "fleet_not_synced", error=self.last_error, waited_s=self.startup_wait_s
            )

    async def close(self) -> None:
        if self.members.on_lifecycle in self.registry.listeners:
            self.registry.listeners.remove(self.members.on_lifecycle)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.members.lease and self.connected:
            # Leave the fleet at once rather than when the lease runs out.
            with contextlib.suppress(EtcdError):
                await self.client.revoke(self.members.lease)
        await self.client.close()

    @property
    def ready(self) -> bool:
        """Ready once the fleet's table was read; an outage after that keeps it ready."""
        return self.synced.is_set()

    def health(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "registry": self.location.shown,
            "prefix": self.location.prefix,
            "connected": self.connected,
            "synced": self.synced.is_set(),
            "revision": self.revision,
            "disconnected_since": self.disconnected_since,
            "last_error": self.last_error,
            "disconnects": self.disconnects,
            "apply_errors": self.apply_errors,
        }

    async def _run(self) -> None:
        """Sessions one after another; retries back off from 0.1 s to 0.5 s while etcd is away."""
        backoff = 0.1
        while True:
            synced_before = self.synced_count
            try:
                await self._session()
            except EtcdError as exc:
                self._lost(str(exc))
            except Exception as exc:  # a bug here must not end the fleet loop
                self.log.exception("fleet_session_failed")
                self._lost(repr(exc))
            backoff = 0.1 if self.synced_count > synced_before else min(backoff * 2, 0.5)
            await asyncio.sleep(backoff)

    def _lost(self, error: str) -> None:
        if self.connected:
            self.disconnects += 1
            self.disconnected_since = time.time()
            self.log.warning("fleet_disconnected", error=error, serving_revision=self.revision)
        self.connected = False
        self.last_error = error

    async def _session(self) -> None:
        """Read everything, publish this replica, then follow the watch until it breaks."""
        revision, kvs = await self.client.range_prefix(self.location.prefix + "/")
        self._load_snapshot(revision, kvs)
        await self.members.join()
        was = self.disconnected_since
        self.connected, self.disconnected_since, self.last_error = True, None, None
        self.synced.set()
        self.synced_count += 1
        self.log.info(
            "fleet_synced",
            revision=revision,
            routes=len(self.registry.runtime_routes),
            replicas=len(self.replicas),
            offline_s=None if was is None else round(time.time() - was, 3),
        )
        watch = _follow(self.client, self.location.prefix + "/", revision + 1, self._apply)
        await _first_to_fail([watch, self.members.keepalive(), self.members.publisher()])

    # -- applying etcd's state ---------------------------------------------------------
    #
    # Every value under the prefix is outside data: anyone with write access to etcd
    # can put anything there. Whatever a key holds, applying it never raises: a bad
    # route entry or replica record becomes an ``invalid`` entry with its reason,
    # and every other key applies as usual.

    def _load_snapshot(self, revision: int, kvs: Iterable[KeyValue]) -> None:
        """Everything under the prefix, as read at ``revision``: replaces what we had."""
        self._seen = {}
        invalid_replicas = self.members.reset()
        routes = dict(self.registry.runtime_routes)
        present = set()
        for kv in kvs:
            self._seen[kv.key] = kv.mod_revision
            name = self._change_safely(routes, kv, deleted=False, was=invalid_replicas)
            if name is not None:
                present.add(name)
        for name in [n for n in routes if n not in present]:
            del routes[name]
        for name in [n for n in self.invalid if n not in present]:
            del self.invalid[name]
        self.revision = revision
        self._set_routes(routes)

    def _apply(self, batch: WatchBatch) -> None:
        """One watch response: every change in it lands in one table rebuild."""
        routes = dict(self.registry.runtime_routes)
        changed = False
        for event in batch.events:
            kv = event.kv
            revision = kv.mod_revision or batch.revision
            if revision <= self._seen.get(kv.key, 0):
                continue  # already applied (our own write)
            self._seen[kv.key] = revision
            deleted = event.kind == "DELETE"
            changed |= self._change_safely(routes, kv, deleted=deleted) is not None
        self.revision = max(self.revision, batch.revision)
        if changed:
            self._set_routes(routes)
            self.log.info("fleet_routes_applied", revision=batch.revision, routes=sorted(routes))

    def _set_routes(self, routes: dict[str, RouteSpec]) -> None:
        """Hand the registry the runtime layer; a failed rebuild is logged, never a disconnect."""
        try:
            self.registry.set_runtime_routes(routes)
        except Exception:  # a bug in the rebuild must not take the replica off the fleet
            self.apply_errors += 1
            self.log.exception("fleet_routes_rebuild_failed", routes=sorted(routes))

    def _change_safely(
        self,
        routes: dict[str, RouteSpec],
        kv: KeyValue,
        deleted: bool,
        was: dict[str, dict[str, Any]] | None = None,
    ) -> str | None:
        """Apply one key to ``routes`` (or the replica list): the route name if a route; a
        bug in applying one key is confined to that key."""
        try:
            if kv.key.startswith(self.members.key_prefix):
                replica_id = shown(kv.key[len(self.members.key_prefix) :])
                self.members.change(replica_id, kv, deleted, was)
                return None
            return self.keys.change(routes, kv, deleted)
        except Exception as exc:
            self.apply_errors += 1
            self.log.exception("fleet_key_failed", key=shown(kv.key), revision=kv.mod_revision)
            name = self.keys.name_of(kv.key)
            if name is None:
                return None
            self.keys.mark_invalid(name, kv.mod_revision, f": could not be applied: {exc!r}")
            return name

    def _record(self, name: str, spec: RouteSpec | None, revision: int) -> None:
        """Apply our own successful write now (read-your-writes); the watch then skips it."""
        key = (self.keys.prefix + name).encode()
        if revision <= self._seen.get(key, 0):
            return
        self._seen[key] = revision
        routes = dict(self.registry.runtime_routes)
        if spec is None:
            routes.pop(name, None)
        else:
            routes[name] = spec
        self.invalid.pop(name, None)
        self._set_routes(routes)

    # -- writes ------------------------------------------------------------------------

    def current_revision(self, name: str) -> int:
        if name in self.invalid:
            return int(self.invalid[name]["revision"])
        return super().current_revision(name)

    async def _swap(
        self, name: str, value: bytes | None, expected: int, as_decider: bool = False
    ) -> int:
        if not self.connected:
            raise Unavailable(
                f"the fleet registry is unreachable ({self.last_error}): route changes wait "
                "for it; the last route table keeps serving",
                fleet=self.health(),
            )
        held = self.decider.held() if as_decider else None
        try:
            done, revision, current = await self.client.put_if(
                self.keys.prefix + name, value, expected, held=held
            )
        except EtcdError as exc:
            raise Unavailable(f"the fleet registry failed the write: {exc}") from None
        if not done and as_decider and (current.mod_revision if current else 0) == expected:
            self.decider.leading = False
            raise Conflict(f"route {name!r}: this replica no longer decides its rollout")
        if not done:
            now = 0 if current is None else current.mod_revision
            raise Conflict(
                f"route {name!r} is at revision {now} in etcd, not {expected}: "
                "read it again and retry",
                revision=now,
                current=None if current is None else json_or_text(current.value),
            )
        return revision

    async def put(
        self, spec: RouteSpec, if_revision: int | None = None, as_decider: bool = False
    ) -> RouteSpec:
        expected = self.current_revision(spec.name) if if_revision is None else if_revision
        value = json.dumps(spec.as_entry()).encode()
        revision = await self._swap(spec.name, value, expected, as_decider)
        stored = replace(spec, source="etcd", revision=revision)
        self._record(spec.name, stored, revision)
        self.log.info("fleet_route_put", route=spec.name, revision=revision)
        return stored

    async def delete(self, name: str, if_revision: int | None = None) -> int:
        expected = self.current_revision(name) if if_revision is None else if_revision
        if expected == 0:
            raise NotFound(f"route {name!r} has no entry in the fleet registry to delete")
        revision = await self._swap(name, None, expected)
        self._record(name, None, revision)
        self.log.info("fleet_route_deleted", route=name, revision=revision)
        return revision

    # -- rollouts (server/rollouts/controller.py) -----------------------------------------

    async def lead(self) -> bool:
        """Whether this replica decides the fleet's rollouts (:meth:`RolloutDecider.lead`)."""
        return await self.decider.lead(self.connected)

    async def publish_figures(self, windows: Mapping[str, tuple[str, WindowFigures]]) -> None:
        """This replica's rollout windows, for the decider (under its lease)."""
        if await self.decider.publish_figures(windows, self.connected):
            self.publishing = bool(windows)

    async def fleet_figures(
        self, keys: Mapping[str, str], merged: dict[str, WindowFigures]
    ) -> dict[str, WindowFigures]:
        """:meth:`RolloutDecider.fleet_figures`: every replica's figures, merged."""
        return await self.decider.fleet_figures(keys, merged)

    async def fleet(self) -> dict[str, Any]:
        replicas = [
            {**record, "self": replica_id == self.replica.id}
            for replica_id, record in sorted(self.replicas.items())
        ]
        return {
            **self.health(),
            "stale": not self.connected,
            "replica": self.replica.id,
            "replicas": replicas,
            "routes": describe_entries(self.registry.runtime_routes),
            "invalid": self.invalid,
            "invalid_replicas": self.invalid_replicas,
        }


async def _follow(
    client: EtcdClient, prefix: str, start_revision: int, apply: Callable[[WatchBatch], None]
) -> None:
    """Watch ``prefix`` from ``start_revision`` on, each response given to ``apply``."""
    async for batch in client.watch(prefix, start_revision):
        apply(batch)


async def _first_to_fail(work: list[Awaitable[None]]) -> None:
    """Run ``work`` together until one ends (they never end well): cancel the rest, re-raise."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        task.result()
    raise EtcdError("the fleet session ended")
