"""What every kind of loaded plugin shares: its load, its lifecycle, who is using it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from plugserve.registry.backends.refusals import ort_refusal
from plugserve.registry.errors import (
    InvalidInput,
    PluginError,
    PluginLoadError,
    PlugserveError,
    one_error,
)
from plugserve.registry.manifest import Manifest
from plugserve.registry.plugins.calls import call_plugin
from plugserve.registry.tensors.inputs import InputSpec, conform, input_specs
from plugserve.registry.types import PluginInfo, RequestContext

if TYPE_CHECKING:
    from plugserve.registry.execution.breaker import CircuitBreaker
    from plugserve.registry.execution.isolation.remote import RemoteRunner
    from plugserve.registry.execution.sequences import SequenceHolder
    from plugserve.registry.execution.stats import RunnerStats

_LOADS = itertools.count(1)


@dataclass(eq=False)
class LoadedPlugin(ABC):
    """One load (generation) of one plugin version, ready or about to be.

    The kinds (``registry/components/``) differ in how a request reaches the
    component: a processor's :class:`~plugserve.registry.execution.components.stage.Stage`,
    a :class:`~plugserve.registry.execution.components.batched.BatchedRunner`, a
    :class:`~plugserve.registry.execution.components.streaming.StreamingRunner`, an
    :class:`~plugserve.registry.execution.components.isolated.IsolatedRunner`. Everything
    else is here: the label and version, the manifest, the requests and calls in
    flight (:meth:`enter`, :meth:`leave`, :meth:`wait_idle`), :meth:`warmup` and
    :meth:`close`, the statistics and breaker a kind may keep.
    """

    manifest: Manifest
    info: PluginInfo
    component: Any
    package: str | None = None
    hook_name: str | None = None
    model_path: Path | None = None
    loaded_at: float = field(default_factory=time.time)
    load_id: int = field(init=False, default_factory=lambda: next(_LOADS))
    """Unique to this load in this process: a reload of the same version gets a new one."""
    in_flight: int = 0
    executing: int = 0
    last_use: float = 0.0
    """When a request last entered it (``time.monotonic()``, one clock for every process
    of the machine): the memory budget's least recently used order, across workers."""
    """Calls still on a worker thread; one whose request was cancelled (its client hung
    up, its deadline passed) keeps the instance busy until the thread returns."""
    stats: RunnerStats | None = field(init=False, default=None, repr=False)
    """A runner's statistics (requests, executions); ``None`` for a processor."""
    breaker: CircuitBreaker | None = field(init=False, default=None, repr=False)
    """A runner's circuit breaker, where it runs in this process."""
    remote: RemoteRunner | None = field(init=False, default=None, repr=False)
    """An isolated runner's processes (``isolation = "process"``); ``None`` for the others."""
    inline_executions: int = field(init=False, default=0)
    """Synchronous calls that ran on the event loop rather than on a thread."""
    _executor: ThreadPoolExecutor | None = field(init=False, default=None, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(init=False, default=None, repr=False)
    _idle: asyncio.Event | None = field(init=False, default=None, repr=False)
    _metadata: dict[str, Any] | None = field(init=False, default=None, repr=False)
    _inputs: tuple[InputSpec, ...] = field(init=False, default=(), repr=False)
    _input_dtypes: dict[str, np.dtype[Any] | None] = field(
        init=False, default_factory=dict, repr=False
    )

    @property
    def label(self) -> str:
        return self.manifest.label

    @property
    def version(self) -> str:
        return str(self.manifest.version)

    @property
    def rejecting(self) -> bool:
        """Whether this runner's circuit breaker refuses requests now."""
        return self.breaker is not None and self.breaker.rejecting

    @property
    def queued(self) -> int | None:
        """What waits for the component now (requests, streams); ``None`` where nothing can."""
        return None

    def describe(self) -> dict[str, Any]:
        """What the admin API shows of how this instance runs its calls."""
        return {}

    def _method_named(self, name: str) -> Callable[..., Any]:
        """The component's method ``name``; :class:`PluginLoadError` where it has none."""
        method: Callable[..., Any] | None = getattr(self.component, name, None)
        if not callable(method):
            raise PluginLoadError(f"{self.label}: its component has no {name}() method")
        return method

    # -- the request path ----------------------------------------------------------------

    @abstractmethod
    async def call(self, data: Any, ctx: RequestContext) -> Any:
        """Run this stage on ``data``; a plugin's exception becomes :class:`PluginError`."""

    def check_request(
        self, inputs: Mapping[str, np.ndarray], route: str
    ) -> Mapping[str, np.ndarray]:
        """A request's tensors checked against this first stage's declared inputs (if any).

        Names, ranks, fixed dimensions and datatypes must match (400 otherwise).
        """
        if not self._inputs:
            return inputs
        return conform(self._inputs, inputs, f"route {route!r}", False)

    # -- lifecycle -----------------------------------------------------------------------

    async def warmup(self, within: float) -> None:
        """Run the component's ``warmup()``, then read its ``metadata()``, within ``within`` s.

        Raises :class:`PluginCallTimeout` past the bound (``load_timeout_s``).
        """
        deadline = time.monotonic() + within
        await self._call_optional("warmup", within, "load_timeout_s")
        left = deadline - time.monotonic()
        self._metadata = await self._call_optional("metadata", left, "load_timeout_s")
        self._inputs = input_specs(self._metadata)
        self._input_dtypes = {spec.name: spec.dtype for spec in self._inputs}

    async def close(self, within: float) -> None:
        """Run the component's ``close()`` within ``within`` s; then its thread pool is shut down.

        Raises :class:`PluginCallTimeout` past the bound (``close_timeout_s``).
        """
        try:
            await self._call_optional("close", within, "close_timeout_s")
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None

    async def _call_optional(self, name: str, within: float, setting: str) -> Any:
        method = getattr(self.component, name, None)
        if not callable(method):
            return None
        return await call_plugin(method, within, self.label, name, setting)

    def metadata(self) -> dict[str, Any] | None:
        """The component's ``metadata()`` as read at warmup: tensor specs, or ``None``."""
        return self._metadata

    def live_sequences(self) -> SequenceHolder | None:
        """The sequences this instance runs (``[runner.sequence]``): kept in this process,
        or, for an isolated runner, those this worker's requests run in its processes."""
        return None

    # -- in-flight accounting (no await between resolving a chain and entering it) ------

    def enter(self) -> None:
        self.in_flight += 1
        self.last_use = time.monotonic()

    def leave(self) -> None:
        self.in_flight -= 1
        self._check_idle()

    def _check_idle(self) -> None:
        if self.in_flight == 0 and self.executing == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, within: float) -> bool:
        """Wait until no request uses this instance and no call of it is still running on a
        thread; ``False`` if ``within`` seconds pass first."""
        if self.in_flight == 0 and self.executing == 0:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), within)
        except TimeoutError:
            return False
        return True

    async def _on_thread(self, work: Callable[..., Any], *args: Any) -> Any:
        """Run ``work(*args)`` (``infer``, a processor's call) on a worker thread, counted in
        :attr:`executing` until it returns.

        A request cancelled meanwhile (deadline, hang-up) stops waiting, but the
        thread cannot be stopped: it stays counted until it returns, so no unload
        closes the instance under it.
        """
        assert self._executor is not None
        future = self._executor.submit(work, *args)
        self.executing += 1
        try:
            result = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._loop = asyncio.get_running_loop()
            future.add_done_callback(self._executed)  # still running: counted until it returns
            raise
        except BaseException:
            self._thread_returned()
            raise
        self._thread_returned()
        return result

    def _executed(self, _: object) -> None:
        """A worker thread returned (from the thread: handed to the loop)."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self._thread_returned)

    def _thread_returned(self) -> None:
        self.executing -= 1
        self._check_idle()

    # -- faults --------------------------------------------------------------------------

    def _fault(self, exc: BaseException) -> PlugserveError:
        """What the client gets for ``exc`` raised in this plugin: its own error, a backend's
        refusal of the inputs (ONNX Runtime's, called by the plugin itself) as a 400, or a
        500 naming the plugin; of an exception group, its one error's (:func:`one_error`)."""
        exc = one_error(exc)
        if isinstance(exc, InvalidInput):
            return self._refused(exc)
        if isinstance(exc, PlugserveError):
            return exc
        refusal = ort_refusal(exc)
        if refusal is not None:
            return self._refused(InvalidInput(f"ONNX Runtime refused the inputs: {refusal}"))
        return PluginError(self.label, exc)

    def _raise_fault(self, exc: Exception) -> NoReturn:
        """Raise what an exception of the plugin's becomes (:meth:`_fault`)."""
        fault = self._fault(exc)
        if fault is exc:
            raise exc
        raise fault from (exc if fault.status == 500 else None)

    def _refused(self, exc: InvalidInput) -> InvalidInput:
        """A plugin's :class:`InvalidInput`: its message names the plugin (once)."""
        if exc.message.startswith(self.label):
            return exc
        fields = {**exc.fields, "plugin": self.label}
        return InvalidInput(f"{self.label}: {exc.message}", **fields)
