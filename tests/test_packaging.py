"""The install exposes one import name, ``plugserve``, and the command runs from it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

# Run outside the checkout (its folders server/ and registry/ are not on the path
# there): what an installed plugserve exposes, not what the source tree holds.
IMPORT_ALL = """
import importlib, importlib.util, pkgutil, sys
assert importlib.util.find_spec("server") is None, "a top-level server module is installed"
assert importlib.util.find_spec("registry") is None, "a top-level registry module is installed"
import plugserve
optional = {"tensorrt", "cuda", "grpc_tools", "opentelemetry"}
names = []
for info in pkgutil.walk_packages(plugserve.__path__, "plugserve."):
    if info.name.endswith(("__main__", ".generate")):
        continue  # running them is the command; generate needs grpc_tools
    try:
        importlib.import_module(info.name)
    except ImportError as exc:
        if (exc.name or "").split(".")[0] not in optional:
            raise
    names.append(info.name)
stray = sorted(n for n in sys.modules if n.split(".")[0] in ("server", "registry"))
assert not stray, stray
print(len(names))
"""


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_the_install_exposes_plugserve_alone(tmp_path: Path) -> None:
    """Issue 30: ``pip install plugserve`` put top-level packages named ``server`` and
    ``registry`` on the path, where any other project's ``server`` collides with ours.
    Now every module imports as ``plugserve.…`` (each of them imported here) and no module
    of ours is loaded under another name."""
    top_level = importlib.metadata.distribution("plugserve").read_text("top_level.txt")
    assert (top_level or "").split() == ["plugserve"]
    done = _python(IMPORT_ALL, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 100  # every module, not an empty walk


def test_the_checkout_runs_as_installed(tmp_path: Path) -> None:
    """In the checkout, ``plugserve/server`` and ``plugserve/registry`` are the folders
    ``server/`` and ``registry/`` (links), so a module is the same file either way."""
    for name in ("server", "registry"):
        assert (ROOT / "plugserve" / name).resolve() == (ROOT / name).resolve()
    done = _python("import plugserve.server.cli as c; print(c.__file__)", ROOT)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).resolve() == (ROOT / "server" / "cli.py").resolve()


def test_python_m_plugserve_is_the_command(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "plugserve", "--version"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("plugserve ")
