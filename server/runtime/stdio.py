"""The server's stdout and stderr: writes that never raise and never block.

A log line must not stop serving, whatever is at the other end: a reader
that has gone (``plugserve serve 2>&1 | head``), one that has stopped reading
(``| less`` left unscrolled: the pipe fills and every write would block the
event loop), a full disk, a closed file.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import stat
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, TextIO

MAX_QUEUED_CHARS = 4 * 1024 * 1024
"""Text waiting for a slow reader, at most; past it lines are dropped."""
EXIT_DRAIN_S = 1.0
"""How long the process waits at exit for queued text to be written."""


class SafeStream:
    """A text stream over a file descriptor whose ``write`` never raises and never blocks.

    A write goes straight to the descriptor when that cannot block (a regular
    file; a pipe, socket or terminal with room for it and nothing queued);
    otherwise it is queued, up to ``MAX_QUEUED_CHARS``, for a daemon thread to
    write in order, and dropped past that. On a failed write (the reader gone:
    ``BrokenPipeError``; a full disk) the descriptor is pointed at
    ``/dev/null``, so nothing later fails either, the interpreter's flush at
    exit included. ``dropped`` counts the writes lost. A stream without a
    descriptor is written through, its errors swallowed.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.dropped = 0
        self._fd = _descriptor(stream)
        self._may_block = self._fd is not None and not stat.S_ISREG(os.fstat(self._fd).st_mode)
        self._encoding = getattr(stream, "encoding", None) or "utf-8"
        self._queue: deque[bytes] = deque()
        self._queued = 0
        self._busy = False
        self._cond = threading.Condition()
        self._writer: threading.Thread | None = None
        self._silenced = False

    def write(self, text: str) -> int:
        if self._fd is None:
            try:
                return self.stream.write(text)
            except (OSError, ValueError):
                self._lost()
                return len(text)
        data = text.encode(self._encoding, "backslashreplace")
        with self._cond:
            if not self._queue and not self._busy and self._writes_now(len(data)):
                self._write_all(data)
            elif self._queued + len(data) > MAX_QUEUED_CHARS:
                self.dropped += 1
            else:
                self._queue.append(data)
                self._queued += len(data)
                self._start_writer()
                self._cond.notify()
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        """Write what the stream beneath buffered; queued text goes as soon as it can."""
        try:
            self.stream.flush()
        except (OSError, ValueError):
            self._lost()

    def drain(self, within: float) -> bool:
        """Wait until the queued text is written, at most ``within`` seconds."""
        deadline = time.monotonic() + within
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def isatty(self) -> bool:
        try:
            return self.stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self.stream.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def _writes_now(self, size: int) -> bool:
        """Whether a write of ``size`` bytes goes through at once (it cannot block)."""
        if not self._may_block:
            return True
        assert self._fd is not None
        if size > select.PIPE_BUF:  # might be written in part, then block
            return False
        poller = select.poll()
        poller.register(self._fd, select.POLLOUT)
        return bool(poller.poll(0))

    def _write_all(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._fd, view) :]
            except OSError:
                self._lost()
                return

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(
                target=self._write_queued, name="plugserve-log-writer", daemon=True
            )
            self._writer.start()
            atexit.register(self.drain, EXIT_DRAIN_S)

    def _write_queued(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                data = b"".join(self._queue)
                self._queue.clear()
                self._queued = 0
                self._busy = True
            self._write_all(data)  # may block on a stalled reader: only this thread waits
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _lost(self) -> None:
        self.dropped += 1
        if self._silenced:
            return
        self._silenced = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self.stream.fileno())
            finally:
                os.close(devnull)
        except (OSError, ValueError):
            pass  # no descriptor of its own: writes keep failing, and keep being swallowed


def _descriptor(stream: TextIO) -> int | None:
    try:
        fd = stream.fileno()
        os.fstat(fd)
    except (OSError, ValueError, AttributeError):
        return None
    with contextlib.suppress(OSError, ValueError):
        stream.flush()  # what it buffered goes first
    return fd


def protect_std_streams() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` :class:`SafeStream` s (once; the server's own)."""
    if not isinstance(sys.stdout, SafeStream):
        sys.stdout = SafeStream(sys.stdout)
    if not isinstance(sys.stderr, SafeStream):
        sys.stderr = SafeStream(sys.stderr)


def flush_std_streams(within: float = EXIT_DRAIN_S) -> None:
    """Flush stdout and stderr, and wait (``within`` seconds at most) for what is queued."""
    deadline = time.monotonic() + within
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
        if isinstance(stream, SafeStream):
            stream.drain(max(0.0, deadline - time.monotonic()))
