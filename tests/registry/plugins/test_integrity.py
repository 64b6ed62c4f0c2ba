"""``SHA256SUMS`` in a version folder: whatever it holds is a failed load, never an escape."""

from pathlib import Path

import pytest

from plugserve.registry.errors import PluginLoadError
from plugserve.registry.plugins.fingerprint import Fingerprinter
from plugserve.registry.plugins.integrity import verify_checksums


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xfe not utf-8\n", "cannot be read"),
        (b"0" * 64 + b"  a\x00b\n", "control characters"),
        (b"0" * 64 + b"  " + b"a" * 300 + b"\n", "longer than 255 bytes"),
        (b"0" * 64 + b"  ../outside\n", "outside the folder"),
        (b"not a line\n", "is not '<sha256>  <file>'"),
    ],
)
def test_hostile_checksum_files_fail_the_load(tmp_path: Path, data: bytes, message: str) -> None:
    """issue 12, the class of finding 1: bad bytes or names in SHA256SUMS (UnicodeDecodeError
    and ValueError escaped before) are a PluginLoadError."""
    (tmp_path / "SHA256SUMS").write_bytes(data)
    with pytest.raises(PluginLoadError, match=message):
        verify_checksums(tmp_path, Fingerprinter(), "runner/x@1.0.0")


def test_a_matching_checksum_file_vouches_for_its_files(tmp_path: Path) -> None:
    import hashlib

    (tmp_path / "plugin.toml").write_bytes(b"x")
    digest = hashlib.sha256(b"x").hexdigest()
    (tmp_path / "SHA256SUMS").write_text(f"{digest}  plugin.toml\n")
    assert verify_checksums(tmp_path, Fingerprinter(), "runner/x@1.0.0") == 1
