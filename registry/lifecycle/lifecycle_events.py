"""What a change to a plugin version ends in: its key, the outcome of the change, and
the event the registry's listeners (metrics, the response cache, the fleet) hear."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plugserve.registry.routing.records import VersionRecord

Key = tuple[str, str, str]
Outcome = Literal[
    "loaded", "reloaded", "unchanged", "failed", "unloaded", "held", "available", "evicted"
]


@dataclass(frozen=True)
class LifecycleEvent:
    """What listeners (metrics) hear after every load, reload or unload."""

    record: VersionRecord
    outcome: Outcome
    seconds: float
    error: str | None = None
