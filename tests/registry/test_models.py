from pathlib import Path

import pytest

from plugserve.registry.errors import PluginLoadError
from plugserve.registry.models import ModelRef, model_versions, resolve_model


def _version(models_dir: Path, name: str, version: str, *files: str) -> Path:
    folder = models_dir / name / version
    folder.mkdir(parents=True)
    for f in files:
        (folder / f).write_bytes(b"x")
    return folder


def test_highest_version_first_integers_and_semver(models_dir: Path) -> None:
    for v in ["1", "2", "10", ".3.tmp", "notaversion"]:
        _version(models_dir, "m", v, "model.onnx")
    assert [str(v) for v, _ in model_versions(models_dir, "m")] == ["10", "2", "1"]


def test_resolution_forms(models_dir: Path, tmp_path: Path) -> None:
    _version(models_dir, "m", "1", "model.onnx", "other.onnx")
    _version(models_dir, "m", "2", "model.onnx")
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "local.onnx").write_bytes(b"x")
    assert (
        resolve_model("models:m", plugin, models_dir, "model.onnx") == models_dir / "m/2/model.onnx"
    )
    assert (
        resolve_model("models:m/1", plugin, models_dir, "model.onnx")
        == models_dir / "m/1/model.onnx"
    )
    assert (
        resolve_model("models:m/1/other.onnx", plugin, models_dir, None)
        == models_dir / "m/1/other.onnx"
    )
    assert resolve_model("models:m/2", plugin, models_dir, None) == models_dir / "m/2/model.onnx"
    assert resolve_model("local.onnx", plugin, models_dir, None) == plugin / "local.onnx"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("models:absent", "no versions of model 'absent'"),
        ("models:m/7", "has no version 7"),
        ("models:m/1/nope.onnx", "does not exist"),
        ("models:m/1", "name the file"),
        ("models:m/x/y/z", "is not models:"),
        ("models:m/1/..", "invalid file name"),
        ("missing.onnx", "does not exist"),
    ],
)
def test_resolution_errors(models_dir: Path, tmp_path: Path, spec: str, message: str) -> None:
    _version(models_dir, "m", "1", "a.onnx", "b.onnx")
    with pytest.raises(PluginLoadError, match=message):
        resolve_model(spec, tmp_path, models_dir, None)


def test_model_ref_parse() -> None:
    assert ModelRef.parse("models:m/3/f.onnx") == ModelRef("m", "3", "f.onnx")
    with pytest.raises(ValueError):
        ModelRef.parse("m")
