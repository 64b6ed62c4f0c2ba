"""The control plane under ``/admin/``: bearer-token protected, loopback-only without a token."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from plugserve.registry import checks
from plugserve.registry.errors import InvalidInput, NotFound, PluginLoadError, TooManyRequests
from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.refs import NAME_PATTERN, PLUGIN_TYPES, is_valid_name
from plugserve.registry.routing.route_specs import RouteSpec, RouteSpecError, parse_route
from plugserve.registry.versions import Version
from plugserve.server import __version__
from plugserve.server.http.auth import ADMIN_PREFIX, check_page_address
from plugserve.server.http.auth import admin_only as protected
from plugserve.server.http.bodies import BODIES, read_control
from plugserve.server.rollouts.controller import ACTIONS, ROLLOUTS, check_status, operate
from plugserve.server.state import METRICS, REGISTRY, ROUTE_STORE, SETTINGS
from plugserve.server.triton.answers import READINESS

PROFILING = web.AppKey("profiling", asyncio.Lock)
STARTED = web.AppKey("started", float)


async def list_plugins(request: web.Request) -> web.Response:
    """Every version's record; a ready runner version not yet eligible for a route (a stage
    of its chain is not ready) has ``waiting_for``: those stages, for every such route."""
    registry: Registry = request.app[REGISTRY]
    await registry.refresh_isolated()
    waiting: dict[str, list[str]] = {}
    for (_, runner), reasons in registry.waiting.items():
        listed = waiting.setdefault(f"runner/{runner}", [])
        listed += [reason for reason in reasons if reason not in listed]
    rows = []
    for record in registry.plugins():
        row = record.as_json()
        if record.label in waiting:
            row["waiting_for"] = waiting[record.label]
        rows.append(row)
    return web.json_response({"plugins": rows})


def described_routes(app: web.Application, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The route table's rows, each rollout with the figures of its window as last decided on."""
    controller = app.get(ROLLOUTS)
    specs = app[ROUTE_STORE].registry.runtime_routes
    for row in rows:
        spec = specs.get(row["name"])
        if "rollout" in row and controller is not None and spec is not None:
            row["rollout"].update(controller.describe(row["name"], spec.rollout) or {})
    return rows


async def list_routes(request: web.Request) -> web.Response:
    registry, store = request.app[REGISTRY], request.app[ROUTE_STORE]
    table = registry.routes
    return web.json_response(
        {
            "routes": described_routes(request.app, table.describe()),
            "errors": list(table.errors),
            "routes_file": {"path": str(registry.routes_file), "error": registry.routes_file_error},
            "runtime": {**store.health(), "invalid": store.invalid},
        }
    )


def if_match(request: web.Request) -> int | None:
    """The revision an ``If-Match`` header expects (``"0"``: the entry must not exist yet)."""
    raw = request.headers.get("If-Match")
    if raw is None:
        return None
    try:
        revision = int(raw.strip().strip('"'))
    except ValueError:
        revision = -1
    if not 0 <= revision < 2**63:
        raise InvalidInput('If-Match must be a route entry\'s revision, such as "12"')
    return revision


async def route_entry(request: web.Request) -> RouteSpec:
    """The route entry a ``PUT /admin/routes/{route}`` sends, checked whole."""
    name = route_name(request)
    try:
        bodies = request.app.get(BODIES)  # none in the supervisor: its workers read first
        body = await (read_control(request) if bodies is None else bodies.read_control(request))
        entry = checks.parse_json(body)
    except checks.ValueProblem as exc:
        raise InvalidInput(f"the body must be a JSON route entry: {exc}") from None
    try:
        return parse_route(name, entry, "admin")
    except RouteSpecError as exc:
        raise InvalidInput(f"routes.{name}{exc}") from None


def route_name(request: web.Request) -> str:
    name = request.match_info["route"]
    if not is_valid_name(name):
        raise InvalidInput(f"route name {checks.shown(name)} must match {NAME_PATTERN}")
    return name


def put_answer(stored: RouteSpec, described: dict[str, Any]) -> web.Response:
    return web.json_response(
        {"route": described, "entry": stored.as_entry(), "revision": stored.revision},
        headers={"ETag": f'"{stored.revision}"'},
    )


def delete_answer(name: str, revision: int, described: dict[str, Any] | None) -> web.Response:
    return web.json_response({"deleted": name, "revision": revision, "route": described})


async def put_route(request: web.Request) -> web.Response:
    """Set a route's runtime entry: the shape of a ``routes.toml`` entry, as JSON.

    Validated whole, then applied in one table rebuild (in fleet mode, written
    to etcd first, compare-and-swap on the entry's revision). 409 when the entry
    moved on since the revision expected (``If-Match``, else the one this server
    last saw).
    """
    spec = await route_entry(request)
    store = request.app[ROUTE_STORE]
    check_status(store.registry.runtime_routes.get(spec.name), spec)
    stored = await store.put(spec, if_match(request))
    return put_answer(stored, request.app[REGISTRY].routes.entries[spec.name].describe())


