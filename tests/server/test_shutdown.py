"""Graceful shutdown of a real server subprocess: drain, then stop, exit 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import ServerProcess, write_plugin

pytestmark = pytest.mark.slow

SLOW = """
    import asyncio
    import numpy as np
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Slow:
        async def infer(self, inputs):
            await asyncio.sleep(float(np.asarray(inputs["delay"]).reshape(-1)[0]))
            return {"done": np.array([1])}

        def close(self):
            print("CLOSED", flush=True)

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Slow()
"""


@pytest.fixture
def slow_server(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess], tmp_path: Path
) -> ServerProcess:
    write_plugin(
        plugins_dir, "runner", "slow", "1.0.0", "[runner]\ninstances = 4\n", {"plugin.py": SLOW}
    )
    config = tmp_path / "plugserve.toml"
    config.write_text("drain_timeout_s = 5\n")
    return server(
        "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir), "--config", str(config)
    )


def test_sigterm_drains_in_flight_requests_then_exits_zero(slow_server: ServerProcess) -> None:
    srv = slow_server
    result: dict[str, tuple[int, dict[str, str], bytes]] = {}
    thread = threading.Thread(
        target=lambda: result.setdefault(
            "slow", srv.request("POST", "/predict/slow", {"delay": [1.5]})
        )
    )
    thread.start()
    time.sleep(0.3)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    status, _, body = srv.request("GET", "/v2/health/ready")
    assert status == 503
    assert "shutting down" in json.loads(body)["error"]
    status, _, body = srv.request("POST", "/predict/slow", {"delay": [0]})
    assert status == 503  # a new request is refused while the old one finishes
    assert srv.request("GET", "/v2/health/live")[0] == 200
    thread.join(10)
    assert result["slow"][0] == 200  # the in-flight request completed
    assert srv.proc.wait(10) == 0
    log = srv.log()
    assert "draining" in log
    assert "CLOSED" in log  # every plugin closed
    assert log.index("draining") < log.index("CLOSED")


def test_a_request_longer_than_the_drain_timeout_does_not_hold_shutdown(
    slow_server: ServerProcess,
) -> None:
    srv = slow_server
    outcome: list[object] = []

    def too_slow() -> None:
        try:
            outcome.append(srv.request("POST", "/predict/slow", {"delay": [30]})[0])
        except OSError as exc:  # cut when the server stops: expected
            outcome.append(exc)

    thread = threading.Thread(target=too_slow, daemon=True)
    thread.start()
    time.sleep(0.3)
    started = time.monotonic()
    srv.proc.send_signal(signal.SIGINT)
    assert srv.proc.wait(20) == 0
    assert time.monotonic() - started < 15
    assert "drain_timeout" in srv.log()
    thread.join(5)
    assert outcome and outcome[0] != 200
