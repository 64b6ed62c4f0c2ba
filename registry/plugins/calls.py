"""Calls into plugin code outside requests (import and create, warmup, close, hooks), bounded.

A sync call runs on a daemon thread of its own, an async one as a task of its
own, and the caller waits at most the call's bound. Past it the server stops
waiting: ``plugin_call_timeout`` is logged and :class:`PluginCallTimeout`
raised. A thread cannot be killed, so a hung sync call runs on unseen (a daemon
thread never keeps the process up, and it holds no lock of ours); a hung
coroutine is cancelled. Either way no lifecycle lock is held past the bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import threading
from collections.abc import Callable
from typing import Any

import structlog

from plugserve.registry.errors import PluginCallTimeout

log = structlog.get_logger("plugserve.registry")


async def call_plugin(
    fn: Callable[[], Any], within: float, plugin: str, call: str, setting: str
) -> Any:
    """Call ``fn`` (sync, async, or sync returning an awaitable) and wait at most ``within`` s.

    ``plugin`` and ``call`` name it in the log and the error; ``setting`` names
    the setting that sets the bound. Whatever ``fn`` raises is raised here, a
    ``SystemExit`` or ``KeyboardInterrupt`` from plugin code as a ``RuntimeError``.
    """
    within = max(within, 0.0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within

    async def wait(future: asyncio.Future[Any]) -> Any:
        future.add_done_callback(_retrieved)
        try:
            done, _ = await asyncio.wait({future}, timeout=deadline - loop.time())
        finally:
            if not future.done():
                future.cancel()
        if not done:
            log.error("plugin_call_timeout", plugin=plugin, call=call, timeout_s=round(within, 2))
            raise PluginCallTimeout(plugin, call, round(within, 2), setting)
        return future.result()

    if inspect.iscoroutinefunction(fn):
        result = await wait(asyncio.ensure_future(_guarded(fn())))
    else:
        result = await wait(_on_thread(fn, f"plugserve-{call}:{plugin}"))
    if inspect.isawaitable(result):
        result = await wait(asyncio.ensure_future(_guarded(result)))
    return result


def _on_thread(fn: Callable[[], Any], name: str) -> asyncio.Future[Any]:
    """Run ``fn`` on a new daemon thread; its outcome settles the returned future."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # abandoned: nobody waits any more
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = context.run(fn)
        except BaseException as exc:
            error = _tamed(exc)
        with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


async def _guarded(awaitable: Any) -> Any:
    try:
        return await awaitable
    except (SystemExit, KeyboardInterrupt) as exc:
        raise _tamed(exc) from exc


def _tamed(exc: BaseException) -> BaseException:
    """What plugin code raised, unless it would stop the server: then a ``RuntimeError``."""
    if isinstance(exc, Exception):
        return exc
    tamed = RuntimeError(f"{type(exc).__name__}({exc}) raised by plugin code")
    tamed.__cause__ = exc
    return tamed


def _retrieved(future: asyncio.Future[Any]) -> None:
    # An abandoned call's late exception is nobody's to report: retrieve it so
    # asyncio does not log "exception was never retrieved" for it.
    if not future.cancelled():
        future.exception()
