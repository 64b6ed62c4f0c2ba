"""The plugins dir's version folders, ``<plugins_dir>/<type>/<name>/<version>/``: which
there are, each one's key, its content fingerprint, and what its manifest says of its
loading (on demand or eagerly, in processes of its own, the model it names)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from plugserve.registry.lifecycle.lifecycle_events import Key
from plugserve.registry.lifecycle.loader import Loader
from plugserve.registry.manifest import load_manifest
from plugserve.registry.plugins.fingerprint import Fingerprinter
from plugserve.registry.refs import PLUGIN_TYPES, is_ignored_name


class VersionFolders:
    """The version folders under ``plugins_dir``, read as a load needs them."""

    def __init__(
        self, plugins_dir: Path, loader: Loader, fingerprinter: Fingerprinter, default_load: str
    ) -> None:
        self.plugins_dir = plugins_dir
        self.loader = loader
        self.fingerprinter = fingerprinter
        self.default_load = default_load
        """When a runner version whose manifest does not say loads (``[runner] load``)."""

    def discover(self) -> list[Path]:
        """Every folder ``<plugins_dir>/<type>/<name>/<version>/``, ignored names skipped."""
        found: list[Path] = []
        for kind in PLUGIN_TYPES:
            for name in _subdirs(self.plugins_dir / kind):
                found.extend(_subdirs(name))
        return found

    def discover_declarative(self) -> tuple[list[Path], list[Path]]:
        """:meth:`discover`'s folders, and those among them without a module (blocking)."""
        folders = self.discover()
        return folders, [f for f in folders if _is_declarative(f)]

    def folder_of(self, key: Key) -> Path:
        return self.plugins_dir.joinpath(*key)

    @staticmethod
    def key_of(folder: Path) -> Key:
        return (folder.parent.parent.name, folder.parent.name, folder.name)

    def model_named(self, folder: Path) -> str | None:
        """The model repository name a version's manifest uses, if it can be read (blocking)."""
        try:
            return self.loader.model_name(load_manifest(folder))
        except Exception:  # a manifest that does not parse names no model
            return None

    def fingerprint(self, folder: Path) -> str:
        """The folder's files and, for a runner, the model file it resolves to now."""
        extra: list[Path] = []
        try:
            model = self.loader.model_path(load_manifest(folder))
        except Exception:  # the load reports it
            model = None
        if model is not None and not model.is_relative_to(folder):
            extra.append(model)
        return self.fingerprinter.folder(folder, extra)

    def inspect(self, folder: Path) -> tuple[str, bool, bool]:
        """The folder's fingerprint, whether it holds a runner that loads on demand, and
        whether that runner runs in processes of its own."""
        fingerprint = self.fingerprint(folder)
        try:
            runner = load_manifest(folder).runner
        except Exception:  # the load reports it
            return fingerprint, False, False
        if runner is None:
            return fingerprint, False, False
        return fingerprint, (runner.load or self.default_load) == "on_demand", runner.isolated


def _subdirs(folder: Path) -> Iterable[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and not is_ignored_name(p.name))


def _is_declarative(folder: Path) -> bool:
    """A plugin without a module; a broken manifest counts as not (it fails on load anyway)."""
    try:
        return load_manifest(folder).module is None
    except Exception:
        return False
