"""A typed facade over pluggy's plugin manager: the only module that calls ``pm.hook``."""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import inspect
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any, cast

import pluggy
import structlog
from aiohttp import web

from plugserve.registry import hookspecs
from plugserve.registry.plugins.calls import call_plugin
from plugserve.registry.errors import BackendConflict, PluginCallTimeout, PluginLoadError
from plugserve.registry.types import BackendFactory, PluginInfo

ENTRY_POINT_GROUP = "plugserve"

log = structlog.get_logger("plugserve.registry")


class PluginHooks:
    """Owns the pluggy ``PluginManager`` and exposes one typed method per hook.

    Three kinds of plugins are registered here: the built-in ones (the
    ``onnxruntime`` backend), installed packages found through the ``plugserve``
    entry-point group, and the modules of plugin folders while they are loaded.
    """

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        # Plugins load on worker threads; pluggy itself is not thread-safe.
        self._lock = threading.RLock()
        self._labels: dict[str, str] = {}

    def register(self, plugin: object, name: str, label: str | None = None) -> None:
        """Register a module or object implementing ``plugserve_*`` hooks.

        ``label`` (``type/name@version``) names it in the log instead of ``name``.

        Raises :class:`PluginLoadError` when it implements an unknown
        ``plugserve_*`` hook or a hook with a wrong signature.
        """
        with self._lock:
            try:
                self._pm.register(plugin, name=name)
                self._pm.check_pending()
            except (pluggy.PluginValidationError, ValueError) as exc:
                if self._pm.is_registered(plugin):
                    self._pm.unregister(plugin)
                raise PluginLoadError(f"{name}: {exc}") from None
            if label is not None:
                self._labels[name] = label

    def unregister(self, name: str) -> None:
        """Drop a registration; a name never registered is ignored."""
        with self._lock:
            plugin = self._pm.get_plugin(name)
            if plugin is not None:
                self._pm.unregister(plugin, name=name)
            self._labels.pop(name, None)

    def names(self) -> list[str]:
        return [name for name, _ in self._pm.list_name_plugin()]

    def load_builtins(self) -> None:
        """Register the built-in plugins, through the same hooks as everyone else's."""
        from plugserve.registry.backends import onnxruntime, tensorrt

        self.register(onnxruntime, "builtin:onnxruntime")
        self.register(tensorrt, "builtin:tensorrt")

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> list[str]:
        """Register installed packages' ``plugserve`` entry points.

        A broken entry point is logged and skipped, so one bad package cannot
        keep the server from starting. Returns the names registered.
        """
        loaded = []
        for ep in importlib.metadata.entry_points(group=group):
            name = f"entrypoint:{ep.name}"
            if self._pm.get_plugin(name) is not None:
                continue
            try:
                self.register(ep.load(), name)
            except Exception as exc:
                log.error("entry_point_failed", entry_point=ep.value, error=str(exc))
                continue
            loaded.append(name)
        return loaded

    def create_component(
        self, module: ModuleType, info: PluginInfo, config: Mapping[str, Any]
    ) -> Any:
        """Call ``plugserve_create_component`` of ``module`` alone."""
        with self._lock:
            others = [p for p in self._pm.get_plugins() if p is not module]
            caller = self._pm.subset_hook_caller("plugserve_create_component", others)
        if not caller.get_hookimpls():
            raise PluginLoadError(
                f"{info.label}: its module implements no plugserve_create_component"
            )
        component = caller(plugin=info, config=config)
        if component is None:
            raise PluginLoadError(f"{info.label}: plugserve_create_component returned None")
        if inspect.isawaitable(component):
            raise PluginLoadError(
                f"{info.label}: plugserve_create_component must be synchronous "
                "(return the component, not a coroutine)"
            )
        return component

    def backends(self) -> dict[str, BackendFactory]:
        """Merge every ``plugserve_backends`` result; one name, one provider.

        Raises :class:`BackendConflict` listing the providers of a name claimed twice.
        """
        providers: dict[str, list[str]] = {}
        merged: dict[str, BackendFactory] = {}
        with self._lock:
            impls = self._pm.hook.plugserve_backends.get_hookimpls()
        for impl in impls:
            result = cast("Mapping[str, BackendFactory] | None", impl.function()) or {}
            for backend, factory in result.items():
                providers.setdefault(backend, []).append(impl.plugin_name)
                merged[backend] = factory
        conflicts = {name: owners for name, owners in providers.items() if len(owners) > 1}
        if conflicts:
            detail = "; ".join(f"{n!r} by {', '.join(o)}" for n, o in sorted(conflicts.items()))
            raise BackendConflict(f"backend name claimed by more than one plugin: {detail}")
        return merged

    async def startup(self, app: web.Application, within: float = 120.0) -> None:
        """Call each ``plugserve_startup`` in turn, each within ``within`` s (load_timeout_s)."""
        hook = "plugserve_startup"
        for impl in self._impls(hook):
            await self._call_hook(hook, impl, app, within, "load_timeout_s")

    async def shutdown(self, app: web.Application, within: float = 10.0) -> None:
        """Call every ``plugserve_shutdown`` at once, all within ``within`` s (``close_timeout_s``).

        At once, so that one that hangs costs the others nothing.
        """
        hook = "plugserve_shutdown"
        impls = self._impls(hook)
        await asyncio.gather(
            *(self._call_hook(hook, i, app, within, "close_timeout_s") for i in impls)
        )

    def _impls(self, hook: str) -> list[Any]:
        with self._lock:
            return list(getattr(self._pm.hook, hook).get_hookimpls())

    async def _call_hook(
        self, hook: str, impl: Any, app: web.Application, within: float, setting: str
    ) -> None:
        # Each implementation on its own, so one failure does not skip the rest.
        call = functools.partial(impl.function, app=app)
        try:
            await call_plugin(call, within, self._label(impl.plugin_name), hook, setting)
        except PluginCallTimeout:
            pass  # logged as plugin_call_timeout
        except Exception:
            log.exception("lifecycle_hook_failed", hook=hook, plugin=self._label(impl.plugin_name))

    def _label(self, name: str) -> str:
        return self._labels.get(name, name)
