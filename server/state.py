"""Typed application state: the keys under which the app holds its parts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from registry.cache import ResponseCache
from registry.registry import Registry
from registry.route_store import RouteStore
from server.bodies import Bodies
from server.config import Settings
from server.metrics import Metrics
from server.shutdown import Drain
from server.triton.repository import ModelRepository

if TYPE_CHECKING:
    from server.processes.link import WorkerLink

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
