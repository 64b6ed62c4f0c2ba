"""The model repository: ``<models_dir>/<name>/<version>/<file>``, highest version first."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from plugserve.registry.errors import PluginLoadError
from plugserve.registry.refs import is_ignored_name, is_valid_name
from plugserve.registry.versions import Version

MODELS_SCHEME = "models:"


@dataclass(frozen=True)
class ModelRef:
    """``models:<name>``, ``models:<name>/<version>`` or ``models:<name>/<version>/<file>``."""

    name: str
    version: str | None = None
    file: str | None = None

    @classmethod
    def parse(cls, text: str) -> ModelRef:
        if not text.startswith(MODELS_SCHEME):
            raise ValueError(f"{text!r} does not start with {MODELS_SCHEME!r}")
        parts = text[len(MODELS_SCHEME) :].split("/")
        if len(parts) > 3 or not is_valid_name(parts[0]):
            raise ValueError(f"{text!r} is not models:<name>[/<version>[/<file>]]")
        version = parts[1] if len(parts) > 1 else None
        file = parts[2] if len(parts) > 2 else None
        if file in ("", ".", "..") or (file and is_ignored_name(file)):
            raise ValueError(f"{text!r}: invalid file name")
        if version is not None:
            Version.parse_model(version)  # raises ValueError
        return cls(parts[0], version, file)


def model_versions(models_dir: Path, name: str) -> list[tuple[Version, Path]]:
    """The version folders of model ``name``, highest first; invalid names are skipped."""
    folder = models_dir / name
    found = []
    if not folder.is_dir():
        return []
    for child in folder.iterdir():
        if is_ignored_name(child.name) or not child.is_dir():
            continue
        try:
            found.append((Version.parse_model(child.name), child))
        except ValueError:
            continue
    return sorted(found, key=lambda item: item[0], reverse=True)


def resolve_model(
    spec: str, plugin_folder: Path, models_dir: Path, default_file: str | None
) -> Path:
    """Resolve a manifest's ``[runner] model`` to an existing file.

    A plain path is relative to the plugin folder. A ``models:`` reference picks
    the named (or highest) version folder, then the named file, the backend's
    ``default_file``, or the folder's only file.
    """
    if not spec.startswith(MODELS_SCHEME):
        path = plugin_folder / spec
        if not path.is_file():
            raise PluginLoadError(f"model file {path} does not exist")
        return path
    try:
        ref = ModelRef.parse(spec)
    except ValueError as exc:
        raise PluginLoadError(str(exc)) from None
    versions = model_versions(models_dir, ref.name)
    if not versions:
        raise PluginLoadError(f"{spec}: no versions of model {ref.name!r} in {models_dir}")
    if ref.version is None:
        folder = versions[0][1]
    else:
        wanted = Version.parse_model(ref.version)
        matches = [path for version, path in versions if version == wanted]
        if not matches:
            have = ", ".join(str(v) for v, _ in versions)
            raise PluginLoadError(
                f"{spec}: model {ref.name!r} has no version {ref.version} ({have})"
            )
        folder = matches[0]
    return _model_file(spec, folder, ref.file or default_file)


def _model_file(spec: str, folder: Path, name: str | None) -> Path:
    if name is not None:
        path = folder / name
        if not path.is_file():
            raise PluginLoadError(f"{spec}: {path} does not exist")
        return path
    files = [p for p in folder.iterdir() if p.is_file() and not is_ignored_name(p.name)]
    if len(files) != 1:
        raise PluginLoadError(f"{spec}: name the file, {folder} holds {len(files)} files")
    return files[0]


def onnx_metadata(path: Path) -> dict[str, str]:
    """The custom metadata an ONNX model file carries (its ``metadata_props``: a character
    list, labels, a preprocessing recipe), read with ONNX Runtime on the CPU, its graph
    not optimized. Raises :class:`PluginLoadError` for a file it cannot read."""
    try:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        return dict(session.get_modelmeta().custom_metadata_map)
    except Exception as exc:  # the file's fault (or the install's), said as is
        raise PluginLoadError(f"{path}: ONNX Runtime cannot read its metadata: {exc}") from None
