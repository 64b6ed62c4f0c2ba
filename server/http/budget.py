"""One budget per process for the request bytes it holds while they arrive, and for what
compressed ones inflate to: HTTP's large bodies and gRPC's messages together
(``request_bytes_budget``; by default eight times ``max_body_bytes``).

Bytes are counted as they are received (what the process holds, not what a client
declares), and inflated bytes as they are inflated, on whichever thread does it. Each
protocol may hold at most three quarters of the budget, so that a flood of one leaves the
other room. A request that would pass it is refused at once, its bytes dropped: HTTP
answers 503 with ``Retry-After``, gRPC ends the call ``RESOURCE_EXHAUSTED``.
"""

from __future__ import annotations

import threading

from plugserve.registry.errors import Unavailable

PROTOCOL_SHARE = 0.75
"""The most of the budget one protocol may hold."""


class ByteBudget:
    """Bytes held by HTTP and gRPC requests, within ``limit``; thread-safe."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.share = int(limit * PROTOCOL_SHARE)
        self.held = {"http": 0, "grpc": 0}
        self.refused = {"http": 0, "grpc": 0}
        self._lock = threading.Lock()

    def take(self, protocol: str, size: int) -> bool:
        """Hold ``size`` more bytes for ``protocol``; ``False`` (nothing held) past the budget."""
        with self._lock:
            held = self.held[protocol] + size
            if held > self.share or sum(self.held.values()) + size > self.limit:
                self.refused[protocol] += 1
                return False
            self.held[protocol] = held
            return True

    def give(self, protocol: str, size: int) -> None:
        """Bytes held for ``protocol`` that are freed."""
        with self._lock:
            self.held[protocol] -= size

    def refusal(self) -> str:
        """Why a request was refused, in words."""
        return (
            f"the server holds {sum(self.held.values())} bytes of requests still arriving or "
            f"being inflated, near its limit (request_bytes_budget = {self.limit}); try again "
            "shortly"
        )

    def unavailable(self) -> Unavailable:
        """HTTP's refusal: 503 with ``Retry-After``."""
        return Unavailable(self.refusal(), retry_after_s=1)