async def delete_route(request: web.Request) -> web.Response:
    """Remove a route's runtime entry: what ``routes.toml`` or its runner says applies again."""
    name = route_name(request)
    revision = await request.app[ROUTE_STORE].delete(name, if_match(request))
    entry = request.app[REGISTRY].routes.entries.get(name)
    return delete_answer(name, revision, None if entry is None else entry.describe())


async def get_rollout(request: web.Request) -> web.Response:
    """A route's rollout: its policy, status, decisions, and its window's figures."""
    name = route_name(request)
    entry = request.app[REGISTRY].routes.entries.get(name)
    if entry is None or entry.spec.rollout is None:
        raise NotFound(f"route {name!r} has no rollout")
    row = described_routes(request.app, [entry.describe()])[0]
    return web.json_response(
        {"route": name, "revision": entry.spec.revision, "rollout": row["rollout"]},
        headers={"ETag": f'"{entry.spec.revision}"'},
    )


async def rollout_action(request: web.Request) -> web.Response:
    """``pause``, ``resume`` or ``abort`` a route's rollout (body: optional
    ``{"reason": "..."}``); ``If-Match`` as for a route entry."""
    name = route_name(request)
    action = request.match_info["action"]
    if action not in ACTIONS:
        raise NotFound(f"no rollout action {checks.shown(action)}; known: {sorted(ACTIONS)}")
    reason = await action_reason(request)
    controller = request.app.get(ROLLOUTS)
    counted = None if controller is None else controller.counted
    store = request.app[ROUTE_STORE]
    stored = await operate(store, name, action, reason, if_match(request), counted)
    row = described_routes(request.app, [request.app[REGISTRY].routes.entries[name].describe()])
    return put_answer(stored, row[0])


async def action_reason(request: web.Request) -> str | None:
    """The ``reason`` of a rollout action's body (optional, as is the body)."""
    if not request.can_read_body:
        return None
    bodies = request.app.get(BODIES)  # none in the supervisor: its workers read first
    body = await (read_control(request) if bodies is None else bodies.read_control(request))
    if not body.strip():
        return None
    try:
        raw = checks.parse_json(body)
    except checks.ValueProblem as exc:
        raise InvalidInput(f"the body must be JSON: {exc}") from None
    if not isinstance(raw, dict) or set(raw) - {"reason"}:
        raise InvalidInput('the body is {"reason": "..."} or empty')
    reason = raw.get("reason")
    if reason is None:
        return None
    try:
        return checks.text(reason, "reason", max_length=1000)
    except checks.ValueProblem as exc:
        raise InvalidInput(f"reason: {exc.reason}") from None


async def fleet(request: web.Request) -> web.Response:
    """The replicas sharing this server's route table, what is ready on each, and the sync state."""
    return web.json_response(await request.app[ROUTE_STORE].fleet())


async def reload_all(request: web.Request) -> web.Response:
    """Rescan everything now; 200 whatever failed, listing the failures."""
    force = request.query.get("force", "false").lower() in ("1", "true", "yes")
    report = await request.app[REGISTRY].sync(force=force)
    return web.json_response(report.as_json())


def _version_key(request: web.Request) -> tuple[str, str, str]:
    """The ``{type}/{name}/{version}`` of the path, validated so it cannot leave the plugins dir."""
    kind, name, version = (request.match_info[k] for k in ("type", "name", "version"))
    if kind not in PLUGIN_TYPES:
        raise NotFound(f"unknown plugin type {kind!r}; types: {', '.join(PLUGIN_TYPES)}")
    if not is_valid_name(name):
        raise InvalidInput(f"plugin name {name!r} must match {NAME_PATTERN}")
    try:
        Version.parse(version)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    return kind, name, version


async def reload_version(request: web.Request) -> web.Response:
    """Reload one version, changed or not; 400 with the error when its load failed."""
    registry = request.app[REGISTRY]
    key = _version_key(request)
    folder = registry.folder_of(key)
    if not folder.is_dir():
        raise NotFound(f"no folder {folder.relative_to(registry.plugins_dir)} in the plugins dir")
    outcome = await registry.load(folder, explicit=True)
    record = registry.records[key]
    if outcome == "failed":
        raise PluginLoadError(record.last_error or "load failed", plugin=record.as_json())
    return web.json_response({"outcome": outcome, "plugin": record.as_json()})


