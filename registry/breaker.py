"""A circuit breaker per runner: fail fast while a runner keeps failing, probe to recover.

closed --(``failures`` plugin errors in a row)--> open --(``reset_s`` passed)--> half-open
half-open --(probe succeeds)--> closed;  half-open --(probe fails)--> open again.

While open, requests get 503 at once instead of queueing behind a broken runner;
in half-open, one request at a time probes it. Only the runner's own failures
count: an exception from it (a 500 naming the plugin) or a 5xx error it raises.
Bad input never counts (a 400 from the server's checks or the plugin's
``InvalidInput``), nor do deadlines (a 504: the client's budget), so no client
can open the circuit for everyone else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from registry.errors import Unavailable

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    def __init__(
        self,
        label: str,
        failures: int = 5,
        reset_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.threshold = failures
        self.reset_s = reset_s
        self.clock = clock
        self.state: BreakerState = "closed"
        self.failures = 0
        self.opened_at = 0.0
        self._probing = False
        self.trips = 0

    @property
    def enabled(self) -> bool:
        return self.threshold > 0

    @property
    def rejecting(self) -> bool:
        """Whether :meth:`allow` would refuse a request now (open, or probing)."""
        if self.state == "closed" or not self.enabled:
            return False
        if self.state == "open":
            return self.clock() < self.opened_at + self.reset_s
        return self._probing

    def allow(self) -> None:
        """Let a request through, or raise :class:`Unavailable` while the circuit is open."""
        if not self.enabled or self.state == "closed":
            return
        if self.state == "open":
            wait = self.opened_at + self.reset_s - self.clock()
            if wait > 0:
                raise Unavailable(
                    f"runner {self.label} is failing: circuit open, next try in {wait:.1f} s",
                    circuit="open",
                )
            self.state = "half_open"
        if self._probing:
            raise Unavailable(
                f"runner {self.label} is being probed after failures", circuit="half_open"
            )
        self._probing = True

    def success(self) -> None:
        self.failures = 0
        self._probing = False
        self.state = "closed"

    def failure(self) -> None:
        if not self.enabled:
            return
        self.failures += 1
        self._probing = False
        if self.state == "half_open" or self.failures >= self.threshold:
            if self.state != "open":
                self.trips += 1
            self.state = "open"
            self.opened_at = self.clock()

    def release(self) -> None:
        """A request let through ended without saying anything about the runner."""
        self._probing = False
