"""The fleet's route keys, ``<prefix>/routes/<route>``: each one's value parsed into a
route entry, or, when it is not one, the route listed as invalid with its reason."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from structlog.typing import FilteringBoundLogger

from plugserve.registry.fleet.etcd import KeyValue
from plugserve.registry.fleet.etcd_values import clipped, outside_json, reason_of, shown
from plugserve.registry.routing.route_specs import RouteSpec, RouteSpecError, parse_route


class RouteKeys:
    """The route keys under ``prefix`` (the fleet's), and the invalid ones among them.

    Every value is outside data: anyone with write access to etcd can put anything
    there. Whatever a key holds, :meth:`change` never raises on it: a bad entry becomes
    an :attr:`invalid` one with its reason, logged once per bad value.
    """

    def __init__(
        self, prefix: str, log: FilteringBoundLogger, invalid: dict[str, dict[str, Any]]
    ) -> None:
        self.prefix = f"{prefix}/routes/"
        self.key_prefix = self.prefix.encode()
        self.log = log
        self.invalid = invalid
        """Route keys whose value is not a valid entry: revision and reason, by route (the
        route store's, which lists them)."""

    def name_of(self, key: bytes) -> str | None:
        """The route a key is the entry of; ``None`` for a key that is not a route's."""
        if not key.startswith(self.key_prefix):
            return None
        return shown(key[len(self.key_prefix) :])

    def change(self, routes: dict[str, RouteSpec], kv: KeyValue, deleted: bool) -> str | None:
        """Apply one key to ``routes``; the route name if a route key."""
        name = self.name_of(kv.key)
        if name is None:
            return None
        if deleted:
            routes.pop(name, None)
            self.invalid.pop(name, None)
            return name
        try:
            spec = parse_route(name, outside_json(kv.value), "etcd")
        except RouteSpecError as exc:
            reason = str(exc)
        except Exception as exc:  # parsing outside data: whatever it raises, the entry is bad
            reason = f": {reason_of(exc)}"
        else:
            self.invalid.pop(name, None)
            routes[name] = replace(spec, revision=kv.mod_revision)
            return name
        # Someone wrote a bad entry by hand: keep what served, say why.
        self.mark_invalid(name, kv.mod_revision, reason)
        return name

    def mark_invalid(self, name: str, revision: int, reason: str) -> None:
        """Record ``name`` as invalid at ``revision``; logged once per bad value."""
        error = clipped(f"routes.{name}{reason}")
        if self.invalid.get(name) != {"revision": revision, "error": error}:
            self.log.warning("fleet_route_invalid", route=name, revision=revision, error=error)
        self.invalid[name] = {"revision": revision, "error": error}
