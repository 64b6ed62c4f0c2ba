"""Build a plugin version into a ready instance, and release it without a trace.

Loading is: manifest checked, module imported under its own name, hooks
registered, component created (by the module's hook or by a backend), then
``warmup()``. Releasing is the reverse: ``close()``, hooks unregistered, every
module of the load removed from ``sys.modules``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog

from registry.components import LoadedPlugin
from registry.confine import Roots
from registry.errors import PluginLoadError, PlugserveError
from registry.fingerprint import Fingerprinter
from registry.imports import forget, import_plugin, package_name
from registry.integrity import verify_checksums
from registry.manager import PluginHost
from registry.manifest import Manifest, check_runner_keys, load_manifest
from registry.models import MODELS_SCHEME, resolve_model
from registry.types import PluginInfo

log = structlog.get_logger("plugserve.registry")


class Loader:
    """Turns version folders into :class:`LoadedPlugin` instances and back."""

    def __init__(
        self,
        host: PluginHost,
        models_dir: Path,
        fingerprinter: Fingerprinter | None = None,
        plugins_dir: Path | None = None,
    ) -> None:
        self.host = host
        self.models_dir = models_dir
        self.fingerprinter = fingerprinter or Fingerprinter()
        self.plugins_dir = plugins_dir

    def roots(self, folder: Path) -> Roots:
        """Where every path a version reads must really lie (``registry/confine.py``)."""
        if self.plugins_dir is None:
            return Roots.around(folder, self.models_dir)
        return Roots(self.plugins_dir, self.models_dir)

    async def load(self, folder: Path) -> LoadedPlugin:
        """Load and warm up the version in ``folder``; raise :class:`PluginLoadError`."""
        await asyncio.to_thread(self.roots(folder).check_tree, folder)
        manifest = load_manifest(folder)
        await asyncio.to_thread(verify_checksums, folder, self.fingerprinter, manifest.label)
        loaded = await asyncio.to_thread(self.build, manifest)
        try:
            await loaded.warmup()
        except Exception as exc:
            await self.release(loaded)
            raise PluginLoadError(
                f"{manifest.label}: warmup failed: {type(exc).__name__}: {exc}"
            ) from exc
        return loaded

    def build(self, manifest: Manifest) -> LoadedPlugin:
        """Import, register and create, synchronously (call it off the event loop)."""
        info = PluginInfo(
            name=manifest.name,
            version=str(manifest.version),
            type=manifest.type,
            path=manifest.path,
            logger=structlog.get_logger("plugserve.plugin").bind(
                plugin_type=manifest.type, plugin=manifest.name, version=str(manifest.version)
            ),
        )
        module, package = self._import(manifest)
        try:
            model_path = self.model_path(manifest)
            component = self._create(manifest, info, module, model_path)
            return LoadedPlugin(
                manifest, info, component, package=package, hook_name=package, model_path=model_path
            )
        except BaseException:
            self._forget(package)
            raise

    def _import(self, manifest: Manifest) -> tuple[ModuleType | None, str | None]:
        if manifest.module is None:
            return None, None
        package = package_name(manifest.type, manifest.name, str(manifest.version))
        try:
            module = import_plugin(
                manifest.path, manifest.module, package, self.roots(manifest.path)
            )
        except Exception as exc:
            raise PluginLoadError(
                f"{manifest.label}: importing {manifest.module} failed: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            self.host.register(module, package)
        except PlugserveError as exc:
            forget(package)
            detail = exc.message.replace(f"{package}: ", "", 1).replace(package, manifest.label)
            raise PluginLoadError(f"{manifest.label}: invalid hooks: {detail}") from None
        return module, package

    def model_path(self, manifest: Manifest) -> Path | None:
        """The model file a runner's manifest resolves to now; raises :class:`PluginLoadError`."""
        runner = manifest.runner
        if runner is None or runner.model is None:
            return None
        factory = self.host.backends().get(runner.backend or "")
        default_file = getattr(factory, "model_filename", None)
        try:
            path = resolve_model(runner.model, manifest.path, self.models_dir, default_file)
            self.roots(manifest.path).check(path, "model ")
            return path
        except PluginLoadError as exc:
            raise PluginLoadError(f"{manifest.label}: {exc.message}") from None

    def model_name(self, manifest: Manifest) -> str | None:
        """The model repository name a runner uses (``models:<name>...``), if any."""
        model = manifest.runner.model if manifest.runner else None
        if model is None or not model.startswith(MODELS_SCHEME):
            return None
        return model[len(MODELS_SCHEME) :].split("/", 1)[0]

    def _create(
        self, manifest: Manifest, info: PluginInfo, module: ModuleType | None, model: Path | None
    ) -> Any:
        runner = manifest.runner
        try:
            if runner is not None and runner.backend is not None:
                return self._create_from_backend(manifest, info, runner.backend, model)
            assert module is not None  # the manifest guarantees a module here
            return self.host.create_component(module, info, manifest.config)
        except PlugserveError:
            raise
        except Exception as exc:
            raise PluginLoadError(
                f"{manifest.label}: creating the component failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _create_from_backend(
        self, manifest: Manifest, info: PluginInfo, backend: str, model: Path | None
    ) -> Any:
        assert manifest.runner is not None
        factories = self.host.backends()
        factory = factories.get(backend)
        if factory is None:
            known = ", ".join(sorted(factories)) or "none"
            raise PluginLoadError(f"{manifest.label}: unknown backend {backend!r} (known: {known})")
        check_runner_keys(manifest, backend, getattr(factory, "runner_keys", ()))
        return factory(info, manifest.runner.table, model)

    async def release(self, loaded: LoadedPlugin) -> None:
        """``close()`` the component, unregister its hooks and forget its modules."""
        try:
            await loaded.close()
        except Exception:
            log.exception("plugin_close_failed", plugin=loaded.label)
        finally:
            self._forget(loaded.package)
            loaded.component = None

    def _forget(self, package: str | None) -> None:
        if package is not None:
            self.host.unregister(package)
            forget(package)
