"""The image's command as a container runs it: PID 1 of its own PID namespace.

No image can be built here, but the process it runs can: the Dockerfile's ENTRYPOINT and
CMD (on loopback and free ports, the bundled iris plugins as the volumes), run as the init
of a new PID namespace (``unshare``), as Docker and Kubernetes run it. The kernel delivers
the runtime's SIGTERM to a namespace's init only if it handles SIGTERM: this checks that
plugserve, with the Deployment's two workers, drains on it and exits 0, leaving nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plugserve.server.runtime.shutdown import SHUTDOWN_MARGIN_S
from tests.deploy.files import DOCKER, entrypoint, last
from tests.helpers import ROOT, free_port, wait_until_ok

pytestmark = pytest.mark.slow


def _namespace_init(unshare: subprocess.Popen[bytes], timeout: float = 10) -> int:
    """The pid (here) of the process ``unshare --fork`` started: the namespace's PID 1."""
    deadline = time.monotonic() + timeout
    children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children")
    while time.monotonic() < deadline:
        found = children.read_text().split() if children.exists() else []
        if found:
            return int(found[0])
        time.sleep(0.05)
    raise TimeoutError("unshare started no process")


def _image_command(tmp_path: Path, port: int) -> list[str]:
    """The image's command, bound to loopback on free ports, on copies of the iris plugins."""
    command = entrypoint(DOCKER / "Dockerfile")
    volumes = {
        "/srv/plugserve/plugins": tmp_path / "plugins",
        "/srv/plugserve/models": tmp_path / "models",
    }
    for part in ("runner/iris/1.0.0", "preprocessor/scale/1.0.0", "postprocessor/label/1.0.0"):
        shutil.copytree(ROOT / "plugins" / part, tmp_path / "plugins" / part)
    shutil.copytree(ROOT / "models" / "iris", tmp_path / "models" / "iris")
    swapped = [str(volumes.get(arg, arg)).replace("0.0.0.0", "127.0.0.1") for arg in command]
    program = shutil.which("plugserve", path=str(Path(sys.executable).parent))
    assert program is not None
    return [
        program,
        *swapped[1:],
        "--port",
        str(port),
        "--grpc-port",
        str(free_port()),
        "--workers",
        "2",
    ]


def test_image_command_as_pid_1_drains_on_sigterm(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs unshare (util-linux) and root for a PID namespace")
    probe = subprocess.run([unshare, "--pid", "--fork", "true"], capture_output=True, timeout=10)
    if probe.returncode != 0:
        pytest.skip(f"no PID namespace can be made here: {probe.stderr.decode().strip()}")
    port = free_port()
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [unshare, "--pid", "--fork", "--kill-child", *_image_command(tmp_path, port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        init = _namespace_init(proc)
        url = f"http://127.0.0.1:{port}"
        wait_until_ok(proc, url + "/v2/health/ready", 60, log_path.read_text)
        # The HEALTHCHECK, as Docker runs it, on this port.
        health = last(DOCKER / "Dockerfile", "HEALTHCHECK").exec_form()
        code = health[-1].replace("127.0.0.1:8000/", f"127.0.0.1:{port}/")
        assert subprocess.run([sys.executable, *health[1:-1], code], timeout=30).returncode == 0
        nspid = next(
            line
            for line in Path(f"/proc/{init}/status").read_text().splitlines()
            if line.startswith("NSpid:")
        )
        assert nspid.split()[-1] == "1"  # plugserve itself is the namespace's init
        started = time.monotonic()
        os.kill(init, signal.SIGTERM)  # what docker stop and the kubelet send
        code = proc.wait(timeout=30 + SHUTDOWN_MARGIN_S + 5)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert code == 0, text
    assert took < 30 + SHUTDOWN_MARGIN_S, text  # within drain_timeout_s and its bound
    assert text.count('"draining"') == 2, text  # each worker drained
    assert "shutdown_overdue" not in text
