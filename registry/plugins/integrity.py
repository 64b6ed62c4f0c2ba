"""``SHA256SUMS`` in a version folder: when present, every listed file must match."""

from __future__ import annotations

import re
from pathlib import Path

from plugserve.registry import checks
from plugserve.registry.errors import PluginLoadError
from plugserve.registry.plugins.fingerprint import Fingerprinter

SUMS_FILE = "SHA256SUMS"
# The format `sha256sum` writes: "<64 hex>  <path>" (text mode) or "<64 hex> *<path>" (binary).
_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


def verify_checksums(folder: Path, fingerprinter: Fingerprinter, label: str) -> int:
    """Check ``folder/SHA256SUMS`` if it exists; return how many files it vouched for.

    Make one with ``cd <version folder> && sha256sum plugin.toml *.py *.onnx > SHA256SUMS``.
    """
    sums = folder / SUMS_FILE
    if not sums.is_file():
        return 0
    try:
        text = sums.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PluginLoadError(f"{label}: {SUMS_FILE} cannot be read: {exc}") from None
    count = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _LINE.match(line.strip())
        if match is None:
            raise PluginLoadError(f"{label}: {SUMS_FILE} line {number} is not '<sha256>  <file>'")
        expected, name = match.group(1).lower(), match.group(2)
        try:
            checks.relative_path(name, f"{SUMS_FILE} line {number}")
        except checks.ValueProblem as exc:
            raise PluginLoadError(f"{label}: {exc}") from None
        path = (folder / name).resolve()
        if Path(name).is_absolute() or not path.is_relative_to(folder.resolve()):
            raise PluginLoadError(f"{label}: {SUMS_FILE} names {name!r}, outside the folder")
        actual = fingerprinter.file(path)
        if actual == "missing":
            raise PluginLoadError(f"{label}: {SUMS_FILE} lists {name}, which is missing")
        if actual != expected:
            raise PluginLoadError(f"{label}: {SUMS_FILE}: {name} does not match its checksum")
        count += 1
    return count
