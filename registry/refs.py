"""Names and ``name@version`` references to plugins, as routes and chains spell them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from plugserve.registry.versions import Version

PluginType = Literal["preprocessor", "runner", "postprocessor"]
PLUGIN_TYPES: tuple[PluginType, ...] = ("preprocessor", "runner", "postprocessor")

NAME_PATTERN = r"[a-z0-9][a-z0-9_-]{0,63}"
_NAME = re.compile(NAME_PATTERN)


def is_valid_name(name: str) -> bool:
    """A plugin or route name: ``[a-z0-9][a-z0-9_-]{0,63}``, whole (no trailing newline)."""
    return bool(_NAME.fullmatch(name))


def is_ignored_name(name: str) -> bool:
    """Files and folders the registry never looks at: dot names, ``*.tmp``, ``*~``, caches."""
    return (
        name.startswith(".")
        or name.endswith((".tmp", "~", ".swp", ".swx", ".pyc"))
        or name == "__pycache__"
    )


@dataclass(frozen=True)
class Ref:
    """A plugin named in a chain: floating (``version is None``) or pinned (``name@1.2.3``)."""

    name: str
    version: Version | None = None

    @classmethod
    def parse(cls, text: str) -> Ref:
        """Parse ``name`` or ``name@MAJOR.MINOR.PATCH``; raise ``ValueError`` when invalid."""
        name, sep, version = text.partition("@")
        if not is_valid_name(name):
            raise ValueError(f"{text!r}: plugin name must match {NAME_PATTERN}")
        if not sep:
            return cls(name)
        return cls(name, Version.parse(version))

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}@{self.version}"
