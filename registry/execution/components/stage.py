"""A processor's instance: a preprocessor's ``process`` or a postprocessor's ``format``."""

from __future__ import annotations

import contextvars
import inspect
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from plugserve.registry.errors import InvalidInput, PlugserveError
from plugserve.registry.execution.components.base import LoadedPlugin
from plugserve.registry.execution.components.inline import CallCosts, call_bytes
from plugserve.registry.types import RequestContext

STAGE_METHOD = {"preprocessor": "process", "postprocessor": "format"}


@dataclass(eq=False)
class Stage(LoadedPlugin):
    """A processor between the request and the runner, or between the runner and the answer.

    A synchronous processor's calls run on its own thread, one call at a time (as on the
    loop: a processor is never called concurrently with itself). Where its manifest
    declares its cost bounded by its size (``[processor] cost = "size"``), calls proven
    cheap for their size (``PROCESS_BUDGET_S``) run inline: a cheap stage is slower behind
    a thread hop. An ``async`` processor's calls run on the loop.
    """

    _method: Callable[..., Any] = field(init=False, repr=False)
    _is_async: bool = field(init=False, repr=False)
    _costs: CallCosts | None = field(init=False, default=None, repr=False)
    """The last calls' costs, where they predict the next (``[processor] cost = "size"``)."""

    def __post_init__(self) -> None:
        self._method = self._method_named(STAGE_METHOD[self.manifest.type])
        self._is_async = inspect.iscoroutinefunction(self._method)
        if not self._is_async:  # one thread: calls in order, never two at once
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=self.label)
            if self.manifest.processor.sized:
                self._costs = CallCosts()

    def describe(self) -> dict[str, Any]:
        """A synchronous processor's calls that ran on the event loop, not on its thread."""
        if self._executor is None:
            return {}
        return {"inline_executions": self.inline_executions}

    async def call(self, data: Any, ctx: RequestContext) -> Any:
        """Run ``process`` (or ``format``) on ``data``; a plugin's exception becomes
        :class:`PluginError`, its :class:`InvalidInput` a 400 naming it."""
        try:
            if self._is_async:
                return await self._method(data, ctx)
            costs = self._costs
            if costs is None:
                return await self._on_thread(contextvars.copy_context().run, self._method, data,
                                             ctx)  # fmt: skip
            size = call_bytes(data, ctx.body_bytes)
            if costs.runs_inline(size, bool(self.executing)):
                self.inline_executions += 1
                return self._timed(costs, data, ctx, size)
            return await self._on_thread(contextvars.copy_context().run, self._timed, costs, data,
                                         ctx, size)  # fmt: skip
        except InvalidInput as exc:
            raise self._refused(exc) from None
        except PlugserveError:
            raise
        except Exception as exc:
            self._raise_fault(exc)

    def _timed(self, costs: CallCosts, data: Any, ctx: RequestContext, size: int | None) -> Any:
        """A call, its cost recorded with its size (none for a call that raised:
        a quick refusal says nothing of what a request that size costs when processed)."""
        started = time.perf_counter()
        seen = 0
        try:
            result = self._method(data, ctx)
            seen = size or 0
            return result
        finally:
            costs.record(seen, time.perf_counter() - started)
