"""Fleet mode: the runtime route table in etcd, shared by every replica.

Keys under the prefix (``etcd://host:port/<prefix>``):

- ``<prefix>/routes/<route>``: a route entry as JSON, the shape of a
  ``routes.toml`` entry. Written by ``PUT``/``DELETE /admin/routes/{route}`` on any
  replica, as a compare-and-swap on the key's revision.
- ``<prefix>/replicas/<id>``: each replica's record (address, ready plugin
  versions), under a lease: it vanishes when the replica stops renewing it.

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
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import unquote, urlsplit

import structlog

from plugserve.registry import checks
from plugserve.registry.errors import ConfigError, Conflict, NotFound, Unavailable
from plugserve.registry.fleet.etcd import EtcdClient, EtcdError, KeyValue, WatchBatch
from plugserve.registry.fleet.route_store import Replica, RouteStore, RouteTarget, describe_entries
from plugserve.registry.lifecycle.registry import LifecycleEvent
from plugserve.registry.routing.figures import WindowFigures, parse_windows
from plugserve.registry.routing.routes import RouteSpec, RouteSpecError, parse_route

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
    """Runtime routes kept in etcd and watched; this replica published under a lease."""

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
        self.routes_prefix = f"{location.prefix}/routes/"
        self.replicas_prefix = f"{location.prefix}/replicas/"
        self.connected = False
        self.synced = asyncio.Event()
        self.disconnected_since: float | None = time.time()
        self.last_error: str | None = None
        self.disconnects = 0
        self.synced_count = 0
        self.apply_errors = 0
        """Keys or rebuilds whose application raised (a bug, logged with its traceback)."""
        self.replicas: dict[str, dict[str, Any]] = {}
        self.invalid: dict[str, dict[str, Any]] = {}
        """Route keys whose value is not a valid entry: revision and reason, by route."""
        self.invalid_replicas: dict[str, dict[str, Any]] = {}
        """Replica keys whose value is not a replica record: revision and reason, by id."""
        self._routes_key = self.routes_prefix.encode()
        self._replicas_key = self.replicas_prefix.encode()
        self._seen: dict[bytes, int] = {}  # key -> revision of the last change applied
        self._lease = 0
        self.rollouts_prefix = f"{location.prefix}/rollouts/"
        self.publishing = False
        """Whether this replica's rollout figures are in etcd (an empty set is written once)."""
        self.leading = False
        """Whether this replica held the rollout decider lease when it last looked."""
        self._published: tuple[int, bytes] | None = None
        self._bad_figures: set[tuple[bytes, int]] = set()
        self._replica_leases: dict[str, int] = {}
        """The lease of each replica's record (a decider key must be under its holder's)."""
        self._publish = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.log = log.bind(replica=replica.id, prefix=location.prefix)

    # -- lifetime ----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, and give the first sync ``startup_wait_s`` before serving without it."""
        self.registry.listeners.append(self._on_lifecycle)
        self._task = asyncio.create_task(self._run(), name="plugserve-fleet")
        try:
            await asyncio.wait_for(self.synced.wait(), self.startup_wait_s)
        except TimeoutError:
            self.log.warning(
                "fleet_not_synced", error=self.last_error, waited_s=self.startup_wait_s
            )

    async def close(self) -> None:
        if self._on_lifecycle in self.registry.listeners:
            self.registry.listeners.remove(self._on_lifecycle)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._lease and self.connected:
            # Leave the fleet at once rather than when the lease runs out.
            with contextlib.suppress(EtcdError):
                await self.client.revoke(self._lease)
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
        self._lease = await self.client.grant(self.lease_ttl_s)
        await self._publish_self()
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
        watch = self._follow(revision + 1)
        await _first_to_fail([watch, self._keepalive(), self._publisher()])

    async def _follow(self, start_revision: int) -> None:
        async for batch in self.client.watch(self.location.prefix + "/", start_revision):
            self._apply(batch)

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            if await self.client.keepalive(self._lease) <= 0:
                self.log.warning("fleet_lease_expired", lease=self._lease)
                self._lease = await self.client.grant(self.lease_ttl_s)
                await self._publish_self()

    async def _publisher(self) -> None:
        while True:
            await self._publish.wait()
            await asyncio.sleep(0.05)  # one write for a burst of loads
            self._publish.clear()
            await self._publish_self()

    async def _publish_self(self) -> None:
        record = self.replica.describe(self.registry)
        key = self.replicas_prefix + self.replica.id
        await self.client.put(key, json.dumps(record).encode(), lease=self._lease)
        self._replica_leases[self.replica.id] = self._lease

    def _on_lifecycle(self, event: LifecycleEvent) -> None:
        if event.outcome in ("loaded", "reloaded", "unloaded", "failed"):
            self._publish.set()

    # -- applying etcd's state ---------------------------------------------------------
    #
    # Every value under the prefix is outside data: anyone with write access to etcd
    # can put anything there. Whatever a key holds, applying it never raises: a bad
    # route entry or replica record becomes an ``invalid`` entry with its reason,
    # and every other key applies as usual.

    def _load_snapshot(self, revision: int, kvs: Iterable[KeyValue]) -> None:
        """Everything under the prefix, as read at ``revision``: replaces what we had."""
        self._seen = {}
        self.replicas = {}
        self._replica_leases = {}
        invalid_replicas, self.invalid_replicas = self.invalid_replicas, {}
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
        """:meth:`_change`, with a bug in applying one key confined to that key."""
        try:
            return self._change(routes, kv, deleted, was)
        except Exception as exc:
            self.apply_errors += 1
            self.log.exception("fleet_key_failed", key=_shown(kv.key), revision=kv.mod_revision)
            if not kv.key.startswith(self._routes_key):
                return None
            name = _shown(kv.key[len(self._routes_key) :])
            self._invalid_route(name, kv.mod_revision, f": could not be applied: {exc!r}")
            return name

    def _change(
        self,
        routes: dict[str, RouteSpec],
        kv: KeyValue,
        deleted: bool,
        was: dict[str, dict[str, Any]] | None = None,
    ) -> str | None:
        """Apply one key to ``routes`` (or the replica list); the route name if a route."""
        if kv.key.startswith(self._replicas_key):
            self._replica_change(_shown(kv.key[len(self._replicas_key) :]), kv, deleted, was)
            return None
        if not kv.key.startswith(self._routes_key):
            return None
        name = _shown(kv.key[len(self._routes_key) :])
        if deleted:
            routes.pop(name, None)
            self.invalid.pop(name, None)
            return name
        try:
            spec = parse_route(name, _outside_json(kv.value), "etcd")
        except RouteSpecError as exc:
            reason = str(exc)
        except Exception as exc:  # parsing outside data: whatever it raises, the entry is bad
            reason = f": {_reason(exc)}"
        else:
            self.invalid.pop(name, None)
            routes[name] = replace(spec, revision=kv.mod_revision)
            return name
        # Someone wrote a bad entry by hand: keep what served, say why.
        self._invalid_route(name, kv.mod_revision, reason)
        return name

    def _invalid_route(self, name: str, revision: int, reason: str) -> None:
        """Record ``name`` as invalid at ``revision``; logged once per bad value."""
        error = _clipped(f"routes.{name}{reason}")
        if self.invalid.get(name) != {"revision": revision, "error": error}:
            self.log.warning("fleet_route_invalid", route=name, revision=revision, error=error)
        self.invalid[name] = {"revision": revision, "error": error}

    def _replica_change(
        self,
        replica_id: str,
        kv: KeyValue,
        deleted: bool,
        was: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """A replica's record: kept when it is one, else listed as invalid with its reason."""
        self.replicas.pop(replica_id, None)
        self._replica_leases.pop(replica_id, None)
        before = self.invalid_replicas.pop(replica_id, None)
        if was is not None:
            before = was.get(replica_id)
        if deleted:
            return
        try:
            self.replicas[replica_id] = _replica_record(kv.value)
            self._replica_leases[replica_id] = kv.lease
            return
        except Exception as exc:  # outside data, as for routes
            error = _clipped(f"replicas.{replica_id}: {_reason(exc)}")
        invalid = {"revision": kv.mod_revision, "error": error}
        if before != invalid:
            self.log.warning(
                "fleet_replica_invalid",
                replica_id=replica_id,
                revision=kv.mod_revision,
                error=error,
            )
        self.invalid_replicas[replica_id] = invalid

    def _record(self, name: str, spec: RouteSpec | None, revision: int) -> None:
        """Apply our own successful write now (read-your-writes); the watch then skips it."""
        key = (self.routes_prefix + name).encode()
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
        held = None
        if as_decider:
            held = (self.rollouts_prefix + "decider", self.replica.id.encode(), self._lease)
        try:
            done, revision, current = await self.client.put_if(
                self.routes_prefix + name, value, expected, held=held
            )
        except EtcdError as exc:
            raise Unavailable(f"the fleet registry failed the write: {exc}") from None
        if not done and as_decider and (current.mod_revision if current else 0) == expected:
            self.leading = False
            raise Conflict(f"route {name!r}: this replica no longer decides its rollout")
        if not done:
            now = 0 if current is None else current.mod_revision
            raise Conflict(
                f"route {name!r} is at revision {now} in etcd, not {expected}: "
                "read it again and retry",
                revision=now,
                current=None if current is None else _json_or_text(current.value),
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
        """Whether this replica decides the fleet's rollouts: it holds the decider key
        (``<prefix>/rollouts/decider``) under its lease, taking it when no one does. The key
        goes with the lease, so a replica that stops hands the rollouts on within the
        lease's TTL."""
        leading = False
        if self.connected and self._lease:
            key = self.rollouts_prefix + "decider"
            mine = self.replica.id.encode()
            try:
                current = await self.client.get(key)
                if current is None or self._abandoned(current):
                    held = 0 if current is None else current.mod_revision
                    leading, _, _ = await self.client.put_if(key, mine, held, lease=self._lease)
                else:
                    leading = current.value == mine and current.lease == self._lease
            except EtcdError as exc:
                self.log.warning("rollout_decider_unknown", error=str(exc))
        if leading != self.leading:
            self.log.info("rollout_decider" if leading else "rollout_decider_not")
        self.leading = leading
        return leading

    def _abandoned(self, current: KeyValue) -> bool:
        """Whether the decider key is no replica's to hold: not under the lease of the
        replica it names (written by hand, or by this replica under a lease it no longer
        has): the lease of a replica's record is the one its key must be under."""
        holder = current.value.decode("utf-8", errors="replace")
        return not current.lease or self._replica_leases.get(holder) != current.lease

    async def publish_figures(self, windows: Mapping[str, tuple[str, WindowFigures]]) -> None:
        """This replica's rollout windows, for the decider (under its lease: they go with it)."""
        if not self.connected or not self._lease:
            return
        doc = {route: {"key": key, "figures": f.as_json()} for route, (key, f) in windows.items()}
        body = json.dumps(doc, sort_keys=True).encode()
        if self._published == (self._lease, body):
            return  # nothing new since the last write: none made
        key = self.rollouts_prefix + "figures/" + self.replica.id
        try:
            await self.client.put(key, body, lease=self._lease)
        except EtcdError as exc:
            self.log.warning("rollout_figures_not_published", error=str(exc))
            return
        self._published = (self._lease, body)
        self.publishing = bool(doc)

    async def fleet_figures(
        self, keys: Mapping[str, str], merged: dict[str, WindowFigures]
    ) -> dict[str, WindowFigures]:
        """``merged`` (this replica's) with every other replica's figures of the same windows
        (route -> window key) added."""
        prefix = self.rollouts_prefix + "figures/"
        own = (prefix + self.replica.id).encode()
        _, kvs = await self.client.range_prefix(prefix)
        for kv in kvs:
            if kv.key == own:
                continue
            try:
                windows = parse_windows(_outside_json(kv.value))
            except Exception as exc:  # outside data: one bad record is left out, said once
                if (kv.key, kv.mod_revision) not in self._bad_figures:
                    if len(self._bad_figures) > 1000:
                        self._bad_figures.clear()
                    self._bad_figures.add((kv.key, kv.mod_revision))
                    self.log.warning("rollout_figures_invalid", key=_shown(kv.key),
                                     error=_reason(exc))  # fmt: skip
                continue
            for route, (key, figures) in windows.items():
                if keys.get(route) == key:
                    merged.setdefault(route, WindowFigures()).add(figures)
        return merged

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


MAX_REASON = 500
"""The longest reason kept for an invalid entry (a hostile value can make a long one)."""
MAX_NAME = 1000
"""The longest key name shown (in logs, and as the invalid entry's name)."""

_REPLICA_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "url": str,
    "started_at": (int, float),
    "updated_at": (int, float),
    "ready": list,
}


_BadValue = checks.ValueProblem
"""A value read from etcd that is not the JSON expected; the message says why."""


def _outside_json(raw: bytes) -> Any:
    """Strict JSON from etcd: UTF-8, finite numbers only. Raises :class:`_BadValue`."""
    return checks.parse_json(raw, strict=True)


def _replica_record(raw: bytes) -> dict[str, Any]:
    """A replica's record, its known fields checked; raises :class:`_BadValue`."""
    record = _outside_json(raw)
    if not isinstance(record, dict):
        raise _BadValue("", f"a replica record is a JSON object, not {type(record).__name__}")
    for key, kind in _REPLICA_FIELDS.items():
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise _BadValue("", f".{key}: missing or not {_kind_name(kind)}")
    if not all(isinstance(label, str) for label in record["ready"]):
        raise _BadValue("", ".ready: must be a list of strings")
    return {key: record[key] for key in _REPLICA_FIELDS}


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return "a number" if isinstance(kind, tuple) else f"a {kind.__name__}"


def _reason(exc: Exception) -> str:
    """An exception from parsing outside data, as a reason to show."""
    return str(exc) if isinstance(exc, _BadValue) else f"{type(exc).__name__}: {exc}"


def _clipped(text: str) -> str:
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def _shown(raw: bytes) -> str:
    """A key (or part of one) as text: UTF-8, other bytes shown as ``\\xff``; a long
    one cut at :data:`MAX_NAME` bytes (no valid route name is that long)."""
    if len(raw) > MAX_NAME:
        return raw[:MAX_NAME].decode("utf-8", errors="backslashreplace") + "..."
    return raw.decode("utf-8", errors="backslashreplace")


def _json_or_text(value: bytes) -> Any:
    """A value read from etcd, for a client: its JSON when it is strict JSON, else text."""
    try:
        return _outside_json(value)
    except _BadValue:
        return _clipped(value.decode("utf-8", errors="replace"))


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
