"""The symlink rule: what a plugin version reads must really lie in the plugins or models dir."""

import asyncio
import importlib
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from plugserve.registry.plugins.confine import Roots
from plugserve.registry.plugins.imports import forget, import_plugin, package_name
from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.types import RequestContext
from tests.helpers import ROOT, add_model, processor_source, write_add_runner, write_plugin


@pytest.fixture
async def registry(plugins_dir: Path, models_dir: Path) -> AsyncIterator[Registry]:
    reg = Registry(plugins_dir, models_dir, drain_timeout=2)
    yield reg
    await reg.close()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder beside the plugins and models dirs, holding code and a model."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "plugin.py").write_text(textwrap.dedent(processor_source("preprocessor")))
    (folder / "helper.py").write_text("X = 'outside'\n")
    add_model(folder / "model.onnx")
    return folder


def model_runner(plugins_dir: Path, model: str) -> Path:
    return write_plugin(
        plugins_dir,
        "runner",
        "m",
        "1.0.0",
        f'[runner]\nbackend = "onnxruntime"\nmodel = "{model}"\n',
        module=None,
    )


async def state(registry: Registry, key: tuple[str, str, str]) -> tuple[str, str]:
    await registry.start()
    record = registry.records[key]
    return record.state, record.last_error or ""


PRE = ("preprocessor", "p", "1.0.0")


async def test_a_symlinked_subfolder_leading_out_is_refused(
    plugins_dir: Path, registry: Registry, outside: Path
) -> None:
    """issue 12, finding 8: ``sub -> /outside`` with ``module = "sub/plugin.py"`` imported it."""
    folder = write_plugin(plugins_dir, *PRE, module="sub/plugin.py")
    (folder / "sub").symlink_to(outside)
    status, error = await state(registry, PRE)
    assert status == "failed"
    assert "preprocessor/p/1.0.0/sub leads outside the plugins dir" in error
    files = [getattr(m, "__file__", None) or "" for m in list(sys.modules.values())]
    assert not any(f.startswith(str(outside)) for f in files)


async def test_a_symlink_out_deep_inside_a_followed_folder_is_refused(
    plugins_dir: Path, registry: Registry, outside: Path
) -> None:
    """issue 12, finding 8 (the class): a link inside the root is followed, and checked within."""
    shared = plugins_dir / "shared"
    shared.mkdir()
    (shared / "helper.py").symlink_to(outside / "helper.py")
    folder = write_plugin(plugins_dir, *PRE, files={"plugin.py": processor_source("preprocessor")})
    (folder / "lib").symlink_to(shared)
    status, error = await state(registry, PRE)
    assert status == "failed"
    assert "preprocessor/p/1.0.0/lib/helper.py leads outside" in error


@pytest.mark.parametrize("dangling", [False, True])
async def test_a_file_symlinked_out_is_refused_dangling_or_not(
    plugins_dir: Path, registry: Registry, outside: Path, dangling: bool
) -> None:
    """issue 12, finding 8 (the class): files a manifest names and files it does not."""
    folder = write_plugin(plugins_dir, *PRE, files={"plugin.py": processor_source("preprocessor")})
    (folder / "data.txt").symlink_to(outside / ("gone.txt" if dangling else "helper.py"))
    status, error = await state(registry, PRE)
    assert status == "failed" and "data.txt leads outside" in error


async def test_a_relative_import_through_a_folder_symlinked_out_later_is_refused(
    plugins_dir: Path, models_dir: Path, outside: Path
) -> None:
    """issue 12, finding 8 (the class): imports are checked when they happen, not only at load."""
    folder = plugins_dir / "preprocessor" / "p" / "1.0.0"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "helper.py").write_text("X = 'inside'\n")
    (folder / "plugin.py").write_text(
        "def later():\n    from .sub import helper\n    return helper.X\n"
    )
    package = package_name(*PRE)
    module = import_plugin(folder, "plugin.py", package, Roots(plugins_dir, models_dir))
    try:
        shutil.rmtree(folder / "sub")
        (folder / "sub").symlink_to(outside)
        with pytest.raises(ImportError, match="leads outside the plugins dir"):
            module.later()
        (folder / "sub").unlink()
        shutil.copytree(outside, folder / "sub")  # a real folder inside: fine
        assert module.later() == "outside"
    finally:
        forget(package)


@pytest.mark.parametrize("special", ["fifo", "dev-zero", "fifo-model"])
async def test_fifos_and_devices_are_refused_without_hanging(
    plugins_dir: Path, registry: Registry, special: str
) -> None:
    """issue 12, finding 8 (the class): reading a FIFO blocks and /dev/zero never ends."""
    if special == "fifo-model":
        folder = model_runner(plugins_dir, "model.onnx")
        os.mkfifo(folder / "model.onnx")
        key = ("runner", "m", "1.0.0")
    else:
        key = PRE
        folder = write_plugin(plugins_dir, *PRE, files={"plugin.py": processor_source(PRE[0])})
        if special == "fifo":
            os.mkfifo(folder / "pipe")
        else:
            (folder / "zero").symlink_to("/dev/zero")
    await asyncio.wait_for(registry.start(), 20)
    record = registry.records[key]
    assert record.state == "failed"
    assert "refused" in (record.last_error or ""), record.last_error