async def unload_version(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    key = _version_key(request)
    outcome = await registry.unload(key)
    return web.json_response({"outcome": outcome, "plugin": registry.records[key].as_json()})


STATUS_PAGE = (Path(__file__).parent / "static" / "status.html").read_bytes()


async def status_page(request: web.Request) -> web.Response:
    """A small self-contained page (no external assets) that refreshes itself from /admin/status.

    With a token configured, open it as ``/admin/#token=<token>``: the fragment never
    leaves the browser, and the page sends it as a bearer token. With ``admin_port`` set
    it is served there only, as the data it shows.
    """
    check_page_address(request, request.app[SETTINGS])
    return web.Response(body=STATUS_PAGE, content_type="text/html")


async def status(request: web.Request) -> web.Response:
    """Plugins, routes and request counts per route: what the status page shows."""
    registry = request.app[REGISTRY]
    return web.json_response(
        {
            "version": __version__,
            "uptime_s": time.monotonic() - request.app[STARTED],
            "plugins": [r.as_json() for r in registry.plugins()],
            "routes": registry.routes.describe(),
            "readiness": await request.app[READINESS].describe(),
            "requests": request.app[METRICS].requests_by_route(),
            "fleet": request.app[ROUTE_STORE].health(),
            "memory": registry.budget.describe() if registry.budget is not None else None,
            "watch": {
                "enabled": request.app[SETTINGS].watch,
                "lost": [
                    {"path": str(path), "since": since}
                    for path, since in sorted(registry.lost_roots.items())
                ],
            },
        }
    )


MAX_PROFILE_S = 60.0


async def profile(request: web.Request) -> web.Response:
    """Sample the live server's event loop for ``seconds`` (pyinstrument) and return the profile.

    ``?format=html`` (default, a self-contained page) or ``speedscope`` (JSON for
    speedscope.app). One profile at a time: a second call meanwhile gets 429. With
    several workers, the worker that took the call is profiled; ``X-Plugserve-Pid``
    names it.
    """
    from pyinstrument import Profiler
    from pyinstrument.renderers import HTMLRenderer, SpeedscopeRenderer

    try:
        seconds = float(request.query.get("seconds", "5"))
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= MAX_PROFILE_S:
        raise InvalidInput(f"seconds must be a number in (0, {MAX_PROFILE_S:g}]")
    kind = request.query.get("format", "html")
    if kind not in ("html", "speedscope"):
        raise InvalidInput("format must be html or speedscope")
    if request.app[PROFILING].locked():
        raise TooManyRequests("a profile is being taken", retry_after_s=int(seconds) + 1)
    async with request.app[PROFILING]:
        profiler = Profiler(interval=0.001, async_mode="disabled")
        profiler.start()
        try:
            await asyncio.sleep(seconds)
        finally:
            session = profiler.stop()
    # Which process was profiled: with several workers, the one that took this call.
    headers = {"X-Plugserve-Pid": str(os.getpid())}
    if kind == "speedscope":
        return web.Response(
            # Every sample: speedscope filters and zooms itself, and pyinstrument's default
            # pruning (frames under 1 % of the samples) drops short request paths.
            text=SpeedscopeRenderer(processor_options={"filter_threshold": 0}).render(session),
            content_type="application/json",
            headers=headers,
        )
    return web.Response(
        text=HTMLRenderer().render(session), content_type="text/html", headers=headers
    )


def add_routes(app: web.Application, through: Handler | None = None) -> None:
    """The control plane; ``through`` answers every call but the profile and the page
    instead (a worker's supervisor, which answers for the whole server)."""
    app[PROFILING] = asyncio.Lock()
    app[STARTED] = time.monotonic()
    router = app.router

    def admin_only(handler: Handler) -> Handler:
        return protected(through or handler)

    router.add_get(ADMIN_PREFIX + "/plugins", admin_only(list_plugins))
    router.add_get(ADMIN_PREFIX + "/routes", admin_only(list_routes))
    router.add_put(ADMIN_PREFIX + "/routes/{route}", admin_only(put_route))
    router.add_delete(ADMIN_PREFIX + "/routes/{route}", admin_only(delete_route))
    router.add_get(ADMIN_PREFIX + "/routes/{route}/rollout", admin_only(get_rollout))
    router.add_post(ADMIN_PREFIX + "/routes/{route}/rollout/{action}", admin_only(rollout_action))
    router.add_get(ADMIN_PREFIX + "/fleet", admin_only(fleet))
    router.add_post(ADMIN_PREFIX + "/reload", admin_only(reload_all))
    version = ADMIN_PREFIX + "/plugins/{type}/{name}/{version}"
    router.add_post(version + "/reload", admin_only(reload_version))
    router.add_post(version + "/unload", admin_only(unload_version))
    router.add_post(ADMIN_PREFIX + "/profile", protected(profile))
    # The page is a static shell with nothing in it: its data comes from /admin/status.
    router.add_get(ADMIN_PREFIX + "/", status_page)
    router.add_get(ADMIN_PREFIX + "/status", admin_only(status))
