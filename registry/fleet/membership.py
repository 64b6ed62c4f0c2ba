"""A replica's membership of the fleet: its lease, its record under it
(``<prefix>/replicas/<id>``: address, ready plugin versions; it vanishes when the replica
stops renewing the lease), and every replica's record as read from etcd."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from structlog.typing import FilteringBoundLogger

from plugserve.registry.fleet.etcd import EtcdClient, KeyValue
from plugserve.registry.fleet.etcd_values import clipped, reason_of, replica_record
from plugserve.registry.fleet.route_store import Replica, RouteTarget
from plugserve.registry.lifecycle.lifecycle_events import LifecycleEvent


class Membership:
    """This replica's lease and record, and the fleet's replicas (``prefix``: the fleet's).

    The record is written again (one write for a burst of changes) after each load,
    reload, unload or failed load of a version (:meth:`on_lifecycle`, a listener of the
    registry), and when a lapsed lease is replaced.
    """

    def __init__(
        self,
        client: EtcdClient,
        replica: Replica,
        registry: RouteTarget,
        prefix: str,
        lease_ttl_s: int,
        log: FilteringBoundLogger,
    ) -> None:
        self.client = client
        self.replica = replica
        self.registry = registry
        self.lease_ttl_s = lease_ttl_s
        self.log = log
        self.prefix = f"{prefix}/replicas/"
        self.key_prefix = self.prefix.encode()
        self.lease = 0
        """This replica's lease (0: none granted yet)."""
        self.replicas: dict[str, dict[str, Any]] = {}
        self.invalid: dict[str, dict[str, Any]] = {}
        """Replica keys whose value is not a replica record: revision and reason, by id."""
        self.leases: dict[str, int] = {}
        """The lease of each replica's record (a decider key must be under its holder's)."""
        self._publish = asyncio.Event()

    async def join(self) -> None:
        """Take a lease and write this replica's record under it."""
        self.lease = await self.client.grant(self.lease_ttl_s)
        await self.publish()

    async def keepalive(self) -> None:
        """Renew the lease, a third of its TTL apart; a lapsed one is replaced (until
        cancelled, or an etcd error)."""
        while True:
            await asyncio.sleep(self.lease_ttl_s / 3)
            if await self.client.keepalive(self.lease) <= 0:
                self.log.warning("fleet_lease_expired", lease=self.lease)
                await self.join()

    async def publisher(self) -> None:
        """Write this replica's record again whenever :meth:`on_lifecycle` asks."""
        while True:
            await self._publish.wait()
            await asyncio.sleep(0.05)  # one write for a burst of loads
            self._publish.clear()
            await self.publish()

    async def publish(self) -> None:
        record = self.replica.describe(self.registry)
        key = self.prefix + self.replica.id
        await self.client.put(key, json.dumps(record).encode(), lease=self.lease)
        self.leases[self.replica.id] = self.lease

    def on_lifecycle(self, event: LifecycleEvent) -> None:
        if event.outcome in ("loaded", "reloaded", "unloaded", "failed"):
            self._publish.set()

    def reset(self) -> dict[str, dict[str, Any]]:
        """Forget every replica's record, before a read of them all; returns the invalid
        records as they were (a record still invalid is not logged again)."""
        self.replicas = {}
        self.leases = {}
        was, self.invalid = self.invalid, {}
        return was

    def change(
        self,
        replica_id: str,
        kv: KeyValue,
        deleted: bool,
        was: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """A replica's record: kept when it is one, else listed as invalid with its reason."""
        self.replicas.pop(replica_id, None)
        self.leases.pop(replica_id, None)
        before = self.invalid.pop(replica_id, None)
        if was is not None:
            before = was.get(replica_id)
        if deleted:
            return
        try:
            self.replicas[replica_id] = replica_record(kv.value)
            self.leases[replica_id] = kv.lease
            return
        except Exception as exc:  # outside data, as for routes
            error = clipped(f"replicas.{replica_id}: {reason_of(exc)}")
        invalid = {"revision": kv.mod_revision, "error": error}
        if before != invalid:
            self.log.warning(
                "fleet_replica_invalid",
                replica_id=replica_id,
                revision=kv.mod_revision,
                error=error,
            )
        self.invalid[replica_id] = invalid
