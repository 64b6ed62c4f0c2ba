"""Who decides the fleet's rollouts (server/rollouts/controller.py), and from what: the
decider key (``<prefix>/rollouts/decider``), held under one replica's lease, and each
replica's rollout figures (``<prefix>/rollouts/figures/<id>``), written under its own."""

from __future__ import annotations

import json
from collections.abc import Mapping

from structlog.typing import FilteringBoundLogger

from plugserve.registry.fleet.etcd import EtcdClient, EtcdError, KeyValue
from plugserve.registry.fleet.etcd_values import outside_json, reason_of, shown
from plugserve.registry.fleet.membership import Membership
from plugserve.registry.routing.figures import WindowFigures, parse_windows


class RolloutDecider:
    """This replica's part in the fleet's rollouts, under its lease (``members``)."""

    def __init__(
        self, client: EtcdClient, members: Membership, prefix: str, log: FilteringBoundLogger
    ) -> None:
        self.client = client
        self.members = members
        self.log = log
        self.prefix = f"{prefix}/rollouts/"
        self.key = self.prefix + "decider"
        self.leading = False
        """Whether this replica held the rollout decider lease when it last looked."""
        self._published: tuple[int, bytes] | None = None
        self._bad_figures: set[tuple[bytes, int]] = set()

    def held(self) -> tuple[str, bytes, int]:
        """What a write as the decider requires: the decider key, held by this replica
        under its lease."""
        return (self.key, self.members.replica.id.encode(), self.members.lease)

    async def lead(self, connected: bool) -> bool:
        """Whether this replica decides the fleet's rollouts: it holds the decider key
        under its lease, taking it when no one does (``connected``: to etcd). The key goes
        with the lease, so a replica that stops hands the rollouts on within the lease's
        TTL."""
        leading = False
        members = self.members
        if connected and members.lease:
            mine = self.members.replica.id.encode()
            try:
                current = await self.client.get(self.key)
                if current is None or self._abandoned(current):
                    held = 0 if current is None else current.mod_revision
                    leading, _, _ = await self.client.put_if(
                        self.key, mine, held, lease=members.lease
                    )
                else:
                    leading = current.value == mine and current.lease == members.lease
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
        return not current.lease or self.members.leases.get(holder) != current.lease

    async def publish_figures(
        self, windows: Mapping[str, tuple[str, WindowFigures]], connected: bool
    ) -> bool:
        """Write this replica's rollout windows, for the decider (under its lease: they go
        with it; ``connected``: to etcd); whether they were written (not when nothing
        changed since the last write, or etcd cannot be reached)."""
        members = self.members
        if not connected or not members.lease:
            return False
        doc = {route: {"key": key, "figures": f.as_json()} for route, (key, f) in windows.items()}
        body = json.dumps(doc, sort_keys=True).encode()
        if self._published == (members.lease, body):
            return False  # nothing new since the last write: none made
        key = self.prefix + "figures/" + self.members.replica.id
        try:
            await self.client.put(key, body, lease=members.lease)
        except EtcdError as exc:
            self.log.warning("rollout_figures_not_published", error=str(exc))
            return False
        self._published = (members.lease, body)
        return True

    async def fleet_figures(
        self, keys: Mapping[str, str], merged: dict[str, WindowFigures]
    ) -> dict[str, WindowFigures]:
        """``merged`` (this replica's) with every other replica's figures of the same windows
        (route -> window key) added."""
        prefix = self.prefix + "figures/"
        own = (prefix + self.members.replica.id).encode()
        _, kvs = await self.client.range_prefix(prefix)
        for kv in kvs:
            if kv.key == own:
                continue
            try:
                windows = parse_windows(outside_json(kv.value))
            except Exception as exc:  # outside data: one bad record is left out, said once
                if (kv.key, kv.mod_revision) not in self._bad_figures:
                    if len(self._bad_figures) > 1000:
                        self._bad_figures.clear()
                    self._bad_figures.add((kv.key, kv.mod_revision))
                    self.log.warning("rollout_figures_invalid", key=shown(kv.key),
                                     error=reason_of(exc))  # fmt: skip
                continue
            for route, (key, figures) in windows.items():
                if keys.get(route) == key:
                    merged.setdefault(route, WindowFigures()).add(figures)
        return merged
