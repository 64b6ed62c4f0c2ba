"""Read deploy/: Dockerfile instructions, Kubernetes documents, plugserve's serve command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from plugserve.server.cli import _parser
from plugserve.server.config import Settings, load_settings
from tests.helpers import ROOT

DEPLOY = ROOT / "deploy"
DOCKER = DEPLOY / "docker"
KUBERNETES = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"
DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
_FIELDS = set(Settings.model_fields)


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: its keyword (upper case) and its text, lines joined."""

    keyword: str
    text: str

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form instruction; raises ``ValueError`` otherwise."""
        text = self.text
        if self.keyword == "HEALTHCHECK":
            text = text.partition(" CMD ")[2]
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{self.keyword} is not a JSON array of strings: {self.text}")
        return value


def instructions(dockerfile: Path) -> list[Instruction]:
    """The instructions of ``dockerfile``, continuation lines joined, comments dropped."""
    found: list[Instruction] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += stripped.removesuffix("\\").strip() + " "
        if not stripped.endswith("\\"):
            keyword, _, text = pending.strip().partition(" ")
            found.append(Instruction(keyword.upper(), text.strip()))
            pending = ""
    return found


def last(dockerfile: Path, keyword: str) -> Instruction:
    """The last ``keyword`` instruction (the one that counts for ENTRYPOINT, CMD, USER...)."""
    matches = [i for i in instructions(dockerfile) if i.keyword == keyword]
    assert matches, f"{dockerfile.name} has no {keyword}"
    return matches[-1]


def entrypoint(dockerfile: Path) -> list[str]:
    """ENTRYPOINT followed by CMD: the command a container of the image runs by default."""
    return last(dockerfile, "ENTRYPOINT").exec_form() + last(dockerfile, "CMD").exec_form()


def yaml_documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document in ``path``."""
    with path.open() as stream:
        return [doc for doc in yaml.safe_load_all(stream) if doc]


def manifests() -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every Kubernetes object under deploy/kubernetes (kustomizations and values left out)."""
    for path in sorted(KUBERNETES.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or path.name.endswith("-values.yaml"):
            continue
        for doc in yaml_documents(path):
            yield path, doc


def find(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``) under deploy/kubernetes."""
    found = [
        doc
        for _, doc in manifests()
        if doc["kind"] == kind and name in (None, doc["metadata"]["name"])
    ]
    assert len(found) == 1, f"{len(found)} {kind} objects named {name}"
    return found[0]


def serve_args(argv: Sequence[str]) -> argparse.Namespace:
    """``plugserve ...`` parsed by plugserve's own parser (SystemExit if it refuses them)."""
    return _parser().parse_args(list(argv))


def serve_settings(
    argv: Sequence[str],
    config_text: str | None,
    tmp_path: Path,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """The settings ``plugserve <argv>`` would run with, ``--config`` being ``config_text``.

    The flags reach :func:`load_settings` as ``plugserve serve`` hands them over: every
    parsed option named as a setting (server/cli.py, ``_serve``).
    """
    args = serve_args(argv)
    assert args.command == "serve", argv
    config = None
    if config_text is not None:
        config = tmp_path / "plugserve.toml"
        config.write_text(config_text)
    flags = {k: v for k, v in vars(args).items() if k in _FIELDS}
    return load_settings(config, flags, environ or {})


def split_command(line: str) -> list[str]:
    """A command line (a systemd ExecStart=, a shell line) split as the shell would."""
    return shlex.split(line)
