"""A circuit breaker per runner: fail fast while a runner keeps failing, probe to recover.

closed --(``failures`` plugin errors in a row)--> open --(``reset_s`` passed)--> half-open
half-open --(probe succeeds)--> closed;  half-open --(probe fails)--> open again.

While open, requests get 503 at once instead of queueing behind a broken runner;
in half-open, one request at a time probes it. Only the runner's own failures
count: an exception from it (a 500 naming the plugin) or a 5xx error it raises,
in an execution of one request (``registry/execution/batching.py``: a failed batch of
several is run again one request at a time, and those executions count).
Bad input never counts (a 400 from the server's checks, the plugin's
``InvalidInput``, or a backend's refusal of the inputs:
``registry/backends/refusals.py``), nor do deadlines (a 504: the client's
budget), so no client can open the circuit for everyone else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from plugserve.registry.errors import Unavailable

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
            refusal = self.open_error()
            if refusal is not None:
                raise refusal
            self.state = "half_open"
        if self._probing:
            raise Unavailable(
                f"runner {self.label} is being probed after failures", circuit="half_open"
            )
        self._probing = True

    def open_error(self) -> Unavailable | None:
        """The 503 that :meth:`allow` answers while the circuit is open and not yet due for a
        probe; ``None`` otherwise. Takes no probe."""
        if not self.enabled or self.state != "open":
            return None
        wait = self.opened_at + self.reset_s - self.clock()
        if wait <= 0:
            return None
        return Unavailable(
            f"runner {self.label} is failing: circuit open, next try in {wait:.1f} s",
            circuit="open",
        )

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
