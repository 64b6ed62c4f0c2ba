"""Typed application state: the keys under which the app holds its parts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from plugserve.registry.cache import ResponseCache
from plugserve.registry.registry import Registry
from plugserve.registry.route_store import RouteStore
from plugserve.server.bodies import Bodies
from plugserve.server.config import Settings
from plugserve.server.metrics import Metrics
from plugserve.server.shutdown import Drain
from plugserve.server.triton.repository import ModelRepository

if TYPE_CHECKING:
    from plugserve.server.processes.link import WorkerLink

SETTINGS = web.AppKey("settings", Settings)
REGISTRY = web.AppKey("registry", Registry)
METRICS = web.AppKey("metrics", Metrics)
DRAIN = web.AppKey("drain", Drain)
ROUTE_STORE = web.AppKey("route_store", RouteStore)
BODIES = web.AppKey("bodies", Bodies)
RESPONSE_CACHE = web.AppKey("response_cache", ResponseCache)
REPOSITORY: web.AppKey[ModelRepository] = web.AppKey("repository")
"""Triton's model repository extension: this registry's, or through the supervisor."""
WORKER: web.AppKey[WorkerLink] = web.AppKey("worker")
"""Set in a worker among several: its link to the supervisor (server/processes/link.py)."""
