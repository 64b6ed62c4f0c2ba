from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from plugserve.server.app import create_app
from plugserve.server.config import Settings
from plugserve.server.runtime.logs import configure_logging
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
        app = create_app(Settings(**{**settings.model_dump(), **overrides}))
        return await aiohttp_client(app)  # type: ignore[no-any-return,operator]

    return start


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``@pytest.mark.workers(1, 2)``: run each test that starts servers once per worker count.

    A count may be a ``pytest.param`` with marks (``tests.helpers.workers_failing``).
    """
    marker = metafunc.definition.get_closest_marker("workers")
    if marker is None or "server" not in metafunc.fixturenames:
        return
    params = []
    for arg in marker.args:
        count, marks = (arg, ()) if isinstance(arg, int) else (arg.values[0], arg.marks)
        params.append(pytest.param(count, marks=marks, id=f"workers{count}"))
    metafunc.parametrize("workers", params)


@pytest.fixture
def workers() -> int:
    """How many worker processes ``server`` starts (``--workers``); the marker varies it."""
    return 1


@pytest.fixture
def server(tmp_path: Path, workers: int) -> Iterator[Callable[..., ServerProcess]]:
    """``server(*args)`` starts ``plugserve serve`` as a subprocess and waits until ready.

    With ``workers`` above 1 the server runs that many worker processes (``--workers``).
    """
    started: list[ServerProcess] = []
    many = ("--workers", str(workers)) if workers > 1 else ()

    def start(*args: str, env: dict[str, str] | None = None, ready: bool = True) -> ServerProcess:
        log = tmp_path / f"server{len(started)}.log"
        proc = ServerProcess(*many, *args, env=env, log=log)
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


SUBPROCESS_MARKS = ("ServerProcess(", "subprocess.", "EtcdProcess(", "start_server(")
"""What a test module that starts processes of its own holds."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test that starts a process: one that uses the ``server`` or
    ``etcd`` fixture, or whose module starts processes itself. ``pytest -m "not slow"``
    is then the fast loop (CONTRIBUTING.md): units and in-process apps only."""
    started: dict[Path, bool] = {}
    for item in items:
        path = Path(str(item.fspath))
        if path not in started:
            text = path.read_text(encoding="utf-8") if path.suffix == ".py" else ""
            started[path] = any(mark in text for mark in SUBPROCESS_MARKS)
        uses = getattr(item, "fixturenames", ())
        if started[path] or "server" in uses or "etcd" in uses:
            item.add_marker(pytest.mark.slow)
