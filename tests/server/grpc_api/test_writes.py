"""A stream's write to a call that has ended: a hang-up, not a server fault.

gRPC's core fails a write to a call its client cancelled (``ExecuteBatchError``) and then,
a moment later, cancels the handler's task, which cancels the request's. That order cannot
be chosen by a real client, so it is played here with a fake of the part of
``grpc.aio.ServicerContext`` the write uses (``write``; ``done``, which is true once the
server has sent the call's status); the real server's behaviour under hang-ups is tested
end to end in test_limits.py.
"""

from __future__ import annotations

import asyncio

import pytest

from plugserve.server.grpc_api import service
from plugserve.server.grpc_api.service import _write_whole


class WriteFailed(Exception):
    """What gRPC's core raises for a write it cannot start."""


class Context:
    def __init__(self, status_sent: bool = False) -> None:
        self.status_sent = status_sent
        self.written = asyncio.Event()

    async def write(self, message: object) -> None:
        self.written.set()
        raise WriteFailed('Failed "execute_batch": (<grpc._cython.cygrpc.SendMessageOperation>)')

    def done(self) -> bool:
        return self.status_sent


async def test_a_write_whose_client_hung_up_ends_the_request_as_a_hang_up() -> None:
    context = Context()
    request = asyncio.ensure_future(_write_whole(context, object()))  # type: ignore[arg-type]
    await context.written.wait()
    await asyncio.sleep(0.01)  # the write has failed; gRPC reports the hang-up after it
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request


async def test_a_write_after_the_status_went_ends_the_request_at_once() -> None:
    with pytest.raises(asyncio.CancelledError):
        await _write_whole(Context(status_sent=True), object())  # type: ignore[arg-type]


async def test_a_write_that_fails_on_a_live_call_is_still_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(service, "WRITE_FAILED_GRACE_S", 0.05)
    with pytest.raises(WriteFailed):
        await _write_whole(Context(), object())  # type: ignore[arg-type]
