"""Which chain each running sequence started on: its requests keep to it.

A request that names a sequence (``sequence_id``) is placed on a weighted route (a
canary) by its sequence id, unless the route's ``sticky`` header says otherwise: every
request of a sequence, in any worker, picks the same variant while the weights stand.
A request of a runner whose sequences run in this process (kept here, or, for an
isolated runner, run in its processes by this worker's requests) is moreover served by
the chain its sequence started on, as long as that chain's runner still runs the sequence:
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
from plugserve.registry.execution.sequences import is_sequence_id

MAX_PINS = 100_000
"""Pins kept at most; past it, those of sequences that no longer run are dropped."""


class SequencePins:
    def __init__(self) -> None:
        self._pins: dict[tuple[str, int | str], Chain] = {}
        self._purge_at = MAX_PINS

    def __len__(self) -> int:
        return len(self._pins)

    def chain(
        self,
        route: str,
        parameters: Mapping[str, Any] | None,
        resolve: Callable[[bytes | None], Chain],
    ) -> Chain:
        """The chain of ``route`` for a request with ``parameters``: its sequence's, or
        ``resolve(key)``'s, ``key`` the sequence's sticky key (:func:`sequence_key`).

        A pin is kept for a ``sequence_start`` with a well-formed id, and for a request
        its chain's runner already runs the sequence of: never for an id the runner
        refuses (too long, out of range) or a sequence that runs nowhere."""
        sequence_id = parameters.get("sequence_id") if parameters else None
        if parameters is None or not _is_id(sequence_id):
            return resolve(None)  # not a sequence's request (the runner refuses a bad id)
        key: tuple[str, int | str] = (route, sequence_id)
        start = parameters.get("sequence_start") is True
        pinned = self._pins.get(key)
        if pinned is not None and not start:
            kept = pinned.runner.live_sequences()
            if kept is not None and kept.holds(sequence_id):
                return pinned
        chain = resolve(sequence_key(sequence_id))
        kept = chain.runner.live_sequences()
        if kept is None or not (start or kept.holds(sequence_id)):
            self._pins.pop(key, None)
            return chain
        self._pins[key] = chain
        if len(self._pins) > self._purge_at:
            self._purge()
        return chain

    def _purge(self) -> None:
        """Drop the pins of sequences that no longer run; the next purge waits until the
        pins have doubled (amortized: sequences that all still run cost one scan, not one
        a request)."""
        for key, chain in list(self._pins.items()):
            kept = chain.runner.live_sequences()
            if kept is None or not kept.holds(key[1]):
                del self._pins[key]
        self._purge_at = max(MAX_PINS, 2 * len(self._pins))


def sequence_key(sequence_id: int | str) -> bytes:
    """A sequence's key for a weighted route's choice: a sequence starts on the variant its
    id hashes to, the same in every worker and replica (an integer id and its decimal
    string are different ids, as for the runner)."""
    kind = b"i" if isinstance(sequence_id, int) else b"s"
    return b"sequence:" + kind + str(sequence_id).encode("utf-8", "surrogatepass")


def _is_id(value: Any) -> TypeGuard[int | str]:
    """A well-formed sequence id: others are the runner's to refuse, and nothing of them
    is kept here."""
    return is_sequence_id(value)
