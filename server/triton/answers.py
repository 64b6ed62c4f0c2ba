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


SERVED_MARKER = "served"
"""The file in a supervisor's control folder that says the server has been ready."""


class Readiness:
    """Whether the server is ready: plugins loaded, not draining, its folders there, in
    fleet mode the fleet's route table read (by this process, or by a worker's supervisor,
    which follows the fleet for all its workers: ``fleet``), and, ``strict``, every route
    able to serve.

    Strict readiness holds at start-up: until every route can serve once, the server is not
    ready (Triton's ``--strict-readiness``), and the answer names each route that cannot
    and why. From then on a route that fails is reported, never a reason to be taken out
    of service: a failed reload keeps its previous version serving, and one bad new drop
    must not take every other route away. The registry marks that moment as its route
    table changes, for the whole server where several workers share its marker (a worker
    started again does not start over: :meth:`Registry.has_served`)."""

    def __init__(
        self,
        registry: Registry,
        drain: Drain,
        store: RouteStore,
        fleet: FleetHealth | None,
        strict: bool = True,
    ) -> None:
        self.registry = registry
        self.drain = drain
        self.store = store
        self.fleet = fleet
        self.strict = strict

    async def check(self) -> dict[str, Any]:
        """The readiness answer; :class:`Unavailable` (with why) when not ready."""
        registry = self.registry
        if not registry.started:
            raise Unavailable("the server is starting: plugins are still loading")
        if self.drain.draining:
            raise Unavailable("the server is shutting down")
        lost = registry.lost_roots
        if lost:
            # Loaded versions keep serving; what the folder will hold is unknown until it is back.
            raise Unavailable(
                "watched folder missing: " + ", ".join(sorted(str(p) for p in lost)),
                missing=sorted(str(p) for p in lost),
            )
        answer: dict[str, Any] = {"ready": True}
        store = self.store
        if self.fleet is not None or store.mode != "local":
            if self.fleet is not None:
                is_ready, details = await self.fleet()
            else:
                is_ready, details = store.ready, store.health()
            # A fleet replica: ready once it has read the fleet's route table; an etcd
            # outage after that keeps it ready (it serves the last table) and shows here.
            if not is_ready:
                raise Unavailable(
                    "the fleet's route table has not been read from etcd yet", fleet=details
                )
            answer["fleet"] = details
        unserved = registry.unserved
        if unserved and self.strict and not registry.has_served():
            raise Unavailable(
                f"{len(unserved)} route(s) cannot serve: "
                + "; ".join(f"{route}: {why}" for route, why in unserved.items())
                + " (strict_readiness = false starts without them)",
                unserved=unserved,
            )
        if unserved:
            answer["unserved"] = unserved
        return answer

    async def describe(self) -> dict[str, Any]:
        """The readiness answer, or why not (``/admin/status``)."""
        try:
            return await self.check()
        except Unavailable as exc:
            return {"ready": False, "why": exc.message, **exc.fields}

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
