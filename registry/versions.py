"""Semantic versions of plugins and models, compared as numbers, never as strings."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import total_ordering

# Matched whole (``fullmatch``): ``$`` would let a trailing newline through.
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?",
    re.ASCII,
)
_INTEGER = re.compile(r"[1-9]\d*", re.ASCII)


def _prerelease_key(part: str) -> tuple[int, int | str]:
    # SemVer 2.0 section 11: numeric identifiers sort below alphanumeric ones.
    return (0, int(part)) if part.isdigit() else (1, part)


@total_ordering
@dataclass(frozen=True)
class Version:
    """``MAJOR.MINOR.PATCH[-prerelease]``; a prerelease sorts below its release.

    ``text`` keeps the spelling found on disk (``"3"`` for an integer model
    version) so that names round-trip.
    """

    major: int
    minor: int
    patch: int
    prerelease: tuple[str, ...] = ()
    text: str = field(default="", compare=False)

    @classmethod
    def parse(cls, text: str) -> Version:
        """Parse a semantic version; raise ``ValueError`` on anything else."""
        match = _SEMVER.fullmatch(text)
        if match is None:
            raise ValueError(f"{text!r} is not a semantic version MAJOR.MINOR.PATCH[-prerelease]")
        major, minor, patch, pre = match.groups()
        return cls(int(major), int(minor), int(patch), tuple(pre.split(".")) if pre else (), text)

    @classmethod
    def parse_model(cls, text: str) -> Version:
        """Parse a model repository version: a positive integer (as in Triton) or semver.

        An integer ``N`` sorts as ``N.0.0``.
        """
        if _INTEGER.fullmatch(text):
            return cls(int(text), 0, 0, (), text)
        return cls.parse(text)

    def _key(self) -> tuple[int, int, int, int, tuple[tuple[int, int | str], ...]]:
        # A release (no prerelease) sorts above every prerelease of it.
        pre = tuple(_prerelease_key(p) for p in self.prerelease)
        return (self.major, self.minor, self.patch, 0 if self.prerelease else 1, pre)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() == other._key()

    def __lt__(self, other: Version) -> bool:
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        if self.text:
            return self.text
        core = f"{self.major}.{self.minor}.{self.patch}"
        return f"{core}-{'.'.join(self.prerelease)}" if self.prerelease else core

    def __repr__(self) -> str:
        return f"Version({str(self)!r})"
