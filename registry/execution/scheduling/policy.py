"""A runner's scheduling settings (:class:`BatchPolicy`) and the priority level a request
queues at: what the batching scheduler and the streaming one both read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from plugserve.registry.errors import InvalidInput


@dataclass(frozen=True)
class BatchPolicy:
    """A runner's scheduling settings, from its manifest's ``[runner]`` table."""

    max_batch_size: int = 0
    max_queue_delay_s: float = 0.0
    preferred_batch_sizes: tuple[int, ...] = ()
    instances: int = 1
    max_queue_size: int = 0
    priority_levels: int = 1
    default_priority: int | None = None
    tenant_weights: Mapping[str, float] = field(default_factory=dict)

    @property
    def default_level(self) -> int:
        return self.default_priority or self.priority_levels


def priority_level(priority: int | None, policy: BatchPolicy, label: str) -> int:
    """The queue level of a v2 ``priority`` (0 or none: the runner's default); a 400 for
    one outside the runner's levels."""
    level = priority or policy.default_level
    if not 1 <= level <= policy.priority_levels:
        levels = policy.priority_levels
        raise InvalidInput(f"priority {priority} is outside 1..{levels} for {label}")
    return level
