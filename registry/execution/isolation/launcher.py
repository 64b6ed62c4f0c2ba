"""Starting runner processes: the handshake that hands a new process its spec and waits
for its load, a spare process started ahead so that a load need not wait for an
interpreter, and the folder of the processes' sockets.

A new process imports what it needs, then reads its spec (one JSON line) on stdin, which
stays open as its lifeline, and answers with one line: loaded (with its metadata) or why
not. The sockets' folder is the host's own (``plugserve-runners-<pid>-*``); the folders
of servers that are gone are swept when a host makes its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from plugserve.registry.errors import PluginLoadError
from plugserve.registry.execution.isolation.groups import (
    ProcessSettings,
    RunnerProcess,
    RunnerSpec,
    describe_exit,
)

RUNNER_MODULE = "plugserve.server.processes.runner_process"
START_SLACK_S = 10.0
"""Beyond ``load_timeout_s``: the time a new interpreter takes to import what it needs."""


class ProcessLauncher:
    """Starts the runner processes of one host: each with a socket in the host's folder,
    from the spare started ahead where one is ready, through the handshake that hands it
    its spec; at shutdown it kills the processes it started that are still running."""

    def __init__(self, settings: ProcessSettings) -> None:
        self.settings = settings
        self._folder: Path | None = None
        self._sockets = 0
        self._spare: asyncio.Task[asyncio.subprocess.Process] | None = None
        self._closing = False
        self._started: set[asyncio.subprocess.Process] = set()
        """Every process started: a shutdown kills those its stops did not end."""

    def socket_path(self) -> Path:
        """A new socket path in the host's own folder (made, 0700, at the first)."""
        if self._folder is None:
            under = socket_root()
            sweep_folders(under)
            prefix = f"{FOLDER_PREFIX}{os.getpid()}-"
            self._folder = Path(tempfile.mkdtemp(prefix=prefix, dir=under))  # 0700: ours alone
        self._sockets += 1
        return self._folder / f"{self._sockets}.sock"

    async def launch(
        self, spec: RunnerSpec, process: RunnerProcess
    ) -> tuple[asyncio.subprocess.Process, dict[str, Any]]:
        """Start the process of instance ``process`` of ``spec`` and wait for its answer:
        the process, loaded, and its answer (its metadata); :class:`PluginLoadError` when
        it does not load (it is ended then)."""
        settings = self.settings
        env = dict(os.environ)
        if process.device is not None:  # before any CUDA library loads in the child
            env["CUDA_VISIBLE_DEVICES"] = process.device.split(":", 1)[1]
        with contextlib.suppress(FileNotFoundError):
            process.socket.unlink()
        proc = self._take_spare() if process.device is None else None
        if proc is None:
            proc = await _start(env, self._started)
        self._keep_spare()
        assert proc.stdin is not None
        assert proc.stdout is not None
        request = {
            "folder": str(spec.folder),
            "label": spec.label,
            "models_dir": str(spec.models_dir),
            "plugins_dir": None if spec.plugins_dir is None else str(spec.plugins_dir),
            "load_timeout": spec.load_timeout,
            "close_timeout": spec.close_timeout,
            "socket": str(process.socket),
            "instance": process.index,
            "parent": os.getpid(),
            "log_format": settings.log_format,
            "log_level": settings.log_level,
            "event_loop": settings.event_loop,
            "shm_bytes": settings.shm_bytes,
            "max_tensor_elements": settings.tensor_bounds.max_elements,
            "max_bytes_elements": settings.tensor_bounds.max_bytes_elements,
        }
        proc.stdin.write(orjson.dumps(request) + b"\n")  # stdin stays open: the lifeline
        try:
            await proc.stdin.drain()
            line = await asyncio.wait_for(proc.stdout.readline(), spec.load_timeout + START_SLACK_S)
        except (TimeoutError, ConnectionError, asyncio.CancelledError) as exc:
            await kill(proc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise PluginLoadError(
                f"{spec.label}: its runner process did not load within "
                f"{spec.load_timeout + START_SLACK_S:g} s"
            ) from None
        answer = _answer(line)
        if answer is None or not answer.get("ready"):
            returncode = await _reap(proc)
            how = describe_exit(returncode)
            if answer is not None and answer.get("error"):
                raise PluginLoadError(str(answer["error"]), exit=how)
            raise PluginLoadError(
                f"{spec.label}: its runner process ended while loading ({how})", exit=how
            )
        return proc, answer

    def _take_spare(self) -> asyncio.subprocess.Process | None:
        """The spare process, started ahead and waiting for a spec, if it is ready."""
        task, self._spare = self._spare, None
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            if task is not None:
                task.cancel()
            return None
        proc = task.result()
        return proc if proc.returncode is None else None

    def _keep_spare(self) -> None:
        """Start the next spare: a runner process that imports what it needs and waits for
        a spec, so that a reload does not wait for an interpreter to start (about 0.7 s)."""
        if self._spare is None and not self._closing:
            self._spare = asyncio.create_task(_start(dict(os.environ), self._started))

    async def stop_spare(self) -> None:
        """No more spares (shutdown): the one started is killed."""
        self._closing = True
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.cancel()
            if spare.done() and not spare.cancelled() and spare.exception() is None:
                await kill(spare.result())

    async def close(self) -> None:
        """SIGKILL to every process started and still running (one a cancelled stop left),
        and the sockets' folder removed."""
        left = [proc for proc in self._started if proc.returncode is None]
        await asyncio.gather(*(kill(proc) for proc in left))
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


async def _start(
    env: dict[str, str], started: set[asyncio.subprocess.Process]
) -> asyncio.subprocess.Process:
    """A runner process (added to ``started``, the ended ones dropped from it); it imports
    what it needs, then waits for its spec on stdin."""
    started.difference_update([p for p in started if p.returncode is not None])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", RUNNER_MODULE,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    started.add(proc)
    return proc


FOLDER_PREFIX = "plugserve-runners-"


UNIX_PATH_MAX = 107
"""The longest path a Unix socket may bind (108 bytes with its terminating zero, Linux)."""


def socket_root() -> Path:
    """Where runner sockets go: the temporary dir, or ``/tmp`` when that one's path is too
    long for a socket inside it (a deep ``TMPDIR``: ``bind`` fails with "path too long")."""
    root = Path(tempfile.gettempdir())
    longest = f"{root}/{FOLDER_PREFIX}{os.getpid()}-xxxxxxxx/{10**6}.sock"
    return root if len(os.fsencode(longest)) <= UNIX_PATH_MAX else Path("/tmp")


def sweep_folders(under: Path | None = None) -> list[Path]:
    """Remove the runner-socket folders whose server is gone (killed: nothing of it could
    clean up), named ``plugserve-runners-<pid>-*``; returns those removed."""
    removed = []
    for folder in Path(under or tempfile.gettempdir()).glob(FOLDER_PREFIX + "*-*"):
        owner = folder.name[len(FOLDER_PREFIX) :].split("-", 1)[0]
        try:
            if not owner.isdigit() or folder.stat().st_uid != os.getuid():
                continue
            os.kill(int(owner), 0)  # raises when no such process
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        except (OSError, ValueError):
            continue
    return removed


def _answer(line: bytes) -> dict[str, Any] | None:
    try:
        answer = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return answer if isinstance(answer, dict) else None


async def _reap(proc: asyncio.subprocess.Process, within: float = 5.0) -> int | None:
    try:
        return await asyncio.wait_for(proc.wait(), within)
    except TimeoutError:
        await kill(proc)
        return proc.returncode


async def kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()