async def test_a_released_plugin_package_imports_nothing_more(
    plugins_dir: Path, models_dir: Path
) -> None:
    """A thread a plugin left running cannot import its code once the version is released."""
    folder = plugins_dir / "preprocessor" / "p" / "1.0.0"
    folder.mkdir(parents=True)
    (folder / "late.py").write_text("X = 1\n")
    (folder / "plugin.py").write_text("import importlib\ndef later():\n    return 1\n")
    package = package_name(*PRE)
    import_plugin(folder, "plugin.py", package, Roots(plugins_dir, models_dir))
    parent = sys.modules[package]
    forget(package)
    sys.modules[package] = parent  # as a lingering reference would still reach it
    try:
        with pytest.raises(ImportError, match="released"):
            importlib.import_module(f"{package}.late")
    finally:
        forget(package)


@pytest.mark.parametrize("level", [1, 2, 3])
async def test_a_version_folder_symlinked_out_is_refused(
    plugins_dir: Path, registry: Registry, tmp_path: Path, level: int
) -> None:
    """The version folder, its name folder or its type folder linked out of the plugins dir."""
    elsewhere = tmp_path / "elsewhere"
    write_add_runner(elsewhere, "add", "1.0.0")
    parts = ("runner", "add", "1.0.0")[:level]
    plugins_dir.joinpath(*parts).parent.mkdir(parents=True, exist_ok=True)
    plugins_dir.joinpath(*parts).symlink_to(elsewhere.joinpath(*parts))
    status, error = await state(registry, ("runner", "add", "1.0.0"))
    assert status == "failed" and "runner/add/1.0.0 leads outside" in error


@pytest.mark.parametrize("link", ["version", "name", "file"])
async def test_a_model_repository_entry_symlinked_out_is_refused(
    plugins_dir: Path, models_dir: Path, registry: Registry, outside: Path, link: str
) -> None:
    """issue 12, finding 8: a model version folder symlinked out of the models dir loaded."""
    if link == "name":
        (models_dir / "m").symlink_to(outside.parent, target_is_directory=True)
        (outside.parent / "1").mkdir()
        shutil.copy(outside / "model.onnx", outside.parent / "1" / "model.onnx")
    elif link == "version":
        (models_dir / "m").mkdir()
        (models_dir / "m" / "1").symlink_to(outside)
    else:
        (models_dir / "m" / "1").mkdir(parents=True)
        (models_dir / "m" / "1" / "model.onnx").symlink_to(outside / "model.onnx")
    model_runner(plugins_dir, "models:m")
    status, error = await state(registry, ("runner", "m", "1.0.0"))
    assert status == "failed"
    assert "model " in error and "leads outside the plugins dir" in error


async def test_symlinks_that_stay_inside_the_roots_are_followed(
    plugins_dir: Path, models_dir: Path, registry: Registry
) -> None:
    """The rule refuses leaving the roots, not links: these all load and serve."""
    # Code shared between versions: a subfolder linked to a folder in the plugins dir.
    shared = plugins_dir / "shared"
    shared.mkdir()
    (shared / "plugin.py").write_text(textwrap.dedent(processor_source("preprocessor")))
    folder = write_plugin(plugins_dir, *PRE, "[config]\namount = 5\n", module="lib/plugin.py")
    (folder / "lib").symlink_to(shared)
    (folder / "loop").symlink_to(folder)  # a cycle: walked once
    # A model version linked to another version, inside the models dir.
    add_model(models_dir / "m" / "1" / "model.onnx", amount=3)
    (models_dir / "m" / "2").symlink_to(models_dir / "m" / "1")
    model_runner(plugins_dir, "models:m/2")
    # A plugin's own model file linked into the models dir.
    linked = write_plugin(
        plugins_dir,
        "runner",
        "linked",
        "1.0.0",
        '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\n',
        module=None,
    )
    (linked / "model.onnx").symlink_to(models_dir / "m" / "1" / "model.onnx")
    await registry.start()
    for key in (PRE, ("runner", "m", "1.0.0"), ("runner", "linked", "1.0.0")):
        record = registry.records[key]
        assert record.state == "ready", record.last_error
    chain = registry.routes.resolve("m", None)
    ctx = RequestContext("id", "m", {}, {}, "application/json")
    out = await chain.run({"x": np.zeros((1, 4), np.float32)}, ctx)
    assert float(out["y"][0, 0]) == 3


def test_roots_around_a_version_folder(tmp_path: Path) -> None:
    version = tmp_path / "plugins" / "runner" / "a" / "1.0.0"
    roots = Roots.around(version, tmp_path / "models")
    assert roots.folders == ((tmp_path / "plugins").resolve(), (tmp_path / "models").resolve())
    alone = Roots.around(tmp_path / "pkg", tmp_path / "models")
    assert alone.folders[0] == (tmp_path / "pkg").resolve()


@pytest.mark.parametrize("linked", ["subfolder", "version folder"])
def test_validate_refuses_a_folder_symlinked_out(
    plugins_dir: Path, outside: Path, tmp_path: Path, linked: str
) -> None:
    """``plugserve validate`` applies the same rule as the server."""
    if linked == "subfolder":
        folder = write_plugin(plugins_dir, *PRE, module="sub/plugin.py")
        (folder / "sub").symlink_to(outside)
    else:
        elsewhere = write_plugin(tmp_path / "elsewhere", *PRE, module="sub/plugin.py")
        shutil.copytree(outside, elsewhere / "sub")
        folder = plugins_dir.joinpath(*PRE)
        folder.parent.mkdir(parents=True)
        folder.symlink_to(elsewhere)
    result = subprocess.run(
        [sys.executable, "-m", "plugserve", "validate", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stdout
    assert "leads outside the plugins dir" in result.stdout
