"""The registered shared memory regions that every worker of a server sees.

One process keeps its table in memory (:class:`LocalTable`). Workers share a
file in the supervisor's control folder (mode 0700, :class:`SharedTable`): a
JSON document of the regions, rewritten whole (written aside, then renamed) under
an ``flock``, and an 8-byte generation counter that each worker maps and reads
before every shared memory call. The supervisor writes it (it registers every
region, server/triton/shared_memory.py); a region registered through one worker
is seen by the next request on any other (which opens it then), and one
unregistered is gone everywhere.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import struct
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from plugserve.registry.shared_files import locked, release

T = TypeVar("T")
Entries = dict[str, dict[str, Any]]
"""Region name -> ``{"name", "key", "offset", "byte_size", "registration", "holder", "fd",
"identity"}`` (:meth:`plugserve.server.triton.shared_memory.Region.entry`)."""

_GENERATION = struct.Struct("<Q")


class LocalTable:
    """The regions of a single-process server."""

    def __init__(self) -> None:
        self._entries: Entries = {}
        self._generation = 0

    def generation(self) -> int:
        return self._generation

    def read(self) -> tuple[int, Entries]:
        return self._generation, dict(self._entries)

    def change(self, edit: Callable[[Entries], T]) -> T:
        """Apply ``edit`` to the entries (it may raise: then nothing changes)."""
        entries = dict(self._entries)
        result = edit(entries)
        self._entries = entries
        self._generation += 1
        return result


class SharedTable(LocalTable):
    """The regions of every worker of one server, in files of the control folder."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self._path = folder / "shm-regions.json"
        fd = os.open(folder / "shm-regions.generation", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with locked(fd, fcntl.LOCK_EX):
                if os.fstat(fd).st_size < _GENERATION.size:
                    os.ftruncate(fd, _GENERATION.size)
            memory = mmap.mmap(fd, _GENERATION.size)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._memory = fd, memory
        weakref.finalize(self, release, fd, memory)

    def generation(self) -> int:
        return int(_GENERATION.unpack_from(self._memory)[0])

    def read(self) -> tuple[int, Entries]:
        with locked(self._fd, fcntl.LOCK_SH):
            return self.generation(), self._load()

    def change(self, edit: Callable[[Entries], T]) -> T:
        with locked(self._fd, fcntl.LOCK_EX):
            entries = self._load()
            result = edit(entries)
            aside = self._path.with_suffix(f".{os.getpid()}.tmp")
            aside.write_text(json.dumps(entries))
            os.replace(aside, self._path)
            _GENERATION.pack_into(self._memory, 0, self.generation() + 1)
        return result

    def _load(self) -> Entries:
        try:
            entries: Entries = json.loads(self._path.read_text())
        except FileNotFoundError:
            return {}
        return entries
