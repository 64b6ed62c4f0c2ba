"""A real etcd (Debian's ``etcd-server``) on loopback, for fleet tests; stop and restart it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import free_ports, wait_until_ok

REQUIRE_ENV = "PLUGSERVE_REQUIRE_ETCD"


def required_tool(name: str, package: str) -> str:
    """The path of ``name``; skips the test where it is missing, unless CI says it must be
    there (``PLUGSERVE_REQUIRE_ETCD``), which fails it instead."""
    found = shutil.which(name)
    if found is None:
        missing = f"{name} is not installed (Debian: apt-get install {package})"
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{REQUIRE_ENV} is set but {missing}")
        pytest.skip(missing)
    return found


class EtcdProcess:
    """One etcd member with its own data dir; ``stop()`` kills it, ``start()`` brings it back
    on the same port with the same data."""

    def __init__(self, data_dir: Path) -> None:
        self.binary = required_tool("etcd", "etcd-server")
        self.data_dir = data_dir
        self.port, self.peer_port = free_ports(2)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"

    def url(self, prefix: str = "/plugserve") -> str:
        return f"etcd://127.0.0.1:{self.port}{prefix}"

    def start(self, timeout: float = 20.0) -> EtcdProcess:
        peer = f"http://127.0.0.1:{self.peer_port}"
        command = [
            self.binary,
            "--name", "test",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.endpoint,
            "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"test={peer}",
        ]  # fmt: skip
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_until_ok(self.proc, self.endpoint + "/health", timeout, self.log_path.read_text)
        return self

    def enable_auth(self, user: str, password: str, prefix: str) -> None:
        """Turn on authentication: ``user`` may read and write ``prefix`` only (etcdctl)."""
        etcdctl = required_tool("etcdctl", "etcd-client")
        commands = [
            ["user", "add", "root:root-secret"],
            ["user", "add", f"{user}:{password}"],
            ["role", "add", "plugserve"],
            ["role", "grant-permission", "plugserve", "--prefix=true", "readwrite", prefix],
            ["user", "grant-role", user, "plugserve"],
            ["auth", "enable"],
        ]
        for args in commands:
            subprocess.run(
                [etcdctl, f"--endpoints={self.endpoint}", *args],
                check=True, capture_output=True, env={**os.environ, "ETCDCTL_API": "3"},
            )  # fmt: skip

    def stop(self) -> None:
        """Kill it, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
