"""Import each plugin version under a module name of its own, and forget it entirely.

A load of ``runner/iris/1.0.0`` becomes the package ``_plugserve_runner_iris_1_0_0__g3``
whose ``__path__`` is the version folder, so ``from . import utils`` inside it
finds the folder's own ``utils.py``, two versions never share module objects, and
a reload (a new generation) never sees the previous load's modules.

Every module and package folder found for a plugin package must really lie in
the roots it was imported with (``registry/plugins/confine.py``), at load time and for
any later import: a symlink out is an ``ImportError``.

Plugin sources are always compiled from the ``.py`` file: no ``.pyc`` is read
(a same-size edit within one second would otherwise import stale bytecode) and
none is written into the watched folder.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import itertools
import re
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import CodeType, ModuleType

from plugserve.registry.plugins.confine import Roots

PREFIX = "_plugserve_"

_generation = itertools.count(1)
_install_lock = threading.Lock()
_roots: dict[str, Roots] = {}
"""The roots each loaded plugin package's modules must lie in, by top-level package name."""


class _SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """Compiles from source on every import; never touches ``__pycache__``."""

    def get_code(self, fullname: str) -> CodeType:
        source = self.get_data(self.path)
        return compile(source, self.path, "exec", dont_inherit=True)


class _PluginFinder(importlib.abc.MetaPathFinder):
    """Finds submodules of plugin packages (names under ``PREFIX``) with the source-only loader."""

    _details = [
        (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES),
        (_SourceOnlyLoader, importlib.machinery.SOURCE_SUFFIXES),
    ]

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(PREFIX) or not path:
            return None
        for entry in path:
            # A fresh FileFinder each time: its directory cache must not outlive an edit.
            finder = importlib.machinery.FileFinder(entry, *self._details)
            spec = finder.find_spec(fullname, target)
            if spec is not None:
                _check_confined(fullname, spec)
                return spec
        return None


def _check_confined(fullname: str, spec: importlib.machinery.ModuleSpec) -> None:
    """Refuse a module file or package folder that a symlink leads out of the package's roots."""
    roots = _roots.get(fullname.partition(".")[0])
    if roots is None:  # released (forget): nothing of it may be imported again
        raise ImportError(f"{fullname}: its plugin version was released", name=fullname)
    paths = [spec.origin] if spec.has_location and spec.origin else []
    for path in [*paths, *(spec.submodule_search_locations or [])]:
        real = roots.outside(path)
        if real is not None:
            raise ImportError(f"{path} {roots.refusal(real)}", name=fullname, path=path)


_FINDER = _PluginFinder()


def _install_finder() -> None:
    with _install_lock:
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)


def package_name(kind: str, name: str, version: str) -> str:
    """A fresh, unique top-level package name for one load of one version."""
    slug = re.sub(r"[^0-9a-zA-Z]", "_", f"{kind}_{name}_{version}")
    return f"{PREFIX}{slug}__g{next(_generation)}"


def import_plugin(
    folder: Path, module: str, package: str, roots: Roots | None = None
) -> ModuleType:
    """Import ``module`` (``plugin.py`` or a package folder) from ``folder`` as ``package.<stem>``.

    Every module of the package, now or later, must lie in ``roots`` (default:
    ``folder``). On failure every module imported so far under ``package`` is
    removed again.
    """
    _install_finder()
    _roots[package] = roots or Roots(folder)
    stem = module[:-3] if module.endswith(".py") else module.rstrip("/")
    dotted = ".".join(Path(stem).parts)
    pkg = ModuleType(package)
    pkg.__path__ = [str(folder)]
    pkg.__file__ = None
    spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    pkg.__spec__ = spec
    pkg.__package__ = package
    sys.modules[package] = pkg
    try:
        return importlib.import_module(f"{package}.{dotted}")
    except BaseException:
        forget(package)
        raise


def forget(package: str) -> list[str]:
    """Remove ``package`` and every ``package.*`` from ``sys.modules``; return their names."""
    _roots.pop(package, None)
    names = [n for n in list(sys.modules) if n == package or n.startswith(package + ".")]
    for name in names:
        sys.modules.pop(name, None)
    importlib.invalidate_caches()
    return names
