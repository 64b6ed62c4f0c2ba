"""Which changed paths the watcher acts on, and what fingerprints see as a change."""

import os
from pathlib import Path

import pytest

from registry.fingerprint import Fingerprinter
from registry.registry import Registry
from registry.watcher import Watcher


@pytest.fixture
def watcher(plugins_dir: Path, models_dir: Path) -> Watcher:
    return Watcher(Registry(plugins_dir, models_dir))


@pytest.mark.parametrize(
    ("rel", "scope"),
    [
        ("plugins/runner/iris/1.0.0/plugin.py", ("version", "runner", "iris", "1.0.0")),
        ("plugins/runner/iris/1.0.0", ("version", "runner", "iris", "1.0.0")),
        ("plugins/runner/iris/1.0.0/sub/deep.py", ("version", "runner", "iris", "1.0.0")),
        ("plugins/runner/iris", ("rescan",)),
        ("plugins/routes.toml", ("routes",)),
        ("models/iris/2/model.onnx", ("model", "iris")),
        ("plugins/runner/iris/.2.0.0.tmp/plugin.py", None),
        ("plugins/runner/iris/1.0.0/__pycache__/plugin.cpython-311.pyc", None),
        ("plugins/runner/iris/1.0.0/.plugin.py.swp", None),
        ("plugins/runner/iris/1.0.0/plugin.py~", None),
        ("plugins/notatype/x/1.0.0/plugin.py", None),
        ("plugins/README.md", None),
        ("models/.staging/model.onnx", None),
        ("elsewhere/file", None),
    ],
)
def test_scope_of_changed_paths(
    watcher: Watcher, tmp_path: Path, rel: str, scope: tuple[str, ...] | None
) -> None:
    assert watcher.scope_of(tmp_path / rel) == scope


def test_fingerprints_follow_content_not_timestamps(tmp_path: Path) -> None:
    folder = tmp_path / "v"
    folder.mkdir()
    (folder / "a.py").write_text("x = 1\n")
    fp = Fingerprinter()
    first = fp.folder(folder)
    os.utime(folder / "a.py", (1, 1))  # a touch
    (folder / ".swap.swp").write_text("junk")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "a.pyc").write_bytes(b"junk")
    assert fp.folder(folder) == first
    (folder / "a.py").write_text("x = 2\n")  # same size, new content
    assert fp.folder(folder) != first
    (folder / "a.py").write_text("x = 1\n")
    assert fp.folder(folder) == first
    (folder / "b.py").write_text("")
    assert fp.folder(folder) != first


def test_extra_files_count_and_missing_ones_differ(tmp_path: Path) -> None:
    folder = tmp_path / "v"
    folder.mkdir()
    model = tmp_path / "model.onnx"
    model.write_bytes(b"1")
    fp = Fingerprinter()
    with_model = fp.folder(folder, [model])
    model.write_bytes(b"2")
    assert fp.folder(folder, [model]) != with_model
    model.unlink()
    assert fp.file(model) == "missing"
    fp.forget(tmp_path)
