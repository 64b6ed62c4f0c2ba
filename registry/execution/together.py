"""Several stages of one request run at once: a graph's wave, a completion's choices.

They end together: the first to fail stops the others, and the request goes on with
the one error their errors rank first (:func:`~plugserve.registry.errors.first_error`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

from plugserve.registry.errors import first_error

T = TypeVar("T")


async def together(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """The results of ``awaitables``, run concurrently, in their order.

    The first to fail cancels the others, and every one has stopped before this returns
    or raises: none goes on working for a request that has its answer. What raises is
    :func:`~plugserve.registry.errors.first_error` of the errors they raised (those that
    were cancelled raised none). The caller's own cancellation (a deadline, a hang-up)
    stops them all and goes on as it came.

    Not an ``asyncio.TaskGroup``: on Python 3.11 one whose task fails while the group
    waits leaves the caller's task marked as being cancelled.
    """
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)  # each stopped before the caller goes on
        # Read even when the caller was cancelled: no error is left "never retrieved".
        errors = [error for task in tasks if not task.cancelled() and (error := task.exception())]
    if errors:
        raise first_error(errors)
    return [task.result() for task in tasks]
