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
from plugserve.registry.execution.sequences import SequenceId, is_sequence_id


class SequencePins:
    """The chain each sequence running in this process started on, by route and id.

    A pin lasts as long as its sequence runs in the pinned chain's runner: it is
    dropped when the runner tells of the sequence's end (its ``sequence_end``, its
    expiry, a failed start, the runner's release: :meth:`SequenceHolder.watch`), and
    after a request of a sequence that the runner does not run (:meth:`settle`: a start
    refused before it reached the runner). An ended sequence thus holds no chain, and a
    reload's old version is released once its live sequences end.
    """

    def __init__(self) -> None:
        self._pins: dict[SequenceId, dict[str, Chain]] = {}
        """Sequence id -> route -> the chain it started on."""

    def __len__(self) -> int:
        return sum(map(len, self._pins.values()))

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
        start = parameters.get("sequence_start") is True
        pinned = self._pinned(route, sequence_id)
        if pinned is not None and not start:
            kept = pinned.runner.live_sequences()
            if kept is not None and kept.holds(sequence_id):
                return pinned
        chain = resolve(sequence_key(sequence_id))
        kept = chain.runner.live_sequences()
        if kept is None or not (start or kept.holds(sequence_id)):
            self._drop(route, sequence_id)
            return chain
        kept.watch(self.ended)
        self._pins.setdefault(sequence_id, {})[route] = chain
        return chain

    def settle(self, route: str, parameters: Mapping[str, Any] | None) -> None:
        """After a request on ``route`` with ``parameters``: its sequence's pin goes unless
        the pinned runner runs the sequence."""
        sequence_id = parameters.get("sequence_id") if parameters else None
        if _is_id(sequence_id):
            pinned = self._pinned(route, sequence_id)
            if pinned is not None and not _runs(pinned, sequence_id):
                self._drop(route, sequence_id)

    def ended(self, sequence_id: SequenceId) -> None:
        """A runner no longer runs ``sequence_id``: the pins to it go (a pin of the same id
        to a runner that still runs it stays)."""
        routes = self._pins.get(sequence_id)
        if routes is None:
            return
        for route, chain in list(routes.items()):
            if not _runs(chain, sequence_id):
                del routes[route]
        if not routes:
            del self._pins[sequence_id]

    def _pinned(self, route: str, sequence_id: SequenceId) -> Chain | None:
        routes = self._pins.get(sequence_id)
        return None if routes is None else routes.get(route)

    def _drop(self, route: str, sequence_id: SequenceId) -> None:
        routes = self._pins.get(sequence_id)
        if routes is not None and routes.pop(route, None) is not None and not routes:
            del self._pins[sequence_id]


def _runs(chain: Chain, sequence_id: SequenceId) -> bool:
    kept = chain.runner.live_sequences()
    return kept is not None and kept.holds(sequence_id)


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
