"""Typed application state: the keys under which the app holds its parts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from plugserve.registry.fleet.route_store import RouteStore
from plugserve.registry.lifecycle.registry import Registry
from plugserve.server.config import Settings
from plugserve.server.dataplane.cache import ResponseCache
from plugserve.server.dataplane.plane import DataPlane
from plugserve.server.http.bodies import Bodies
from plugserve.server.runtime.metrics import Metrics
from plugserve.server.runtime.shutdown import Drain
from plugserve.server.triton.answers import Readiness
from plugserve.server.triton.repository import ModelRepository
from plugserve.server.triton.shared_memory import Regions
from plugserve.server.triton.statistics import Statistics

if TYPE_CHECKING:
    from plugserve.server.processes.link import WorkerLink

SETTINGS = web.AppKey("settings", Settings)
REGISTRY = web.AppKey("registry", Registry)
METRICS = web.AppKey("metrics", Metrics)
DRAIN = web.AppKey("drain", Drain)
ROUTE_STORE = web.AppKey("route_store", RouteStore)
BODIES = web.AppKey("bodies", Bodies)
RESPONSE_CACHE = web.AppKey("response_cache", ResponseCache)
DATA_PLANE = web.AppKey("data_plane", DataPlane)
"""The request path every front end serves inference through (server/dataplane/)."""
REPOSITORY: web.AppKey[ModelRepository] = web.AppKey("repository")
"""Triton's model repository extension: this registry's, or through the supervisor."""
READINESS = web.AppKey("readiness", Readiness)
"""Whether the server is ready (a fleet replica: the fleet's table read)."""
STATISTICS: web.AppKey[Statistics] = web.AppKey("statistics")
"""Triton's statistics of the whole server: this process's, or through the supervisor."""
REGIONS = web.AppKey("shared_memory_regions", Regions)
"""The shared memory regions registered with this server (server/triton/shared_memory.py)."""
WORKER: web.AppKey[WorkerLink] = web.AppKey("worker")
"""Set in a worker among several: its link to the supervisor (server/processes/link.py)."""
