"""The v2 protocol's answers in no wire format, for its HTTP and gRPC front ends alike:
the server's metadata, its readiness, a route's model metadata, a result as named tensors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
from aiohttp import web

from plugserve.registry.errors import PluginError, Unavailable
from plugserve.registry.execution.chain import Chain
from plugserve.registry.fleet.route_store import RouteStore
from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.routing.routes import RouteTable
from plugserve.server import __version__
from plugserve.server.runtime.shutdown import Drain
from plugserve.server.triton.requests import as_tensor

EXTENSIONS = [
    "binary_tensor_data",
    "statistics",
    "classification",
    "model_repository",
    "model_configuration",
    "system_shared_memory",
]
"""Triton's extensions this server speaks, by Triton's names."""

NAME = "plugserve"

FleetHealth = Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]
"""Whether the fleet's route table has been read, and its sync state."""


def server_metadata() -> dict[str, Any]:
    return {"name": NAME, "version": __version__, "extensions": EXTENSIONS}


class Readiness:
    """Whether the server is ready: plugins loaded, not draining, its folders there, and
    in fleet mode the fleet's route table read (by this process, or by a worker's
    supervisor, which follows the fleet for all its workers: ``fleet``)."""

    def __init__(
        self, registry: Registry, drain: Drain, store: RouteStore, fleet: FleetHealth | None
    ) -> None:
        self.registry = registry
        self.drain = drain
        self.store = store
        self.fleet = fleet

    async def check(self) -> dict[str, Any]:
        """The readiness answer; :class:`Unavailable` (with why) when not ready."""
        if not self.registry.started:
            raise Unavailable("the server is starting: plugins are still loading")
        if self.drain.draining:
            raise Unavailable("the server is shutting down")
        lost = self.registry.lost_roots
        if lost:
            # Loaded versions keep serving; what the folder will hold is unknown until it is back.
            raise Unavailable(
                "watched folder missing: " + ", ".join(sorted(str(p) for p in lost)),
                missing=sorted(str(p) for p in lost),
            )
        store = self.store
        if self.fleet is not None:
            is_ready, details = await self.fleet()
        elif store.mode == "local":
            return {"ready": True}
        else:
            is_ready, details = store.ready, store.health()
        # A fleet replica: ready once it has read the fleet's route table; an etcd
        # outage after that keeps it ready (it serves the last table) and shows here.
        if not is_ready:
            raise Unavailable(
                "the fleet's route table has not been read from etcd yet", fleet=details
            )
        return {"ready": True, "fleet": details}

    async def ready(self) -> bool:
        try:
            await self.check()
        except Unavailable:
            return False
        return True


def metadata(routes: RouteTable, chain: Chain) -> dict[str, Any]:
    """A route's model metadata: its versions, platform, chain and tensors."""
    backend = chain.runner.manifest.runner.backend if chain.runner.manifest.runner else None
    return {
        "name": chain.route,
        "versions": routes.entries[chain.route].versions,
        "platform": backend or "python",
        "chain": chain.describe(),
        **chain.metadata(),
    }


def named_outputs(chain: Chain, result: Any) -> dict[str, np.ndarray]:
    """The chain's result as named tensors; anything else is the last stage's fault."""
    if type(result) is not dict and not isinstance(result, Mapping):  # a dict: no ABC check
        last = chain.stages[-1]
        raise PluginError(
            last.label,
            TypeError(f"returned {type(result).__name__}; v2 needs a dict of named tensors"),
        )
    try:
        return {str(name): as_tensor(str(name), value) for name, value in result.items()}
    except (TypeError, ValueError) as exc:
        raise PluginError(chain.stages[-1].label, exc) from None


READINESS = web.AppKey("readiness", Readiness)
"""Whether the server is ready (a fleet replica: the fleet's table read)."""
