"""Which changed paths the watcher acts on, what fingerprints see as a change, lost roots."""

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.lifecycle.watcher import Watcher
from plugserve.registry.plugins.fingerprint import Fingerprinter
from tests.helpers import write_processor


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


async def until(check: Callable[[], object]) -> None:
    for _ in range(500):  # 10 s
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in 10 s")


async def test_a_lost_root_is_recorded_kept_serving_and_rescanned_when_back(
    plugins_dir: Path, models_dir: Path, tmp_path: Path
) -> None:
    """issue 12, finding 17: the watcher notices its folder removed, then replaced."""
    write_processor(plugins_dir, "preprocessor", "scale", "1.0.0", 1)
    registry = Registry(plugins_dir, models_dir)
    await registry.start()
    watcher = Watcher(registry, debounce_s=0.05, poll_s=0.05)
    task = asyncio.create_task(watcher.run())
    try:
        await asyncio.sleep(0.2)
        shutil.rmtree(plugins_dir)
        await until(lambda: plugins_dir in registry.lost_roots)
        await asyncio.sleep(0.3)  # the deletion events fired meanwhile: nothing unloaded
        assert [r.label for r in registry.plugins()] == ["preprocessor/scale@1.0.0"]
        report = await registry.sync()
        assert "missing" in report.failed[0]["error"] and not report.unloaded
        write_processor(plugins_dir, "preprocessor", "scale", "2.0.0", 2)
        await until(lambda: not registry.lost_roots)
        await until(lambda: [r.label for r in registry.plugins()] == ["preprocessor/scale@2.0.0"])
        write_processor(plugins_dir, "preprocessor", "scale", "3.0.0", 3)  # watched again
        await until(lambda: len(registry.plugins()) == 2)
    finally:
        watcher.stop.set()
        await asyncio.wait_for(task, 5)
        await registry.close()


async def test_a_root_missing_at_start_is_not_lost_and_a_rescan_starts_empty(
    tmp_path: Path, models_dir: Path
) -> None:
    """issue 12, finding 17 (its class): only a folder that was there counts as lost."""
    registry = Registry(tmp_path / "absent", models_dir)
    await registry.start()  # no versions: a rescan of a missing folder is no loss
    watcher = Watcher(registry, poll_s=0.05)
    task = asyncio.create_task(watcher.run())
    try:
        await asyncio.sleep(0.2)
        assert registry.lost_roots == {}
        shutil.rmtree(models_dir)
        await until(lambda: list(registry.lost_roots) == [models_dir])
        await asyncio.to_thread(models_dir.mkdir)
        await until(lambda: not registry.lost_roots)
    finally:
        watcher.stop.set()
        await asyncio.wait_for(task, 5)


async def test_a_change_applied_after_its_root_went_is_skipped(
    plugins_dir: Path, models_dir: Path
) -> None:
    """A version's deletion, debounced past the moment its root was found lost and the watch
    re-armed without it, must not unload it: the root went, and the rescan on its return
    decides (found with 2 workers, where the fan-out made this timing common)."""
    write_processor(plugins_dir, "preprocessor", "scale", "1.0.0", 1)
    registry = Registry(plugins_dir, models_dir)
    await registry.start()
    watcher = Watcher(registry)
    try:
        shutil.rmtree(plugins_dir)
        watcher._arm(first=False)  # re-armed: the root is recorded as absent now
        await watcher.apply(("version", "preprocessor", "scale", "1.0.0"))
        assert [r.label for r in registry.plugins()] == ["preprocessor/scale@1.0.0"]
        assert registry.records[("preprocessor", "scale", "1.0.0")].state == "ready"
    finally:
        await registry.close()
