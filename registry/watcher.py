"""Watch the plugins directory, the model repository and ``routes.toml``; apply changes live.

Events are only hints. Each one names a scope (one version folder, one model,
the routes file, or a rescan); a scope is applied once it has been quiet for
the debounce time, and what it does is decided by content fingerprints, so a
touch, a junk file or a duplicate event loads nothing. A failure never stops
the watcher: the next change is tried again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog
from watchfiles import Change, DefaultFilter, awatch

from registry.refs import PLUGIN_TYPES, is_ignored_name
from registry.registry import Registry
from registry.routes import ROUTES_FILE

log = structlog.get_logger("plugserve.watcher")

Scope = tuple[str, ...]
DEFAULT_DEBOUNCE_S = 0.2


class Watcher:
    """Runs until its stop event is set; see :meth:`run`."""

    def __init__(self, registry: Registry, debounce_s: float = DEFAULT_DEBOUNCE_S) -> None:
        self.registry = registry
        self.debounce_s = debounce_s
        self.stop = asyncio.Event()
        self._timers: dict[Scope, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._default_filter = DefaultFilter()

    def roots(self) -> list[Path]:
        roots = [self.registry.plugins_dir, self.registry.models_dir]
        missing = [str(r) for r in roots if not r.is_dir()]
        if missing:
            log.warning("watch_root_missing", missing=missing)
        return [r for r in roots if r.is_dir()]

    async def run(self) -> None:
        """Watch until :attr:`stop` is set, then let scheduled work finish."""
        roots = self.roots()
        if not roots:
            return
        log.info("watching", roots=[str(r) for r in roots], debounce_s=self.debounce_s)
        # watchfiles only groups the burst of one change; the quiet timer per scope debounces.
        async for changes in awatch(
            *roots,
            watch_filter=self._accept,
            debounce=30,
            step=20,
            stop_event=self.stop,
            ignore_permission_denied=True,
        ):
            for _, path in changes:
                scope = self.scope_of(Path(path))
                if scope is not None:
                    self._schedule(scope)
        for timer in self._timers.values():
            timer.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _accept(self, change: Change, path: str) -> bool:
        return self._default_filter(change, path) and self.scope_of(Path(path)) is not None

    def scope_of(self, path: Path) -> Scope | None:
        """What a changed path affects, or ``None`` when it is to be ignored."""
        registry = self.registry
        for root, kind in ((registry.plugins_dir, "plugins"), (registry.models_dir, "models")):
            if not path.is_relative_to(root):
                continue
            parts = path.relative_to(root).parts
            if not parts or any(is_ignored_name(p) for p in parts):
                return None
            if kind == "models":
                return ("model", parts[0])
            if parts == (ROUTES_FILE,):
                return ("routes",)
            if parts[0] not in PLUGIN_TYPES:
                return None
            if len(parts) >= 3:
                return ("version", *parts[:3])
            return ("rescan",)
        return None

    def _schedule(self, scope: Scope) -> None:
        timer = self._timers.pop(scope, None)
        if timer is not None:
            timer.cancel()
        loop = asyncio.get_running_loop()
        self._timers[scope] = loop.call_later(self.debounce_s, self._fire, scope)

    def _fire(self, scope: Scope) -> None:
        self._timers.pop(scope, None)
        task = asyncio.create_task(self.apply(scope))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def apply(self, scope: Scope) -> None:
        """Apply one quiet scope; errors are logged and the watcher carries on."""
        try:
            if scope[0] == "version":
                outcome = await self.registry.sync_version((scope[1], scope[2], scope[3]))
                log.debug("watch_applied", scope="/".join(scope[1:]), outcome=outcome)
            elif scope[0] == "model":
                outcomes = await self.registry.sync_model(scope[1])
                log.debug("watch_applied", model=scope[1], outcomes=outcomes)
            elif scope[0] == "routes":
                self.registry.sync_routes_file()
            else:
                await self.registry.sync()
        except Exception:
            log.exception("watch_apply_failed", scope=list(scope))
