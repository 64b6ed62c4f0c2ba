"""A worker's side of an isolated runner: the component that stands for it in the chain.

Each request goes to one of the version's runner processes (the one with the
fewest requests outstanding) over a Unix socket; its tensors are written once
into this worker's shared memory region for that connection, the outputs are
read in place from the process's region and its block given back once the
arrays made from it are gone. Frames written within one event-loop step go out
in one system call.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import weakref
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import orjson
import structlog

from plugserve.registry.errors import PayloadTooLarge, PlugserveError, Unavailable
from plugserve.registry.execution import tracing
from plugserve.registry.execution.isolation.shm import Allocator, Region
from plugserve.registry.execution.isolation.wire import (
    FrameReader,
    FrameTooLarge,
    error_from,
    frame,
    get_tensors,
    put_tensors,
)
from plugserve.registry.execution.sequences import SEQUENCE_FIELDS
from plugserve.registry.execution.stats import RunnerStats

if TYPE_CHECKING:
    from plugserve.registry.execution.isolation.groups import RunnerGroup, Runners
    from plugserve.registry.types import RequestContext

log = structlog.get_logger("plugserve.registry")

HANDSHAKE_TIMEOUT_S = 5.0


class RunnerCrashed(PlugserveError):
    """The runner process serving a request ended before it answered."""

    status = 500


class ConnectionLost(Exception):
    def __init__(self, pid: int) -> None:
        super().__init__(pid)
        self.pid = pid


class UnreadableAnswer(PlugserveError):
    """The runner process answered a request with a frame this worker cannot read."""

    status = 500


class RemoteRunner:
    """The component of an isolated runner version in this process."""

    def __init__(self, host: Runners, group: RunnerGroup) -> None:
        self.host = host
        self.key = group.key
        self.label = group.spec.label
        self.group = group
        self._metadata = group.metadata
        self._connections: list[Connection | None] = [None] * len(group.processes)
        self._connecting: dict[int, asyncio.Task[Connection]] = {}
        self._closed = False
        self.figures: dict[str, Any] = {}
        """The processes' own figures, as last read (:meth:`refresh`)."""

    def metadata(self) -> dict[str, Any] | None:
        return self._metadata

    async def infer(self, inputs: Mapping[str, np.ndarray], ctx: RequestContext) -> Any:
        sequence = ctx.parameters.get("sequence_id") if ctx.parameters else None
        index = self._pick() if sequence is None else self._owner(sequence)
        connection = await self._connection(index)
        try:
            return await connection.request(inputs, ctx)
        except ConnectionLost as lost:
            how = await self.host.ended(self.key, index, lost.pid)
            if how is None:  # the process goes on: only this connection closed
                raise Unavailable(
                    f"{self.label}: the connection to its runner process (pid {lost.pid}) "
                    "closed during the request; the process did not end",
                    plugin=self.label,
                    pid=lost.pid,
                    retry_after_s=1,
                ) from None
            raise RunnerCrashed(
                f"{self.label}: its runner process (pid {lost.pid}) ended during the request: "
                f"{how}",
                plugin=self.label,
                pid=lost.pid,
                exit=how,
            ) from None

    def _owner(self, sequence_id: Any) -> int:
        """The process that keeps a sequence's state: the same one from every worker (a
        hash of the id that does not vary between processes, unlike ``hash``)."""
        return zlib.crc32(repr(sequence_id).encode("utf-8", "replace")) % len(self._connections)

    def _pick(self) -> int:
        best, least = 0, None
        for index, connection in enumerate(self._connections):
            load = connection.outstanding if connection is not None and connection.alive else 0
            if least is None or load < least:
                best, least = index, load
        return best

    async def _connection(self, index: int) -> Connection:
        connection = self._connections[index]
        if connection is not None and connection.alive:
            return connection
        if self._closed:
            raise Unavailable(f"{self.label}: released")
        task = self._connecting.get(index)
        if task is None:
            task = self._connecting[index] = asyncio.create_task(self._connect(index))
            task.add_done_callback(lambda _: self._connecting.pop(index, None))
        return await asyncio.shield(task)

    async def _connect(self, index: int) -> Connection:
        process = await self.host.ready(self.key, index)
        assert process.pid is not None
        mirror = self.group.processes[index]  # a worker's copy: the pid serving now
        if mirror is not process:
            mirror.pid = process.pid
            mirror.up.set()
        size = self.host.settings.shm_bytes
        connection = await Connection.connect(process.socket, process.pid, size)
        self._connections[index] = connection
        return connection

    def describe(self) -> dict[str, Any]:
        """What the admin API shows of the processes, with their figures as last read
        (:meth:`refresh`)."""
        group = self.group
        return {
            "isolation": "process",
            "pids": group.pids,
            "restarts": group.restarts,
            **({"devices": group.devices} if group.devices else {}),
            **({"process_error": group.failed} if group.failed else {}),
            **{k: v for k, v in self.figures.items() if k != "stats"},
        }

    @property
    def executions(self) -> RunnerStats | None:
        """The processes' executions and batch sizes as last read; ``None`` where the
        supervisor counts them (several workers)."""
        stats = self.figures.get("stats")
        return stats if isinstance(stats, RunnerStats) else None

    async def refresh(self) -> None:
        """Read the processes' own figures (:meth:`RunnerHost.figures`); where a supervisor
        runs them, it fills them in itself and this stays empty."""
        self.figures = await self.host.figures(self.key)

    async def close(self) -> None:
        """Close the connections and release the processes (ended once nobody uses them)."""
        self._closed = True
        for connection in self._connections:
            if connection is not None:
                connection.close()
        await self.host.release(self.key)


