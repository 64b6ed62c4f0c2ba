"""The memory budget as the process tree measures it, with one worker and several: what a
version takes as it serves counts, and a version larger than the whole budget is refused."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ServerProcess, tree_rss_mib, write_plugin
from tests.server.test_on_demand import infer, record

LAZY = """
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Lazy:
        def __init__(self, mib, eager):
            self.mib = mib
            self.weights = np.ones(mib * 1024 * 1024 // 8) if eager else None

        def infer(self, inputs):
            if self.weights is None:  # allocates on first use
                self.weights = np.ones(self.mib * 1024 * 1024 // 8)
            return {"y": np.asarray(inputs["x"]) * 2}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Lazy(config["mib"], config["eager"])
"""


def write_lazy(plugins_dir: Path, names: list[str], mib: int, eager: bool = False) -> None:
    for name in names:
        write_plugin(
            plugins_dir, "runner", name, "1.0.0",
            f'[config]\nmib = {mib}\neager = {str(eager).lower()}\n'
            '[runner]\nload = "on_demand"\n',
            files={"plugin.py": LAZY},
        )  # fmt: skip


def memory(srv: ServerProcess) -> dict[str, Any]:
    status, _, body = srv.request("GET", "/admin/status")
    assert status == 200, body
    state = json.loads(body)["memory"]
    assert state is not None
    return state


@pytest.mark.workers(1, 2)
def test_memory_taken_as_versions_serve_is_held_to_the_budget(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """Six versions that each measure next to nothing at their load and take 32 MiB on
    their first request, a budget of 80 MiB: the server reads its workers' memory as
    they serve and evicts until the tree is within the budget and one version again, and
    its status counts what the tree holds."""
    names = [f"v{i}" for i in range(6)]
    write_lazy(plugins_dir, names, 32)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--memory-budget", "80MiB")  # fmt: skip
    baseline = tree_rss_mib(srv.proc.pid)
    for name in names:
        status, _, answer = infer(srv, name)
        assert status == 200, answer
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        grown = tree_rss_mib(srv.proc.pid) - baseline
        state = memory(srv)
        if grown <= 80 + 32 and state["resident_bytes"] <= state["budget_bytes"]:
            break
        time.sleep(0.25)
    assert grown <= 80 + 32, (grown, state)
    assert state["resident_bytes"] <= state["budget_bytes"], state
    assert srv.log().count("plugin_evicted") >= 3


@pytest.mark.workers(1, 2)
def test_a_version_larger_than_the_whole_budget_is_refused_naming_it(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """``big`` holds 64 MiB against a budget of 48: not served, its error names
    memory_budget, and the idle ``small`` is not evicted for it."""
    write_lazy(plugins_dir, ["small"], 8, eager=True)
    write_lazy(plugins_dir, ["big"], 64, eager=True)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--memory-budget", "48MiB")  # fmt: skip
    assert infer(srv, "small")[0] == 200
    status, _, answer = infer(srv, "big")
    assert status >= 400, answer
    big = record(srv, "big")
    assert "memory_budget" in (big.get("last_error") or ""), big
    assert srv.log().count("plugin_evicted") == 0
    assert [row["plugin"] for row in memory(srv)["resident"]] == ["runner/small@1.0.0"]
