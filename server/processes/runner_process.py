"""A runner process (``python -m plugserve.server.processes.runner_process``), started by a
RunnerHost.

It reads its spec (one JSON line) from stdin, loads one runner version here,
answers one JSON line (``ready`` with the version's metadata, or the error that
kept it from loading), then serves workers on its Unix socket: each connection
brings the worker's shared memory region, gets one of this process's, and
sends requests that join this process's batches. It ends on SIGTERM (after the
requests it holds are answered, within ``close_timeout_s``), or when the
process that started it ends (its stdin closes; PR_SET_PDEATHSIG as well).
Not a command for people to run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import orjson
import structlog

from plugserve.registry.errors import (
    InvalidInput,
    PayloadTooLarge,
    PluginError,
    PluginLoadError,
    PlugserveError,
)
from plugserve.registry.execution import tracing
from plugserve.registry.execution.components.batched import BatchedRunner
from plugserve.registry.execution.isolation.shm import Allocator, Region
from plugserve.registry.execution.isolation.supervision import die_with_parent
from plugserve.registry.execution.isolation.wire import (
    NO_REQUEST,
    SMALL_BYTES,
    FrameReader,
    FrameTooLarge,
    error_message,
    frame,
    get_tensors,
    put_tensors,
)
from plugserve.registry.execution.layout import TensorBounds
from plugserve.registry.lifecycle.loader import Loader
from plugserve.registry.plugins.hooks import PluginHooks
from plugserve.server.runtime import heap

log = structlog.get_logger("plugserve.runner")

Answer = asyncio.Future[Mapping[str, np.ndarray]]
"""A request's outputs, once its batch ran."""