class Connection(asyncio.Protocol):
    """One worker's connection to one runner process."""

    def __init__(self, pid: int, region: Region, out: Region) -> None:
        self.pid = pid
        self.region = region
        self.allocator = Allocator(region.size)
        self.out = out
        self.alive = True
        self.transport: asyncio.Transport | None = None
        self._reader = FrameReader(self._unreadable)
        self._ids = itertools.count()
        self._pending: dict[int, tuple[asyncio.Future[Any] | None, list[int], Any]] = {}
        self._queued: list[bytes] = []
        self._released: list[int] = []
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()
        self._flush_at: asyncio.Handle | None = None

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    @classmethod
    async def connect(cls, path: Path, pid: int, size: int) -> Connection:
        loop = asyncio.get_running_loop()
        region = Region(size)
        try:
            sock, out = await asyncio.to_thread(_handshake, path, region)
        except OSError as exc:
            raise Unavailable(
                f"runner process {pid} cannot be reached: {exc}", retry_after_s=1
            ) from None
        finally:
            region.close_fd()
        _, protocol = await loop.create_unix_connection(lambda: cls(pid, region, out), sock=sock)
        return protocol

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        for message, raw in self._reader.feed(data):
            self._answer(message, raw)

    def _unreadable(self, request_id: int, problem: Exception) -> None:
        """A frame this worker cannot read (too large, not JSON): its request alone fails
        with the reason, if it is still pending; the connection goes on."""
        log.warning(
            "runner_answer_unreadable", pid=self.pid, request=request_id, error=str(problem)
        )
        entry = self._pending.pop(request_id, None)
        if entry is not None:
            future, taken, _ = entry
            for offset in taken:
                self.allocator.free(offset)
            self._fail(future, problem)

    def _fail(self, future: asyncio.Future[Any] | None, problem: Exception) -> None:
        if future is not None and not future.done():
            future.set_exception(
                UnreadableAnswer(
                    f"runner process {self.pid} sent an answer that cannot be read: {problem}"
                )
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False
        for future, _, _ in self._pending.values():
            if future is not None and not future.done():
                future.set_exception(ConnectionLost(self.pid))
        self._pending.clear()

    # -- requests ----------------------------------------------------------------------

    async def request(self, inputs: Mapping[str, np.ndarray], ctx: RequestContext) -> Any:
        if not self.alive or self.transport is None:
            raise ConnectionLost(self.pid)
        request_id = next(self._ids)
        descriptors, chunks, taken = put_tensors(inputs, self.region, self.allocator)
        message: dict[str, Any] = {"k": "infer", "i": request_id, "x": descriptors}
        if ctx.deadline is not None:
            message["d"] = ctx.deadline
        if ctx.priority is not None:
            message["p"] = ctx.priority
        if ctx.tenant is not None:
            message["t"] = ctx.tenant
        if ctx.request_id:
            message["r"] = ctx.request_id
        sequence = _sequence_fields(ctx.parameters)
        if sequence:
            message["q"] = sequence
        if tracing.TRACER is not None:  # the runner process's spans join this trace
            message["tp"] = tracing.inject()
        try:
            data = frame(message, chunks)
        except FrameTooLarge as exc:
            for offset in taken:
                self.allocator.free(offset)
            raise PayloadTooLarge(
                f"the request's tensors cannot reach the runner process: {exc}"
            ) from None
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[request_id] = (future, taken, ctx)
        self._send(data)
        try:
            return await future
        except asyncio.CancelledError:
            entry = self._pending.get(request_id)
            if entry is not None:  # still with the process: its blocks wait for its answer
                self._pending[request_id] = (None, entry[1], None)
                self._send(frame({"k": "cancel", "i": request_id}))
            raise

    async def figures(self) -> dict[str, Any]:
        """The process's own figures: executions, rows, queued, batch sizes."""
        if not self.alive or self.transport is None:
            raise ConnectionLost(self.pid)
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._pending[request_id] = (future, [], None)
        self._send(frame({"k": "stats", "i": request_id}))
        try:
            return await future
        finally:
            self._pending.pop(request_id, None)  # answered, or given up on

    def _answer(self, message: dict[str, Any], raw: memoryview) -> None:
        request_id = message.get("i")
        entry = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
        if entry is None:
            return
        future, taken, ctx = entry
        for offset in taken:
            self.allocator.free(offset)
        if future is not None and future.done():
            # Cancelled, and its task not yet resumed to say so (:meth:`request`): the
            # task's cancel() cancels the future at once, its except clause runs later.
            future = None
        try:
            self._settle(future, ctx, message, raw)
        except (ValueError, KeyError, TypeError, IndexError) as exc:  # a malformed field
            log.warning(
                "runner_answer_unreadable", pid=self.pid, request=request_id, error=str(exc)
            )
            self._fail(future, exc)

    def _settle(
        self, future: asyncio.Future[Any] | None, ctx: Any, message: dict[str, Any], raw: memoryview
    ) -> None:
        kind = message["k"]
        if kind == "ok":
            if future is None:  # cancelled meanwhile: give its output blocks back now
                self._released.extend(d[4] for d in message["y"] if d[3] == "s")
                self._schedule()
                return
            outputs = get_tensors(message["y"], self.out, raw, self._keep)
            ctx.timings["queue"] = message.get("q", 0.0)
            ctx.timings["compute_infer"] = message.get("c", 0.0)
            future.set_result(outputs)
        elif kind == "error" and future is not None:
            future.set_exception(error_from(message))
        elif kind == "cancelled" and future is not None:  # its batch was cancelled there
            future.set_exception(
                Unavailable(
                    f"runner process {self.pid} cancelled the request: it was stopping, or "
                    "its plugin cancelled the batch",
                    retry_after_s=1,
                )
            )
        elif kind == "stats" and future is not None:
            future.set_result(message)

    def _keep(self, view: np.ndarray, offset: int) -> np.ndarray:
        """The block under ``view`` goes back to the process once no array uses it."""
        weakref.finalize(view, self._release, offset)
        return view

    def _release(self, offset: int) -> None:
        self._released.append(offset)  # any thread: list.append holds the GIL
        if self._flush_at is None and self.alive:
            if threading.get_ident() == self._thread:
                self._schedule()
            else:
                self._loop.call_soon_threadsafe(self._schedule)

    # -- writing -------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        self._queued.append(data)
        self._schedule()

    def _schedule(self) -> None:
        if self._flush_at is None:
            self._flush_at = self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_at = None
        if self._released:
            self._queued.append(frame({"k": "free", "o": self._released}))
            self._released = []
        queued, self._queued = self._queued, []
        if self.transport is not None and self.alive and queued:
            self.transport.write(b"".join(queued))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _handshake(path: Path, region: Region) -> tuple[socket.socket, Region]:
    """Connect, send our region's descriptor, map the process's (on a thread: it blocks)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        sock.connect(str(path))
        assert region.fd is not None
        socket.send_fds(sock, [orjson.dumps({"size": region.size})], [region.fd])
        data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        if not data or not fds:
            raise ConnectionError("the runner process closed the connection")
        answer = orjson.loads(data)
        out = Region(int(answer["size"]), fds[0])
        sock.setblocking(False)
        return sock, out
    except BaseException:
        sock.close()
        raise


def _sequence_fields(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """The request's sequence parameters, for a runner process that keeps sequences."""
    if not parameters:
        return {}
    return {key: parameters[key] for key in SEQUENCE_FIELDS if key in parameters}
