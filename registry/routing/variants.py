"""Weighted traffic splitting between a route's runner versions (canary rollouts).

A weighted route names its variants with integer weights. Only the variants
ready on this server, with their circuit closed, take traffic; one that is not
hands its share to the others in proportion to their weights.

With a ``sticky`` header, requests carrying the same value always get the same
variant while the weights stand. The choice is weighted rendezvous hashing
(highest random weight): each variant scores ``weight / -ln(h(key, variant))``
and the highest score wins. Each variant then gets its weight's share of keys,
and when a variant leaves (or its weight changes) only the keys it held (or
the share that moved) change variant; every other key stays where it was.
Without the header a request is placed at random by weight.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from itertools import accumulate
from typing import Generic, TypeVar

T = TypeVar("T")

_SCALE = float(1 << 64)


_MASK = (1 << 64) - 1


def key_hash(key: bytes) -> int:
    """A 64-bit hash of a sticky key (the same in every process: no hash seed)."""
    return int.from_bytes(blake2b(key, digest_size=8).digest(), "big")


def key_score(hashed: int, salt: int, weight: float) -> float:
    """The rendezvous score of a key (``key_hash``) for the variant salted ``salt``.

    ``hashed ^ salt`` goes through splitmix64's finalizer, so each variant sees an
    independent uniform number for the key.
    """
    z = (hashed ^ salt) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    z ^= z >> 31
    # A uniform number in (0, 1): never 0 (log would fail) nor 1 (score would be infinite).
    unit = (z + 0.5) / _SCALE
    return weight / -math.log(unit)


def sticky_key(header: str | None, headers: Mapping[str, str]) -> bytes | None:
    """The sticky key of a request sending ``headers``, on a route whose sticky header is
    ``header``: the header's value as the client sent it (``None`` without one)."""
    if header is None:
        return None
    value = headers.get(header)
    if not value:
        return None
    # aiohttp keeps undecodable header bytes as surrogates: give them back as they came.
    return value.encode("utf-8", "surrogateescape")


def salt_of(label: str) -> int:
    """A variant's hash salt, from its label (``name@version``): stable across replicas."""
    return int.from_bytes(blake2b(label.encode(), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class Candidate(Generic[T]):
    label: str
    weight: int
    target: T
    salt: int


class WeightedChoice(Generic[T]):
    """Picks among candidates by weight; immutable, built once per route table."""

    __slots__ = ("_cumulative", "_total", "candidates")

    def __init__(self, candidates: Sequence[Candidate[T]]) -> None:
        self.candidates = tuple(c for c in candidates if c.weight > 0)
        self._cumulative = list(accumulate(c.weight for c in self.candidates))
        self._total = self._cumulative[-1] if self._cumulative else 0

    def __bool__(self) -> bool:
        return bool(self.candidates)

    def share(self, label: str) -> float:
        """The fraction of traffic ``label`` gets (0 when it is not a candidate)."""
        weight = sum(c.weight for c in self.candidates if c.label == label)
        return weight / self._total if self._total else 0.0

    def pick(self, key: bytes | None = None) -> Candidate[T]:
        """The candidate for ``key`` (sticky), or a random one by weight (``key`` None)."""
        if len(self.candidates) == 1:
            return self.candidates[0]
        if key is None:
            return self.candidates[bisect_right(self._cumulative, random.random() * self._total)]
        hashed = key_hash(key)
        best, best_score = self.candidates[0], -1.0
        for candidate in self.candidates:
            score = key_score(hashed, candidate.salt, candidate.weight)
            if score > best_score:
                best, best_score = candidate, score
        return best

    def without(self, excluded: set[str]) -> WeightedChoice[T]:
        """The same choice with some candidates left out (their share goes to the rest)."""
        return WeightedChoice([c for c in self.candidates if c.label not in excluded])
