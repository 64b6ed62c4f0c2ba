"""Typed application state: the keys of the parts every layer reads (settings, registry,
metrics, drain, route store). A part of one layer has its key beside its type (the data
plane's, the body reader's, Triton's repository, statistics and readiness, a worker's link)."""

from __future__ import annotations

from aiohttp import web

from plugserve.registry.fleet.route_store import RouteStore
from plugserve.registry.lifecycle.registry import Registry
from plugserve.server.config import Settings
from plugserve.server.runtime.metrics import Metrics
from plugserve.server.runtime.shutdown import Drain

SETTINGS = web.AppKey("settings", Settings)
REGISTRY = web.AppKey("registry", Registry)
METRICS = web.AppKey("metrics", Metrics)
DRAIN = web.AppKey("drain", Drain)
ROUTE_STORE = web.AppKey("route_store", RouteStore)
