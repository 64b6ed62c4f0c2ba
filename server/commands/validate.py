"""``plugserve validate``: load one plugin package as the server would, wherever it lies.

A runner is also run once on a sample request, to compare its outputs with the shapes it
declares; ``--batching`` (:class:`BatchCheckSpec`) checks that batching keeps its answers
(``registry/execution/batch_check.py``).

A package inside a plugins folder (``<plugins_dir>/<type>/<name>/<version>``)
is checked as the server checks it, folder names included. A package anywhere
else (a staged ``build/iris-2.0.0/``) takes its type, name and version from its
manifest alone. Either way the symlink rule (``registry/plugins/confine.py``) holds:
what the package reads must lie in its plugins folder (the package folder
itself, for a staged one) or the models folder. A runner's chain is checked
against a plugins folder: the one given, else the one the package lies in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from plugserve.registry.errors import ConfigError, PlugserveError
from plugserve.registry.execution.components.base import LoadedPlugin
from plugserve.registry.execution.components.batched import BatchedRunner
from plugserve.registry.lifecycle.loader import Loader
from plugserve.registry.manifest import (
    MANIFEST_NAME,
    BatchCheckSpec,
    Manifest,
    load_manifest,
    manifest_problems,
)
from plugserve.registry.plugins.hooks import PluginHooks
from plugserve.registry.refs import PLUGIN_TYPES, Ref, is_ignored_name

log = structlog.get_logger("plugserve.validate")

VALID, INVALID, ERROR = 0, 1, 2
"""Exit codes: the package is valid; it is not; the command could not check it (usage, or
a failure of the check itself)."""
OUTCOMES = {VALID: "valid", INVALID: "invalid", ERROR: "error"}


@dataclasses.dataclass
class Report:
    """What ``plugserve validate`` found; :meth:`as_json` is its ``--json`` shape."""

    path: Path
    models_dir: Path
    plugins_dir: Path | None = None
    layout_checked: bool = False
    manifest: Manifest | None = None
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    """What serves, but not as declared (a runner's outputs against its declared shapes)."""
    chain: list[dict[str, str | None]] = dataclasses.field(default_factory=list)
    metadata: dict[str, Any] | None = None
    batching: dict[str, Any] | None = None
    """What ``--batching`` found (``BatchCheck.as_json``), or ``None``."""
    code: int = VALID

    def as_json(self) -> dict[str, Any]:
        manifest = self.manifest
        return {
            "outcome": OUTCOMES[self.code],
            "valid": self.code == VALID,
            "path": str(self.path),
            "plugin": manifest.label if manifest else None,
            "type": manifest.type if manifest else None,
            "name": manifest.name if manifest else None,
            "version": str(manifest.version) if manifest else None,
            "route": manifest.route_name if manifest and manifest.type == "runner" else None,
            "models_dir": str(self.models_dir),
            "plugins_dir": None if self.plugins_dir is None else str(self.plugins_dir),
            "layout_checked": self.layout_checked,
            "chain": self.chain,
            "problems": self.problems,
            "notes": self.notes,
            "warnings": self.warnings,
            "metadata": self.metadata,
            "batching": self.batching,
        }

    def text(self) -> str:
        """The human summary."""
        label = self.manifest.label if self.manifest else str(self.path)
        verdict = {VALID: "valid", INVALID: "INVALID", ERROR: "not checked"}[self.code]
        lines = [f"{label}: {verdict}"]
        lines += [f"  problem: {problem}" for problem in self.problems]
        where = "in a plugins folder" if self.layout_checked else "a package anywhere"
        lines.append(f"  folder:      {self.path} ({where})")
        lines.append(f"  models dir:  {self.models_dir}")
        if self.plugins_dir is not None:
            lines.append(f"  plugins dir: {self.plugins_dir}")
        if self.manifest is not None and self.manifest.type == "runner":
            lines.append(f"  route:       {self.manifest.route_name}")
        for stage in self.chain:
            found = stage["resolved"] or "missing"
            lines.append(f"  {stage['stage']}: {stage['ref']} -> {found}")
        for kind in ("inputs", "outputs"):
            for spec in (self.metadata or {}).get(kind) or []:
                lines.append(
                    f"  {kind[:-1]}: {spec.get('name')} {spec.get('datatype')} {spec.get('shape')}"
                )
        lines += [f"  warning: {warning}" for warning in self.warnings]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def plugins_folder(path: Path, plugins_dir: Path | None) -> Path | None:
    """The plugins folder ``path`` lies in as ``<type>/<name>/<version>``, or ``None``.

    With ``plugins_dir`` given, ``path`` is in it when it lies under it; else when
    its grandparent is named for a plugin type (``runner``, ``preprocessor``,
    ``postprocessor``), as the server's own layout has it.
    """
    if plugins_dir is not None:
        inside = path != plugins_dir and path.is_relative_to(plugins_dir)
        return plugins_dir if inside else None
    if path.parent.parent.name in PLUGIN_TYPES:
        return path.parent.parent.parent
    return None


def check_paths(path: Path, models_dir: Path, plugins_dir: Path | None, explicit: bool) -> None:
    """Raise :class:`ConfigError` (exit 2) for a path the command cannot work with."""
    if not path.is_dir():
        raise ConfigError(f"{path}: no such folder")
    if not (path / MANIFEST_NAME).is_file():
        raise ConfigError(f"{path}: no {MANIFEST_NAME} here: not a plugin package")
    if explicit and not models_dir.is_dir():
        raise ConfigError(f"--models-dir {models_dir}: no such folder")
    if plugins_dir is not None and not plugins_dir.is_dir():
        raise ConfigError(f"--plugins-dir {plugins_dir}: no such folder")


def validate(
    path: Path,
    models_dir: Path,
    plugins_dir: Path | None = None,
    explicit_models: bool = True,
    staged: Sequence[Manifest] = (),
    batching: BatchCheckSpec | None = None,
) -> Report:
    """Check the manifest (every problem of it), the chain and the load (import, create,
    warmup, a runner's outputs on one sample request, release). ``staged``: the other
    packages validated with this one, which its chain may name as if they were installed;
    ``batching``: also check that batching keeps a runner's answers.

    Raises :class:`ConfigError` for a path the command cannot work with (exit 2).
    """
    path = Path(os.path.abspath(path))  # not resolved: a linked folder is judged where it is
    plugins_dir = None if plugins_dir is None else Path(os.path.abspath(plugins_dir))
    check_paths(path, models_dir, plugins_dir, explicit_models)
    home = plugins_folder(path, plugins_dir)
    report = Report(path, models_dir, plugins_dir or home, layout_checked=home is not None)
    if not models_dir.is_dir():
        report.notes.append(f"models dir {models_dir} does not exist (--models-dir sets it)")
    manifest, problems = manifest_problems(path, check_layout=home is not None)
    if manifest is None:
        report.problems.extend(problems)
        report.code = INVALID
        return report
    report.manifest = manifest
    if report.plugins_dir is not None or staged:
        check_chain(report, manifest, report.plugins_dir, staged)
    elif manifest.route.preprocess or manifest.route.postprocess:
        report.notes.append("the chain was not checked: give --plugins-dir")
    asyncio.run(_load(report, report.manifest, home, batching))
    report.code = INVALID if report.problems else VALID
    return report


def check_chain(
    report: Report, manifest: Manifest, plugins_dir: Path | None, staged: Sequence[Manifest] = ()
) -> None:
    """Each ``[route]`` stage must have a version, in ``plugins_dir`` or among the ``staged``
    packages, that its ref matches."""
    stages = [("preprocess", "preprocessor", r) for r in manifest.route.preprocess]
    stages += [("postprocess", "postprocessor", r) for r in manifest.route.postprocess]
    where = " and ".join(
        [*([str(plugins_dir)] if plugins_dir is not None else []),
         *(["the packages validated with it"] if staged else [])]
    )  # fmt: skip
    for stage, kind, ref in stages:
        resolved = _resolve(plugins_dir, kind, ref, staged)
        report.chain.append({"stage": stage, "ref": str(ref), "resolved": resolved})
        if resolved is None:
            wanted = f"version {ref.version}" if ref.version else "version"
            report.problems.append(
                f"route.{stage}: {kind} {ref} has no {wanted} in {where}"
                " (the route would answer 503)"
            )


def _resolve(
    plugins_dir: Path | None, kind: str, ref: Ref, staged: Sequence[Manifest] = ()
) -> str | None:
    """The version ``ref`` picks among the valid manifests in ``plugins_dir`` and the
    ``staged`` packages, if any."""
    versions = [m.version for m in staged if m.type == kind and m.name == ref.name]
    folder = None if plugins_dir is None else plugins_dir / kind / ref.name
    try:
        names = [] if folder is None else [n for n in os.listdir(folder) if not is_ignored_name(n)]
    except OSError:
        names = []
    for name in names:
        assert folder is not None
        try:
            versions.append(load_manifest(folder / name).version)
        except PlugserveError:
            continue  # not a version the server would load
    if ref.version is not None:
        return str(ref.version) if ref.version in versions else None
    return str(max(versions)) if versions else None


def validate_all(
    paths: Sequence[Path],
    models_dir: Path,
    plugins_dir: Path | None = None,
    explicit_models: bool = True,
    batching: BatchCheckSpec | None = None,
) -> list[Report]:
    """:func:`validate` each package, each one's chain also resolved among the others
    (staged packages that name each other, validated together). A package whose check
    fails unexpectedly is reported as not checked (:func:`guarded`); the others are
    still checked."""
    staged = []
    for path in paths:
        home = plugins_folder(Path(os.path.abspath(path)), plugins_dir)
        try:
            manifest, _ = manifest_problems(Path(os.path.abspath(path)), home is not None)
        except Exception:  # its own check below reports it
            manifest = None
        if manifest is not None:
            staged.append(manifest)
    return [
        guarded(
            path, models_dir, plugins_dir, explicit_models,
            [m for m in staged if m.path != Path(os.path.abspath(path))], batching,
        )
        for path in paths
    ]  # fmt: skip


def guarded(
    path: Path,
    models_dir: Path,
    plugins_dir: Path | None,
    explicit_models: bool,
    staged: Sequence[Manifest],
    batching: BatchCheckSpec | None = None,
) -> Report:
    """:func:`validate`, whatever goes wrong inside it a problem of its report: outcome
    ``error`` (exit 2, the package could not be checked), the exception named, never a
    traceback. A usage error still raises :class:`ConfigError`."""
    try:
        return validate(path, models_dir, plugins_dir, explicit_models, staged, batching)
    except ConfigError:
        raise
    except Exception as exc:
        log.warning("validate_failed", path=str(path), error=f"{type(exc).__name__}: {exc}")
        report = Report(Path(os.path.abspath(path)), models_dir, plugins_dir, code=ERROR)
        report.problems.append(f"the check itself failed: {type(exc).__name__}: {exc}")
        return report


async def _load(
    report: Report, manifest: Manifest, home: Path | None, batching: BatchCheckSpec | None
) -> None:
    """Load, warm up, probe and release the package; a failure is the report's problem."""
    host = PluginHooks()
    host.load_builtins()
    host.load_entry_points()
    loader = Loader(host, report.models_dir, plugins_dir=home, check_layout=home is not None)
    # An isolated runner's processes read their folder as the server lays it out; its
    # batches are checked here, where its component is.
    isolated = manifest.runner is not None and manifest.runner.isolated
    in_process = isolated and (home is None or batching is not None)
    if in_process:
        why = "a staged package" if home is None else "to check its batching"
        report.notes.append(f'isolation = "process": loaded in this process ({why})')
    try:
        try:
            loaded = await loader.load(report.path, in_process=in_process)
        except PlugserveError as exc:
            report.problems.append(exc.message)
            return
        try:
            report.metadata = loaded.metadata()
            await _run(report, loaded, batching)
        finally:
            await loader.release(loaded)
    finally:
        if loader.runners is not None:  # an isolated runner: its processes and their folder
            await loader.runners.close()


async def _run(report: Report, loaded: LoadedPlugin, batching: BatchCheckSpec | None) -> None:
    """A runner's outputs on one sample request against its declared shapes (warnings);
    with ``batching``, whether batching keeps its answers (problems where it does not)."""
    if not isinstance(loaded, BatchedRunner):
        if batching is not None:
            report.notes.append("batching not checked: not a runner that answers each request once")
        return
    try:
        sample = None if batching is None else batching.sample
        report.warnings.extend(await loaded.probe_outputs(sample))
    except Exception as exc:
        said = exc.message if isinstance(exc, PlugserveError) else f"{type(exc).__name__}: {exc}"
        report.notes.append(f"output shapes not probed: a sample request failed: {said}")
    if batching is None:
        return
    found = await loaded.check_batching(batching)
    report.batching = found.as_json()
    if found.exact:
        report.notes.append(f"batching: {found.text()}")
        return
    report.problems.extend(found.problems())
    why = found.why()
    if why is not None:
        report.notes.append(f"why batching changes answers: {why}")
