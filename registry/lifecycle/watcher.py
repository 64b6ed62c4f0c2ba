"""Watch the plugins directory, the model repository and ``routes.toml``; apply changes live.

Events are only hints. Each one names a scope (one version folder, one model,
the routes file, or a rescan); a scope is applied once it has been quiet for
the debounce time, and what it does is decided by content fingerprints, so a
touch, a junk file or a duplicate event loads nothing. A failure never stops
the watcher: the next change is tried again.

The watched folders themselves may go away or be replaced (``rm -rf plugins &&
cp -r ...``, ``mv plugins.new plugins``, a symlink swap). Their identity is
polled; a folder that disappears is reported as lost (log and readiness) while
what it served keeps serving, and once a folder is back, or another folder
stands in its place, the watch is re-armed on it and everything is rescanned.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any, Protocol

import structlog
from watchfiles import Change, DefaultFilter, awatch

from plugserve.registry.lifecycle.lifecycle_events import Key, Outcome
from plugserve.registry.refs import PLUGIN_TYPES, is_ignored_name
from plugserve.registry.routing.route_specs import ROUTES_FILE

log = structlog.get_logger("plugserve.watcher")

Scope = tuple[str, ...]
Identity = tuple[int, int]
DEFAULT_DEBOUNCE_S = 0.2
ROOT_POLL_S = 0.5
RESCAN: Scope = ("rescan",)
RESCAN_MAX_WAIT_S = 5.0


def identity(folder: Path) -> Identity | None:
    """The folder's device and inode (through symlinks), or ``None`` when it is not a folder."""
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if os.path.isdir(folder) else None


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Until ``event`` is set or ``seconds`` have passed."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)


class Report(Protocol):
    def as_json(self) -> dict[str, Any]: ...


class WatchTarget(Protocol):
    """What the watcher applies changes to: the registry, or a supervisor's workers."""

    plugins_dir: Path
    models_dir: Path
    lost_roots: dict[Path, float]

    async def sync(self, force: bool = False) -> Report: ...
    async def sync_version(self, key: Key) -> Outcome: ...
    async def sync_model(self, name: str) -> list[tuple[str, Outcome]]: ...
    async def sync_routes_file(self) -> str: ...


class Watcher:
    """Runs until its stop event is set; see :meth:`run`."""

    def __init__(
        self,
        registry: WatchTarget,
        debounce_s: float = DEFAULT_DEBOUNCE_S,
        poll_s: float = ROOT_POLL_S,
    ) -> None:
        self.registry = registry
        self.debounce_s = debounce_s
        self.poll_s = poll_s
        self.stop = asyncio.Event()
        self._timers: dict[Scope, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._default_filter = DefaultFilter()
        # What each root was when the watch was armed; None: it was not there.
        self._armed: dict[Path, Identity | None] = {}
        self._filling_until = 0.0  # a restored folder's rescan waits for quiet until then

    def roots(self) -> list[Path]:
        return [self.registry.plugins_dir, self.registry.models_dir]

    async def run(self) -> None:
        """Watch until :attr:`stop` is set, re-arming whenever a root goes or comes back."""
        self._arm(first=True)
        while not self.stop.is_set():
            live = [root for root, ident in self._armed.items() if ident is not None]
            halt = asyncio.Event()
            guard = asyncio.create_task(self._guard(halt))
            try:
                if live:
                    await self._watch(live, halt)
                    if not halt.is_set():  # the watch broke, no root moved: try again soon
                        await _wait(halt, self.poll_s)
                else:
                    await halt.wait()
            finally:
                guard.cancel()
            if not self.stop.is_set():
                self._arm(first=False)
        for timer in self._timers.values():
            timer.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _watch(self, roots: list[Path], halt: asyncio.Event) -> None:
        log.info("watching", roots=[str(r) for r in roots], debounce_s=self.debounce_s)
        try:
            # watchfiles only groups the burst of one change; the quiet timer per scope debounces.
            async for changes in awatch(
                *roots,
                watch_filter=self._accept,
                debounce=30,
                step=20,
                stop_event=halt,
                ignore_permission_denied=True,
            ):
                for _, path in changes:
                    scope = self.scope_of(Path(path))
                    if scope is not None:
                        self._schedule(scope)
                if RESCAN in self._timers and time.monotonic() < self._filling_until:
                    # A folder came back and is still being filled: rescan once it is quiet.
                    self._schedule(RESCAN)
        except OSError as exc:
            # A root vanished between its check and the watch starting: the guard sees it.
            log.debug("watch_interrupted", error=repr(exc))
        except Exception:
            log.exception("watch_failed", roots=[str(r) for r in roots])

    async def _guard(self, halt: asyncio.Event) -> None:
        """Poll the roots; end the current watch when one changed or the watcher stops."""
        while not halt.is_set():
            await _wait(self.stop, self.poll_s)
            if self.stop.is_set() or self._roots_moved():
                halt.set()

    def _roots_moved(self) -> bool:
        return any(identity(root) != armed for root, armed in self._armed.items())

    def _arm(self, first: bool) -> None:
        """Take each root's identity now; log and record what went or came back."""
        lost = self.registry.lost_roots
        restored = False
        for root in self.roots():
            now, before = identity(root), self._armed.get(root)
            self._armed[root] = now
            if now is None and (first or before is None):
                if first:
                    log.warning("watch_root_missing", path=str(root))
            elif now is None:
                lost[root] = time.time()
                log.error("watch_root_lost", path=str(root), keeps_serving=True)
            elif first or now == before:
                continue
            else:
                since = lost.pop(root, None)
                missing_s = None if since is None else round(time.time() - since, 3)
                log.warning(
                    "watch_root_restored",
                    path=str(root),
                    replaced=before is not None,
                    missing_s=missing_s,
                )
                restored = True
        if restored:
            self._filling_until = time.monotonic() + RESCAN_MAX_WAIT_S
            self._schedule(RESCAN)

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
            return RESCAN
        return None

    def root_of(self, scope: Scope) -> Path:
        return self.registry.models_dir if scope[0] == "model" else self.registry.plugins_dir

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
        """Apply one quiet scope; errors are logged and the watcher carries on.

        A scope whose root is gone, or was replaced since the watch was armed, is
        skipped: the files it pointed at are being removed with their folder,
        and the rescan that follows the folder's return decides what stays.
        """
        root = self.root_of(scope)
        now = identity(root)
        if now is None or now != self._armed.get(root):
            # Gone (also once the watch was re-armed without it) or replaced since armed.
            log.debug("watch_skipped", scope=list(scope), reason="root moved", path=str(root))
            return
        try:
            if scope[0] == "version":
                outcome = await self.registry.sync_version((scope[1], scope[2], scope[3]))
                log.debug("watch_applied", scope="/".join(scope[1:]), outcome=outcome)
            elif scope[0] == "model":
                outcomes = await self.registry.sync_model(scope[1])
                log.debug("watch_applied", model=scope[1], outcomes=outcomes)
            elif scope[0] == "routes":
                result = await self.registry.sync_routes_file()
                log.debug("watch_applied", scope="routes", result=result)
            else:
                report = await self.registry.sync()
                log.debug("watch_applied", scope="rescan", report=report.as_json())
        except Exception:
            log.exception("watch_apply_failed", scope=list(scope))
