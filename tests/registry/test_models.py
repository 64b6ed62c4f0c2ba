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


def test_a_plugin_reads_the_custom_metadata_of_a_model(models_dir: Path, tmp_path: Path) -> None:
    """An OCR recognizer's character list lives in its model: a processor reads it by
    the model's name, a runner of its own ``[runner] model``."""
    import onnx
    import structlog

    from plugserve.registry.types import PluginInfo
    from tests.helpers import add_model

    path = add_model(models_dir / "rec" / "1" / "model.onnx")
    model = onnx.load(str(path))
    onnx.helper.set_model_props(model, {"character": "abc\ndé", "mean": "0.5"})
    onnx.save(model, str(path))
    plugin = PluginInfo("post", "1.0.0", "postprocessor", tmp_path, structlog.get_logger(),
                        models_dir=models_dir)  # fmt: skip
    assert plugin.model_metadata("models:rec") == {"character": "abc\ndé", "mean": "0.5"}
    runner = PluginInfo("rec", "1.0.0", "runner", tmp_path, structlog.get_logger(), model=path)
    assert runner.model_metadata() == {"character": "abc\ndé", "mean": "0.5"}
    plain = add_model(models_dir / "plain" / "1" / "model.onnx")
    assert plugin.model_metadata("models:plain/1/model.onnx") == {}
    with pytest.raises(PluginLoadError, match="no \\[runner\\] model of its own"):
        plugin.model_metadata()
    with pytest.raises(PluginLoadError, match="no versions of model 'nope'"):
        plugin.model_metadata("models:nope")
    plain.write_bytes(b"not a model")
    with pytest.raises(PluginLoadError, match="cannot read its metadata"):
        plugin.model_metadata("models:plain")
