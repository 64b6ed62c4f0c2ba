"""A stream's write to a call that has ended: a hang-up, not a server fault.

gRPC's core fails a write to a call its client cancelled (``ExecuteBatchError``) at a
moment no client can choose, so the race is played here with a fake of the part of
``grpc.aio.ServicerContext`` the write uses (``write``, ``done``); the real server's
behaviour under hang-ups is tested end to end in test_limits.py.
"""

from __future__ import annotations

import asyncio

import pytest

from plugserve.server.grpc_api.service import _write_whole


class WriteFailed(Exception):
    """What gRPC's core raises for a write it cannot start."""


class Context:
    def __init__(self, ended: bool) -> None:
        self.ended = ended

    async def write(self, message: object) -> None:
        raise WriteFailed('Failed "execute_batch": (<grpc._cython.cygrpc.SendMessageOperation>)')

    def done(self) -> bool:
        return self.ended


async def test_a_write_to_an_ended_call_ends_the_request_as_a_hang_up() -> None:
    with pytest.raises(asyncio.CancelledError):
        await _write_whole(Context(ended=True), object())  # type: ignore[arg-type]


async def test_a_write_that_fails_on_a_live_call_is_still_an_error() -> None:
    with pytest.raises(WriteFailed):
        await _write_whole(Context(ended=False), object())  # type: ignore[arg-type]
