"""Which chain each running sequence started on: its requests keep to it.

A request that names a sequence (``sequence_id``) is placed on a weighted route (a
canary) by its sequence id, unless the route's ``sticky`` header says otherwise: every
request of a sequence, in any worker, picks the same variant while the weights stand.
A request of a runner that keeps sequences in this process is moreover served by the
chain its sequence started on, as long as that chain's runner still runs the sequence:
a reload or a canary change moves new sequences only, and the old version is released
once its sequences have ended or expired
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
        self,
        route: str,
        parameters: Mapping[str, Any] | None,
        resolve: Callable[[bytes | None], Chain],
    ) -> Chain:
        """The chain of ``route`` for a request with ``parameters``: its sequence's, or
        ``resolve(key)``'s, ``key`` the sequence's sticky key (:func:`sequence_key`)."""
        sequence_id = parameters.get("sequence_id") if parameters else None
        if parameters is None or not _is_id(sequence_id):
            return resolve(None)  # not a sequence's request (the runner refuses a bad id)
        key: tuple[str, int | str] = (route, sequence_id)
        pinned = self._pins.get(key)
        if pinned is not None and parameters.get("sequence_start") is not True:
            kept = pinned.runner.live_sequences()
            if kept is not None and kept.holds(sequence_id):
                return pinned
        chain = resolve(sequence_key(sequence_id))
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


def sequence_key(sequence_id: int | str) -> bytes:
    """A sequence's key for a weighted route's choice: a sequence starts on the variant its
    id hashes to, the same in every worker and replica (an integer id and its decimal
    string are different ids, as for the runner)."""
    kind = b"i" if isinstance(sequence_id, int) else b"s"
    return b"sequence:" + kind + str(sequence_id).encode("utf-8", "surrogatepass")


def _is_id(value: Any) -> TypeGuard[int | str]:
    if isinstance(value, bool) or not isinstance(value, int | str):
        return False
    return value != 0 and value != ""
