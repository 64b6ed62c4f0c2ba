"""The symlink rule: whatever the server reads for a plugin version really lies in its roots.

The roots are the real plugins dir and the real model repository. A symlink
anywhere (the version folder itself, a subfolder, a file, a model version
folder, a model file) is followed to its end; if that real path is outside
every root, the path is refused. Links that stay inside the roots are fine.
Whatever exists in a version folder is a regular file or a folder (no FIFOs,
sockets or devices, which could block a read forever). The check runs when a
version loads (its whole folder, its model file) and
again whenever its code imports a module (``registry/plugins/imports.py``), so a later
``from .sub import x`` through a symlinked folder is refused too.
"""

from __future__ import annotations

import os
from pathlib import Path

from plugserve.registry.errors import PluginLoadError
from plugserve.registry.refs import PLUGIN_TYPES, is_ignored_name


class Roots:
    """The real folders a plugin version's paths must end in."""

    def __init__(self, *folders: Path) -> None:
        self.folders = tuple(Path(os.path.realpath(folder)) for folder in folders)
        self._written = tuple(Path(os.path.abspath(folder)) for folder in folders)

    @classmethod
    def around(cls, version_folder: Path, models_dir: Path) -> Roots:
        """The plugins dir holding ``<type>/<name>/<version>``, else the version folder alone."""
        plugins_dir = version_folder.parent.parent.parent
        if version_folder.parent.parent.name not in PLUGIN_TYPES:
            plugins_dir = version_folder
        return cls(plugins_dir, models_dir)

    def outside(self, path: Path | str) -> Path | None:
        """The real path of ``path`` if it leads outside every root, else ``None``."""
        real = Path(os.path.realpath(path))
        if any(real.is_relative_to(root) for root in self.folders):
            return None
        return real

    def check(self, path: Path, what: str = "") -> None:
        """Raise :class:`PluginLoadError` if ``path`` leads outside the roots."""
        real = self.outside(path)
        if real is not None:
            raise PluginLoadError(f"{what}{self._shown(path)} {self.refusal(real)}")

    def refusal(self, real: Path) -> str:
        roots = " and ".join(str(root) for root in self.folders)
        return f"leads outside the plugins dir (to {real}, not in {roots}): refused"

    def check_tree(self, folder: Path) -> None:
        """``folder`` and all in it, symlinked subfolders followed (each real folder once)."""
        seen: set[str] = set()
        pending = [folder]
        while pending:
            current = pending.pop()
            self.check(current)
            real = os.path.realpath(current)
            if real in seen:
                continue
            seen.add(real)
            try:
                entries = sorted(os.scandir(current), key=lambda e: e.name)
            except OSError:
                continue  # unreadable: loading it fails on its own, naming the file
            for entry in entries:
                if is_ignored_name(entry.name):
                    continue
                path = Path(entry.path)
                if entry.is_dir(follow_symlinks=True):
                    pending.append(path)
                    continue
                self.check(path)
                if os.path.exists(path) and not entry.is_file(follow_symlinks=True):
                    # A FIFO, socket or device: reading it could block or never end.
                    raise PluginLoadError(f"{self._shown(path)} is not a regular file: refused")

    def _shown(self, path: Path) -> str:
        """``path`` relative to the root it is written under, for a short message."""
        absolute = Path(os.path.abspath(path))
        for root in self._written + self.folders:
            if absolute.is_relative_to(root):
                return str(absolute.relative_to(root))
        return str(path)