class RunnerProcess:
    def __init__(self, spec: dict[str, Any], answer_fd: int) -> None:
        self.spec = spec
        self.answer_fd = answer_fd
        self.stop = asyncio.Event()
        self.loaded: BatchedRunner | None = None
        self.connections: set[Serving] = set()
        self.pumping = False
        """In :meth:`_pump`: answers wait for their connection's settle, not a step."""
        self.shm_bytes = int(spec["shm_bytes"])
        self.accepting: set[asyncio.Task[None]] = set()
        self._pump_at: asyncio.Handle | None = None

    def _answer(self, **fields: Any) -> None:
        os.write(self.answer_fd, orjson.dumps(fields) + b"\n")
        os.close(self.answer_fd)

    async def run(self) -> int:
        spec = self.spec
        host = PluginHooks()
        host.load_builtins()
        host.load_entry_points()
        plugins_dir = spec.get("plugins_dir")
        loader = Loader(
            host,
            Path(spec["models_dir"]),
            plugins_dir=None if plugins_dir is None else Path(plugins_dir),
            load_timeout=float(spec["load_timeout"]),
            close_timeout=float(spec["close_timeout"]),
        )
        bounds = TensorBounds()
        loader.tensor_bounds = TensorBounds(
            int(spec.get("max_tensor_elements", bounds.max_elements)),
            int(spec.get("max_bytes_elements", bounds.max_bytes_elements)),
        )
        try:
            loaded = await loader.load(Path(spec["folder"]), in_process=True)
            if not isinstance(loaded, BatchedRunner):  # a streaming runner
                await loader.release(loaded)
                raise PluginLoadError(
                    f"{loaded.label}: a streaming runner cannot run isolated (isolation = "
                    '"process") yet: its responses have no way back; serve it in the workers'
                )
            self.loaded = loaded
            loaded.run_inline()  # one thread hop fewer on every batch, nor a task a batch
        except PlugserveError as exc:
            self._answer(ready=False, error=exc.message)
            return 1
        except Exception as exc:
            self._answer(ready=False, error=f"{spec['label']}: {type(exc).__name__}: {exc}")
            return 1
        loop = asyncio.get_running_loop()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(spec["socket"])
        listener.listen(256)
        listener.setblocking(False)
        loop.add_reader(listener.fileno(), self._accept, listener)
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        loop.add_signal_handler(signal.SIGINT, lambda: None)  # the server's Ctrl-C: its call
        loop.add_reader(0, self._lifeline)
        heap.settle()  # the collector off the request path (server/runtime/heap.py)
        self._answer(ready=True, pid=os.getpid(), metadata=loaded.metadata())
        await self.stop.wait()
        loop.remove_reader(listener.fileno())
        listener.close()
        await self._drain(float(spec["close_timeout"]))
        await loader.release(loaded)
        return 0

    def _lifeline(self) -> None:
        try:
            data = os.read(0, 4096)
        except OSError:
            data = b""
        if not data:  # whoever started us is gone
            asyncio.get_running_loop().remove_reader(0)
            self.stop.set()

    def pump_soon(self) -> None:
        """Cut batches once this step of the loop has read every connection."""
        if self._pump_at is None:
            self._pump_at = asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_at = None
        self.pumping = True
        try:
            if self.loaded is not None:
                self.loaded.scheduler.pump()
        finally:
            try:
                for connection in list(self.connections):
                    connection.settle()
            finally:
                self.pumping = False

    async def _drain(self, within: float) -> None:
        """Answer the requests held (a stop after the server drained finds none)."""
        held = [f for c in self.connections for f in c.requests.values()]
        if held:
            await asyncio.wait(held, timeout=within)
        for connection in list(self.connections):
            connection.close()

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        theirs = ours = None
        try:
            sock.settimeout(5.0)
            data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
            hello = orjson.loads(data)
            theirs = Region(int(hello["size"]), fds[0])
            ours = Region(self.shm_bytes)
            assert ours.fd is not None
            socket.send_fds(sock, [orjson.dumps({"size": ours.size})], [ours.fd])
            ours.close_fd()
            sock.setblocking(False)
        except (OSError, ValueError, KeyError, IndexError, orjson.JSONDecodeError) as exc:
            # A caller that gave up (its handshake timed out) leaves nothing behind here.
            log.warning("runner_connection_refused", error=str(exc))
            for region in (theirs, ours):
                if region is not None:
                    region.close_fd()
                    region.map.close()
            sock.close()
            return
        loop = asyncio.get_running_loop()
        assert self.loaded is not None
        loaded = self.loaded

        async def connect() -> None:
            await loop.connect_accepted_socket(lambda: Serving(self, loaded, theirs, ours), sock)

        task = loop.create_task(connect())
        self.accepting.add(task)
        task.add_done_callback(self.accepting.discard)


