"""Which chain each running sequence started on: its requests keep to it.

A request that names a sequence (``sequence_id``) of a runner that keeps sequences in
this process is served by the chain its sequence started on, as long as that chain's
runner still runs the sequence: a reload or a canary change moves new sequences only,
and the old version is released once its sequences have ended or expired
(:meth:`plugserve.registry.execution.components.batched.BatchedRunner.wait_idle`). A
``sequence_start``, or a sequence the pinned runner no longer runs, takes the chain
the route gives now.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

from plugserve.registry.execution.chain import Chain

MAX_PINS = 100_000
"""Pins kept at most; past it, those of sequences that no longer run are dropped."""


class SequencePins:
    def __init__(self) -> None:
        self._pins: dict[tuple[str, int | str], Chain] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def chain(
        self, route: str, parameters: Mapping[str, Any] | None, resolve: Callable[[], Chain]
    ) -> Chain:
        """The chain of ``route`` for a request with ``parameters``: its sequence's, or
        ``resolve()``'s."""
        sequence_id = parameters.get("sequence_id") if parameters else None
        if parameters is None or not _is_id(sequence_id):
            return resolve()  # not a sequence's request (the runner refuses a bad id)
        key: tuple[str, int | str] = (route, sequence_id)
        pinned = self._pins.get(key)
        if pinned is not None and parameters.get("sequence_start") is not True:
            kept = pinned.runner.live_sequences()
            if kept is not None and kept.holds(sequence_id):
                return pinned
        chain = resolve()
        if chain.runner.live_sequences() is None:
            self._pins.pop(key, None)
            return chain
        self._pins[key] = chain
        if len(self._pins) > MAX_PINS:
            self._purge()
        return chain

    def _purge(self) -> None:
        for key, chain in list(self._pins.items()):
            kept = chain.runner.live_sequences()
            if kept is None or not kept.holds(key[1]):
                del self._pins[key]


def _is_id(value: Any) -> TypeGuard[int | str]:
    if isinstance(value, bool) or not isinstance(value, int | str):
        return False
    return value != 0 and value != ""
