"""Content fingerprints of version folders, so reloads are decided by content, not events.

A touch, a duplicate event, or the watcher and an admin call reacting to the
same change all see the same fingerprint and load nothing twice. File digests
are cached by ``(size, mtime_ns)``: an unchanged file is never read again, a
touched one is re-read and, if its bytes are the same, changes nothing.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from plugserve.registry.refs import is_ignored_name

_CHUNK = 1 << 20


def walk(folder: Path) -> Iterator[Path]:
    """Every file under ``folder`` whose path has no ignored name, in sorted order."""
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not is_ignored_name(d))
        for name in sorted(files):
            if not is_ignored_name(name):
                yield Path(root) / name


class Fingerprinter:
    """Digests of files and folders, cached by stat; safe to call from worker threads."""

    def __init__(self) -> None:
        self._cache: dict[Path, tuple[int, int, str]] = {}
        self._lock = threading.Lock()

    def file(self, path: Path) -> str:
        """The SHA-256 of ``path``, ``"missing"`` when it cannot be read, ``"special"``
        for a FIFO, socket or device (never read: it could block or never end)."""
        try:
            st = path.stat()
            if not stat.S_ISREG(st.st_mode):
                return "special"
            with self._lock:
                cached = self._cache.get(path)
            if cached is not None and cached[:2] == (st.st_size, st.st_mtime_ns):
                return cached[2]
            digest = hashlib.sha256()
            with path.open("rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
        except OSError:
            return "missing"
        hexdigest = digest.hexdigest()
        with self._lock:
            self._cache[path] = (st.st_size, st.st_mtime_ns, hexdigest)
        return hexdigest

    def folder(self, folder: Path, extra: Iterable[Path] = ()) -> str:
        """One digest over every file's relative path and content, plus ``extra`` files."""
        digest = hashlib.sha256()
        for path in walk(folder):
            digest.update(str(path.relative_to(folder)).encode() + b"\0")
            digest.update(self.file(path).encode() + b"\n")
        for path in extra:
            digest.update(str(path).encode() + b"\0" + self.file(path).encode() + b"\n")
        return digest.hexdigest()

    def forget(self, folder: Path) -> None:
        """Drop cached digests under ``folder`` (deleted), so the cache cannot grow forever."""
        with self._lock:
            for path in [p for p in self._cache if p.is_relative_to(folder)]:
                del self._cache[path]
