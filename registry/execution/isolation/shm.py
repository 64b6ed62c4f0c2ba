"""Shared memory between a worker and a runner process: one region each way per connection.

A region is an anonymous memory file (``memfd``), mapped by both processes: its
creator hands the file descriptor over the connection (``SCM_RIGHTS``) and both
close the descriptor once mapped, so nothing is left behind in ``/dev/shm`` when
a process dies. Pages are taken from the system as they are first written.

Only the writer of a region allocates in it (:class:`Allocator`); the reader says
when a block may be reused (a worker when a request's answer arrives, a runner
process when a worker has dropped the arrays it read).
"""

from __future__ import annotations

import bisect
import mmap
import os

ALIGN = 64
"""Blocks start on a cache line: arrays read from them are aligned for any dtype."""


class Region:
    """A shared memory file mapped into this process."""

    def __init__(self, size: int, fd: int | None = None) -> None:
        created = fd is None
        if fd is None:
            fd = os.memfd_create("plugserve-tensors", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.size = size
        self.fd: int | None = fd
        self.map = mmap.mmap(fd, size)
        if not created:  # received: the mapping is all this process needs
            self.close_fd()

    def close_fd(self) -> None:
        """Close the descriptor (the mapping stays); once it has been sent, or at once."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Allocator:
    """First-fit blocks of a region, aligned to :data:`ALIGN`, merged again when freed."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)] if size else []
        """(offset, length) of the free blocks, by offset."""
        self._used: dict[int, int] = {}

    @property
    def used(self) -> int:
        """Bytes held by blocks not yet freed."""
        return sum(self._used.values())

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a block of at least ``nbytes``, or ``None`` when none is free."""
        need = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        for index, (offset, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[index]
                else:
                    self._free[index] = (offset + need, length - need)
                self._used[offset] = need
                return offset
        return None

    def free(self, offset: int) -> None:
        """Give a block back; an offset not allocated (freed twice, made up) is ignored."""
        length = self._used.pop(offset, None)
        if length is None:
            return
        free = self._free
        index = bisect.bisect(free, (offset, 0))
        if index < len(free) and offset + length == free[index][0]:  # merge with the next
            length += free[index][1]
            del free[index]
        if index > 0 and free[index - 1][0] + free[index - 1][1] == offset:  # and the previous
            offset, length = free[index - 1][0], free[index - 1][1] + length
            del free[index - 1]
            index -= 1
        free.insert(index, (offset, length))
