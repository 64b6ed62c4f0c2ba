from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from server.app import create_app
from server.config import Settings
from server.logs import configure_logging
from tests.etcd import EtcdProcess
from tests.helpers import ServerProcess

configure_logging("console", "warning")


@pytest.fixture
def plugins_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "plugins"
    folder.mkdir()
    return folder


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    return folder


@pytest.fixture
def settings(plugins_dir: Path, models_dir: Path) -> Settings:
    # In-process apps do not watch; hot reload is tested against real server subprocesses.
    return Settings(plugins_dir=plugins_dir, models_dir=models_dir, watch=False)


@pytest.fixture
async def client(
    aiohttp_client: Callable[..., object], settings: Settings
) -> Callable[..., object]:
    """``await client()`` starts the app on the test folders (write plugins first)."""

    async def start(**overrides: object) -> TestClient:
        app = create_app(Settings(**{**settings.__dict__, **overrides}))
        return await aiohttp_client(app)  # type: ignore[no-any-return,operator]

    return start


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """``server(*args)`` starts ``plugserve serve`` as a subprocess and waits until ready."""
    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, ready: bool = True) -> ServerProcess:
        proc = ServerProcess(*args, env=env, log=tmp_path / f"server{len(started)}.log")
        started.append(proc)
        return proc.wait_ready() if ready else proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    """A real etcd on loopback with a fresh data dir."""
    member = EtcdProcess(tmp_path / "etcd").start()
    yield member
    member.stop()
