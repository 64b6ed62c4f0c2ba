"""Build a plugin version into a ready instance, and release it without a trace.

Loading is: manifest checked, module imported under its own name, hooks
registered, component created (by the module's hook or by a backend), then
``warmup()``. Releasing is the reverse: ``close()``, hooks unregistered, every
module of the load removed from ``sys.modules``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import itertools
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import structlog

from plugserve.registry import requirements
from plugserve.registry.errors import PluginCallTimeout, PluginLoadError, PlugserveError
from plugserve.registry.execution.components.base import LoadedPlugin
from plugserve.registry.execution.components.batched import BatchedRunner
from plugserve.registry.execution.components.isolated import IsolatedRunner
from plugserve.registry.execution.components.stage import Stage
from plugserve.registry.execution.components.streaming import StreamingRunner
from plugserve.registry.execution.isolation.groups import Runners, RunnerSpec
from plugserve.registry.execution.isolation.host import RunnerHost
from plugserve.registry.execution.isolation.remote import RemoteRunner
from plugserve.registry.execution.layout import TensorBounds
from plugserve.registry.execution.streaming import stream_kind
from plugserve.registry.manifest import Manifest, check_runner_keys, load_manifest
from plugserve.registry.models import MODELS_SCHEME, resolve_model
from plugserve.registry.plugins.calls import call_plugin
from plugserve.registry.plugins.confine import Roots
from plugserve.registry.plugins.fingerprint import Fingerprinter
from plugserve.registry.plugins.hooks import PluginHooks
from plugserve.registry.plugins.imports import forget, import_plugin, package_name
from plugserve.registry.plugins.integrity import verify_checksums
from plugserve.registry.types import PluginInfo

log = structlog.get_logger("plugserve.registry")


class Loader:
    """Turns version folders into loaded instances of their kind (:func:`kind_of`) and back.

    Plugin code runs under bounds: import, create and warmup together within
    ``load_timeout`` seconds, ``close()`` within ``close_timeout``. A load past
    its bound fails (its thread, if it ever finishes, drops what it made); a
    close past its bound is logged and the instance released all the same.
    """

    def __init__(
        self,
        host: PluginHooks,
        models_dir: Path,
        fingerprinter: Fingerprinter | None = None,
        plugins_dir: Path | None = None,
        load_timeout: float = 120.0,
        close_timeout: float = 10.0,
        check_layout: bool = True,
    ) -> None:
        self.host = host
        self.models_dir = models_dir
        self.fingerprinter = fingerprinter or Fingerprinter()
        self.plugins_dir = plugins_dir
        self.load_timeout = load_timeout
        self.close_timeout = close_timeout
        self.check_layout = check_layout
        """Whether a version folder must be ``<type>/<name>/<version>`` (the server's
        rule); ``plugserve validate`` turns it off for a package staged anywhere."""
        self.runners: Runners | None = None
        """Where ``isolation = "process"`` runners run: a worker's supervisor, or a
        :class:`RunnerHost` of this process made at the first such load."""
        self.workers = 1
        """The server's workers: sequences kept in one worker cannot serve several."""
        self.loop_budget = 0.0
        """Seconds: the loop budget of the batched runners this loads in a worker
        (:meth:`BatchedRunner.run_on_loop`: a worker with a core of its own,
        ``inline_runners``); their schedulers ``gather``."""
        self.tensor_bounds = TensorBounds()
        """What one tensor may hold (``max_tensor_elements``, ``max_bytes_elements``): so
        may each tensor the batched runners this loads merge their requests into."""
        self._loads = itertools.count(1)

    def roots(self, folder: Path) -> Roots:
        """Where every path a version reads must really lie (``registry/plugins/confine.py``)."""
        if self.plugins_dir is None:
            return Roots.around(folder, self.models_dir)
        return Roots(self.plugins_dir, self.models_dir)

    async def load(
        self,
        folder: Path,
        in_process: bool = False,
        content: str | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> LoadedPlugin:
        """Load and warm up the version in ``folder``; raise :class:`PluginLoadError`.

        A runner with ``isolation = "process"`` loads in runner processes of its
        own (:mod:`plugserve.registry.execution.isolation`) unless ``in_process`` (in such a
        process, as one instance); ``content`` (the folder's fingerprint) lets the workers
        of one server share them. ``overrides`` replace ``[runner]`` keys of the
        manifest for this load (not for an isolated runner, whose processes read
        the file).
        """
        manifest = await asyncio.to_thread(self.checked_manifest, folder, overrides)
        if manifest.runner is not None and manifest.runner.isolated:
            if overrides:
                raise PluginLoadError(
                    f"{manifest.label}: an isolated runner takes its settings from its files only"
                )
            if not in_process:
                return await self._load_isolated(manifest, content)
            manifest = dataclasses.replace(
                manifest, runner=dataclasses.replace(manifest.runner, instances=1)
            )
        sequences = manifest.runner is not None and manifest.runner.sequence is not None
        if sequences and self.workers > 1 and not in_process:
            raise PluginLoadError(
                f"{manifest.label}: its sequences would live in one worker of "
                f"{self.workers}, and another worker's requests would miss their state: "
                'declare isolation = "process" (every worker reaches the same runner '
                "processes) or serve with --workers 1"
            )
        deadline = time.monotonic() + self.load_timeout
        package = None
        if manifest.module is not None:
            package = package_name(manifest.type, manifest.name, str(manifest.version))
        abandoned = threading.Event()
        try:
            loaded: LoadedPlugin = await call_plugin(
                functools.partial(self.build, manifest, package, abandoned),
                self.load_timeout,
                manifest.label,
                "create",
                "load_timeout_s",
            )
        except PluginCallTimeout:
            abandoned.set()
            self._forget(package)
            raise
        if self.loop_budget and not in_process and isinstance(loaded, BatchedRunner):
            loaded.run_on_loop(self.loop_budget)
        if isinstance(loaded, BatchedRunner):
            loaded.scheduler.bounds = self.tensor_bounds
            if loaded.sequences is not None:
                loaded.sequences.bounds = self.tensor_bounds
        try:
            await loaded.warmup(deadline - time.monotonic())
        except Exception as exc:
            await self.release(loaded)
            if isinstance(exc, PluginCallTimeout):
                raise
            raise PluginLoadError(
                f"{manifest.label}: warmup failed: {type(exc).__name__}: {exc}"
            ) from exc
        return loaded

    def checked_manifest(
        self, folder: Path, overrides: Mapping[str, Any] | None = None
    ) -> Manifest:
        """What :meth:`load` does with ``folder`` before any plugin code runs: its tree
        checked against the symlink rule, its manifest read and checked, its requirements
        and ``SHA256SUMS`` checked. Blocking, and as costly as the files are large: called
        on a thread, never on the event loop."""
        self.roots(folder).check_tree(folder)
        manifest = load_manifest(folder, overrides, self.check_layout)
        check_requirements(manifest)
        verify_checksums(folder, self.fingerprinter, manifest.label)
        return manifest

    async def _load_isolated(self, manifest: Manifest, content: str | None) -> IsolatedRunner:
        """Start the version's runner processes (loaded and warmed there) and stand for them."""
        runner = manifest.runner
        assert runner is not None
        model_path = self.model_path(manifest)
        if self.runners is None:
            self.runners = RunnerHost()
        spec = RunnerSpec(
            folder=manifest.path,
            label=manifest.label,
            models_dir=self.models_dir,
            plugins_dir=self.plugins_dir,
            instances=runner.instances,
            devices=runner.devices,
            load_timeout=self.load_timeout,
            close_timeout=self.close_timeout,
        )
        content = content or f"load-{next(self._loads)}"
        group = await self.runners.acquire(f"{manifest.label}@{content}", spec)
        remote = RemoteRunner(self.runners, group)
        info = _info(manifest, self.models_dir, model_path)
        loaded = IsolatedRunner(manifest, info, remote, model_path=model_path)
        await loaded.warmup(self.load_timeout)  # reads the metadata the processes sent
        return loaded

    def build(
        self,
        manifest: Manifest,
        package: str | None = None,
        abandoned: threading.Event | None = None,
    ) -> LoadedPlugin:
        """Import (as ``package``), register and create, synchronously (off the event loop).

        When ``abandoned`` is set meanwhile (the load timed out), what was made is dropped.
        """
        if manifest.module is not None and package is None:
            package = package_name(manifest.type, manifest.name, str(manifest.version))
        module = self._import(manifest, package)
        try:
            model_path = self.model_path(manifest)
            info = _info(manifest, self.models_dir, model_path)
            component = self._create(manifest, info, module, model_path)
            kind = kind_of(manifest, component)
            loaded = kind(
                manifest, info, component, package=package, hook_name=package, model_path=model_path
            )
        except BaseException:
            self._forget(package)
            raise
        if abandoned is not None and abandoned.is_set():
            _close_abandoned(component, manifest.label)
            self._forget(package)
            log.warning("plugin_load_abandoned", plugin=manifest.label)
        return loaded

    def _import(self, manifest: Manifest, package: str | None) -> ModuleType | None:
        if manifest.module is None or package is None:
            return None
        try:
            module = import_plugin(
                manifest.path, manifest.module, package, self.roots(manifest.path)
            )
        except (Exception, SystemExit) as exc:
            raise PluginLoadError(
                f"{manifest.label}: importing {manifest.module} failed: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            self.host.register(module, package, manifest.label)
        except PlugserveError as exc:
            forget(package)
            detail = exc.message.replace(f"{package}: ", "", 1).replace(package, manifest.label)
            raise PluginLoadError(f"{manifest.label}: invalid hooks: {detail}") from None
        return module

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

    def preflight(self, folder: Path, overrides: Mapping[str, Any] | None = None) -> int:
        """What a load of ``folder`` can be known to need before it begins: its files and
        manifest checked as :meth:`checked_manifest` does, and its model resolved
        (:class:`PluginLoadError` otherwise); the bytes its model files take, the least it
        can hold resident. Blocking: called on a thread."""
        model = self.model_path(self.checked_manifest(folder, overrides))
        if model is None:
            return 0
        if model.is_dir():
            return sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
        return model.stat().st_size if model.is_file() else 0

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
        except (Exception, SystemExit) as exc:
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
            await loaded.close(self.close_timeout)
        except PluginCallTimeout:
            pass  # logged as plugin_call_timeout; released all the same
        except Exception:
            log.exception("plugin_close_failed", plugin=loaded.label)
        finally:
            self._forget(loaded.package)
            loaded.component = None

    def _forget(self, package: str | None) -> None:
        if package is not None:
            self.host.unregister(package)
            forget(package)


def check_requirements(manifest: Manifest) -> None:
    """:class:`PluginLoadError` listing every ``[plugin] requires`` entry the server's
    environment does not meet, with advice that never installs a second distribution of
    an import (``registry/requirements.py``); an entry none of whose alternatives' markers
    applies here is met."""
    requirements.check_installed(manifest.label, manifest.requires)


def kind_of(manifest: Manifest, component: Any) -> type[LoadedPlugin]:
    """The kind of instance a version's component makes in this process: a processor's
    stage, a streaming runner (its component streams: ``registry/streaming.py``), or a
    batched runner."""
    if manifest.runner is None:
        return Stage
    if stream_kind(component) is not None:
        if manifest.runner.sequence is not None:
            raise PluginLoadError(
                f"{manifest.label}: [runner.sequence] takes a runner that answers each request "
                "once; this one streams"
            )
        return StreamingRunner
    return BatchedRunner


def _info(manifest: Manifest, models_dir: Path, model: Path | None) -> PluginInfo:
    return PluginInfo(
        name=manifest.name,
        version=str(manifest.version),
        type=manifest.type,
        path=manifest.path,
        logger=structlog.get_logger("plugserve.plugin").bind(
            plugin_type=manifest.type, plugin=manifest.name, version=str(manifest.version)
        ),
        model=model,
        models_dir=models_dir,
    )


def _close_abandoned(component: Any, label: str) -> None:
    """Close a component whose load was given up while it was being created (on the
    thread that created it): whatever it holds (sessions, threads) is not left behind.
    An ``async`` close() has no event loop here: it is logged as left unclosed."""
    close = getattr(component, "close", None)
    if not callable(close):
        return
    if inspect.iscoroutinefunction(close):
        log.warning("plugin_abandoned_not_closed", plugin=label, reason="close() is async")
        return
    try:
        close()
    except Exception as exc:
        log.warning("plugin_close_failed", plugin=label, error=f"{type(exc).__name__}: {exc}")
