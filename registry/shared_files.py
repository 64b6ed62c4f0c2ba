"""Small files shared by the processes of one server: a lock around each change, a mapping."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Iterator


@contextlib.contextmanager
def locked(fd: int, how: int = fcntl.LOCK_EX) -> Iterator[None]:
    """Hold ``flock(fd, how)`` (exclusive by default) for the block."""
    fcntl.flock(fd, how)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def release(fd: int, memory: mmap.mmap) -> None:
    """Close a file's mapping and the file (a ``weakref.finalize`` callback)."""
    memory.close()
    os.close(fd)