class Serving(asyncio.Protocol):
    """One worker's connection: requests in, answers out, frames of one step written at once."""

    def __init__(self, owner: RunnerProcess, loaded: BatchedRunner, theirs: Region, ours: Region):
        self.owner = owner
        self.loaded = loaded
        self.theirs = theirs
        self.ours = ours
        self.allocator = Allocator(ours.size)
        self.requests: dict[int, asyncio.Future[Mapping[str, np.ndarray]]] = {}
        self.transport: asyncio.Transport | None = None
        self._reader = FrameReader(self._refuse)
        self._queued: list[bytes] = []
        self._flush_at: asyncio.Handle | None = None
        self._fresh: list[tuple[int, Answer, dict[str, float], float]] = []
        """Requests read in this step, answered or watched by :meth:`settle`."""
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is not a subclass
        self.owner.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.connections.discard(self)
        for future in self.requests.values():  # its worker is gone: nobody waits for these
            future.cancel()
        self.transport = None
        self.settle()  # what this step read is answered (to nobody): each frees its place

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            for message, raw in self._reader.feed(data):
                try:
                    self._receive(message, raw)
                except (ValueError, KeyError, TypeError) as exc:  # a malformed field
                    self._refuse(message.get("i", NO_REQUEST), exc)
        finally:
            self.owner.pump_soon()

    def _receive(self, message: dict[str, Any], raw: memoryview) -> None:
        kind = message["k"]
        if kind == "infer":
            self._enqueue(message, raw)
        elif kind == "cancel":
            queued = self.requests.get(message["i"])
            if queued is not None:
                queued.cancel()
        elif kind == "free":
            for offset in message["o"]:
                self.allocator.free(offset)
        elif kind == "stats":
            self._send(frame({"k": "stats", "i": message["i"], **self.figures()}))

    def _refuse(self, request_id: Any, problem: Exception) -> None:
        """A frame this process cannot take (too large, unreadable, a malformed field):
        its request, if it names one, is answered with the reason; the connection and the
        other requests on it go on."""
        log.warning("runner_frame_refused", request=request_id, error=str(problem))
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            return
        if request_id == NO_REQUEST or request_id in self.requests:
            return  # no request, or one already queued (a malformed cancel): it answers
        status = PayloadTooLarge if isinstance(problem, FrameTooLarge) else InvalidInput
        refusal = status(f"runner process {os.getpid()} could not take the request: {problem}")
        self._send(frame(error_message(request_id, refusal)))

    def _enqueue(self, message: dict[str, Any], raw: memoryview) -> None:
        """Queue a request in the scheduler, undispatched: what arrived together in this
        step of the loop (from every worker) is cut into batches together afterwards."""
        request_id = message["i"]
        loaded = self.loaded
        scheduler, breaker = loaded.scheduler, loaded.breaker
        timings: dict[str, float] = {}
        try:
            inputs = get_tensors(message["x"], self.theirs, raw)
            loaded.validate_request(inputs)
            breaker.allow()
        except PlugserveError as exc:
            self._send(frame(error_message(request_id, exc)))
            return
        except (ValueError, TypeError) as exc:
            self._send(frame(error_message(request_id, PluginError(loaded.label, exc))))
            return
        token = None
        if tracing.TRACER is not None and "tp" in message:  # the worker's trace goes on here
            token = tracing.attach(message["tp"])
        try:
            if loaded.sequences is not None:  # in its sequence's turn, with its state
                future = self._in_sequence(message, inputs, timings)
            else:
                future = scheduler.enqueue(
                    inputs, message.get("d"), message.get("p"), message.get("t"), timings,
                    pump=False,
                )  # fmt: skip
        except PlugserveError as exc:
            breaker.release()
            self._send(frame(error_message(request_id, exc)))
            return
        except BaseException:  # a malformed field ("p", "t"): refused (data_received)
            breaker.release()
            raise
        finally:
            if token is not None:
                tracing.detach(token)
        self.requests[request_id] = future
        self._fresh.append((request_id, future, timings, time.perf_counter()))

    def _in_sequence(
        self, message: dict[str, Any], inputs: Mapping[str, np.ndarray], timings: dict[str, float]
    ) -> asyncio.Future[Mapping[str, np.ndarray]]:
        """A request of a runner that keeps sequences: a task that waits for its sequence's
        turn (``registry/execution/sequences.py``), then joins a batch."""
        loaded = self.loaded
        assert loaded.sequences is not None
        parameters = message.get("q") or {}
        if not isinstance(parameters, dict):
            raise InvalidInput("malformed sequence parameters")
        scheduler, deadline, priority, tenant = (
            loaded.scheduler, message.get("d"), message.get("p"), message.get("t")
        )  # fmt: skip
        return asyncio.ensure_future(
            loaded.sequences.run(
                inputs,
                parameters,
                lambda fed: scheduler.submit(fed, deadline, priority, tenant, timings),
            )
        )

    def settle(self) -> None:
        """After the pump that followed this step's reads: answer the requests its batches
        resolved (they ran inline), watch the others, and write this step's answers."""
        fresh, self._fresh = self._fresh, []
        try:
            for request_id, future, timings, started in fresh:
                answer = functools.partial(self._answer, request_id, timings, started)
                if not future.done():
                    future.add_done_callback(answer)
                    continue
                try:
                    answer(future)
                except Exception:  # one answer's fault must not strand the others
                    log.exception("runner_answer_failed", request=request_id)
        finally:
            if self._queued:
                self._flush()

    def _answer(
        self,
        request_id: int,
        timings: dict[str, float],
        started: float,
        future: asyncio.Future[Mapping[str, np.ndarray]],
    ) -> None:
        self.requests.pop(request_id, None)
        loaded = self.loaded
        if loaded.breaker is not None:
            loaded.breaker.release()
        if future.cancelled():
            self._send(frame({"k": "cancelled", "i": request_id}))
            return
        exc = future.exception()
        if exc is not None:
            if not isinstance(exc, PlugserveError):
                exc = PluginError(loaded.label, exc)
            self._send(frame(error_message(request_id, exc)))
            return
        outputs = future.result()
        queue = timings.get("queue", 0.0)
        answer = {
            "k": "ok",
            "i": request_id,
            "q": queue,
            "c": time.perf_counter() - started - queue,
        }
        taken: list[int] = []
        try:
            answer["y"], chunks, taken = put_tensors(
                outputs, self.ours, self.allocator, SMALL_BYTES
            )
            data = frame(answer, chunks)
        except Exception as problem:  # too large for a frame, out of memory, not arrays ...
            for offset in taken:  # the worker never learns of them: they are freed here
                self.allocator.free(offset)
            self._send(frame(error_message(request_id, PluginError(loaded.label, problem))))
            return
        self._send(data)

    def figures(self) -> dict[str, Any]:
        loaded = self.loaded
        scheduler, breaker = loaded.scheduler, loaded.breaker
        return {
            "pid": os.getpid(),
            "executions": scheduler.executions if scheduler else 0,
            "rows": scheduler.rows if scheduler else 0,
            "queued": scheduler.queued if scheduler else 0,
            "circuit": breaker.state if breaker is not None and breaker.enabled else None,
            "stats": loaded.stats.executions_json() if loaded.stats is not None else None,
            "apart": scheduler.apart if scheduler else 0,
            "apart_why": scheduler.apart_why if scheduler else None,
            "fallback_why": scheduler.fallback_why if scheduler else None,
            "batching_check": loaded.batching_checked(),
            "sequences": loaded.sequences.describe() if loaded.sequences is not None else None,
        }

    def _send(self, data: bytes) -> None:
        self._queued.append(data)
        if self._flush_at is None and not self.owner.pumping:  # the pump's settle writes
            self._flush_at = self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        queued, self._queued = self._queued, []
        if self.transport is not None and queued:
            self.transport.write(b"".join(queued))


def main() -> int:
    # SIGKILL when the process that started this one ends. Not SIGTERM: a runner blocked in
    # its plugin's code never gets to a handler, and nobody is left to answer.
    die_with_parent(signal.SIGKILL, os.getppid())
    # Everything imported before the spec is read: a spare process, started ahead of the
    # next load, has paid for its interpreter and imports when its spec comes.
    from plugserve.server.cli import _event_loop
    from plugserve.server.runtime.logs import configure_logging
    from plugserve.server.runtime.stdio import protect_std_streams

    line = sys.stdin.buffer.readline()
    if not line:  # a spare nobody needed: the server is stopping
        return 0
    spec = orjson.loads(line)
    # The answer line goes on the original stdout; what plugins print goes to stderr.
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    protect_std_streams()
    configure_logging(spec["log_format"], spec["log_level"])
    tracing.configure()  # spans only where an SDK is set up (as in the server's processes)
    structlog.contextvars.bind_contextvars(runner=spec["label"], instance=spec["instance"])
    loop = _event_loop(spec.get("event_loop", "auto"))
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(RunnerProcess(spec, answer_fd).run())
    finally:
        with contextlib.suppress(Exception):
            loop.close()


if __name__ == "__main__":
    sys.exit(main())
