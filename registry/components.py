"""A loaded plugin instance: its component, how to call it, and who is using it."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from registry.datatypes import numpy_dtype
from registry.errors import InvalidInput, PluginError, PluginLoadError, PlugserveError
from registry.manifest import Manifest
from registry.types import PluginInfo, RequestContext

STAGE_METHOD = {"preprocessor": "process", "runner": "infer", "postprocessor": "format"}


async def await_maybe(value: Any) -> Any:
    """Await ``value`` if it is awaitable, else return it: hooks and components may be either."""
    if inspect.isawaitable(value):
        return await value
    return value


@dataclass(eq=False)
class LoadedPlugin:
    """One load (generation) of one plugin version, ready or about to be.

    Sync runner ``infer`` calls run on the instance's own thread pool (ONNX
    Runtime releases the GIL); sync processor calls run inline on the event
    loop, since a cheap stage is slower behind a thread hop. A processor with
    heavy work should be an ``async def`` that offloads it.
    """

    manifest: Manifest
    info: PluginInfo
    component: Any
    package: str | None = None
    hook_name: str | None = None
    model_path: Path | None = None
    loaded_at: float = field(default_factory=time.time)
    in_flight: int = 0
    _method: Callable[..., Any] = field(init=False, repr=False)
    _is_async: bool = field(init=False, repr=False)
    _executor: ThreadPoolExecutor | None = field(init=False, default=None, repr=False)
    _idle: asyncio.Event | None = field(init=False, default=None, repr=False)
    _metadata: dict[str, Any] | None = field(init=False, default=None, repr=False)
    _input_dtypes: dict[str, np.dtype[Any]] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        name = STAGE_METHOD[self.manifest.type]
        method = getattr(self.component, name, None)
        if not callable(method):
            raise PluginLoadError(f"{self.label}: its component has no {name}() method")
        self._method = method
        self._is_async = inspect.iscoroutinefunction(method)
        if self.manifest.type == "runner" and not self._is_async:
            instances = self.manifest.runner.instances if self.manifest.runner else 1
            self._executor = ThreadPoolExecutor(instances, thread_name_prefix=self.label)

    @property
    def label(self) -> str:
        return self.manifest.label

    @property
    def max_queue_size(self) -> int:
        """Requests a runner takes in flight before answering 429; 0 is unbounded."""
        runner = self.manifest.runner
        return runner.max_queue_size if runner else 0

    @property
    def version(self) -> str:
        return str(self.manifest.version)

    # -- lifecycle -----------------------------------------------------------------

    async def warmup(self) -> None:
        """Run the component's ``warmup()`` (sync ones off the loop) and read its metadata."""
        await self._call_optional("warmup")
        metadata = (
            self.component.metadata()
            if callable(getattr(self.component, "metadata", None))
            else None
        )
        self._metadata = await await_maybe(metadata)
        for spec in (self._metadata or {}).get("inputs", []):
            try:
                self._input_dtypes[spec["name"]] = numpy_dtype(spec["datatype"])
            except (KeyError, TypeError):
                continue

    async def close(self) -> None:
        """Run the component's ``close()``; then its thread pool is shut down."""
        try:
            await self._call_optional("close")
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None

    async def _call_optional(self, name: str) -> None:
        method = getattr(self.component, name, None)
        if not callable(method):
            return
        if inspect.iscoroutinefunction(method):
            await method()
        else:
            await await_maybe(await asyncio.to_thread(method))

    def metadata(self) -> dict[str, Any] | None:
        """The component's ``metadata()`` as read at warmup: tensor specs, or ``None``."""
        return self._metadata

    # -- in-flight accounting (no await between resolving a chain and entering it) ----

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, within: float) -> bool:
        """Wait until no request uses this instance; ``False`` if ``within`` seconds pass first."""
        if self.in_flight == 0:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), within)
        except TimeoutError:
            return False
        return True

    # -- the request path --------------------------------------------------------------

    async def call(self, data: Any, ctx: RequestContext) -> Any:
        """Run this stage on ``data``; a plugin's exception becomes :class:`PluginError`."""
        try:
            if self.manifest.type == "runner":
                inputs = self.runner_inputs(data)
                if self._is_async:
                    return await self._method(inputs)
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._executor, self._method, inputs)
            result = self._method(data, ctx)
            return (await result) if self._is_async else result
        except PlugserveError:
            raise
        except Exception as exc:
            raise PluginError(self.label, exc) from exc

    def runner_inputs(self, data: Any) -> Mapping[str, np.ndarray]:
        """Turn what reaches a runner into named arrays of its input dtypes.

        Named arrays pass through. A JSON object of nested lists becomes arrays
        of the dtypes the runner's ``metadata()`` declares; a bare list or array
        goes to a runner with exactly one input.
        """
        if isinstance(data, Mapping):
            if all(isinstance(v, np.ndarray) for v in data.values()):
                return data
            return {str(k): self._as_array(str(k), v) for k, v in data.items()}
        if isinstance(data, list | np.ndarray) and len(self._input_dtypes) == 1:
            (name,) = self._input_dtypes
            return {name: self._as_array(name, data)}
        names = sorted(self._input_dtypes)
        raise InvalidInput(
            f"runner {self.label} takes named inputs {names}, got {type(data).__name__}"
        )

    def _as_array(self, name: str, value: Any) -> np.ndarray:
        if isinstance(value, np.ndarray):
            return value
        try:
            return np.asarray(value, dtype=self._input_dtypes.get(name))
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"input {name!r} of runner {self.label}: {exc}") from None
