"""A memory budget for each GPU: runner processes placed on devices (``device =
"cuda:N"``) are measured on the device they use, and a load short of room on one GPU
evicts only what frees room there.

No GPU here: ``tests/fixtures/fake_nvidia_smi/nvidia-smi`` stands in for NVIDIA's tool,
answering its two queries as the real one does from files the test's runner processes
write while they live (the measure reads our processes' memory on each device, and each
device's size, through those queries)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ServerProcess, write_plugin
from tests.server.test_on_demand import ON_DEMAND, infer, record

FAKE_SMI = Path(__file__).parents[1] / "fixtures" / "fake_nvidia_smi"
ON_A_GPU = """
    import os
    from pathlib import Path

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class OnAGpu:
        def __init__(self, mib):
            # What the fake nvidia-smi reports for this process while it lives.
            index = os.environ["CUDA_VISIBLE_DEVICES"]
            held = Path(os.environ["FAKE_GPU_DIR"]) / str(os.getpid())
            held.write_text(f"{index} {mib}")

        def infer(self, inputs):
            return {"y": np.asarray(inputs["x"]) * 2}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return OnAGpu(config["gpu_mib"])
"""
MIB = 2**20


@pytest.mark.workers(1, 2)
def test_a_gpu_budget_evicts_on_the_device_short_of_room(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any], tmp_path: Path
) -> None:
    """Two fake 16 GiB GPUs, a budget of 80% of each (13,107 MiB): a, b and c take 6000 MiB
    each on cuda:0, d on cuda:1. d is the least recently used, but evicting it frees
    nothing on cuda:0: a goes (after c's measure: a first load has no GPU estimate), then
    b (before a's load again: its measure is known)."""
    devices = {"a": 0, "b": 0, "c": 0, "d": 1}
    for name, index in devices.items():
        write_plugin(
            plugins_dir, "runner", name, "1.0.0",
            f'[config]\ngpu_mib = 6000\n[runner]\n{ON_DEMAND}\nisolation = "process"\n'
            f'device = "cuda:{index}"\n',
            files={"plugin.py": ON_A_GPU},
        )  # fmt: skip
    held = tmp_path / "gpu"
    held.mkdir()
    env = {
        **os.environ,
        "PATH": f"{FAKE_SMI}{os.pathsep}{os.environ['PATH']}",
        "FAKE_GPU_DIR": str(held),
    }
    srv: ServerProcess = server(
        "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
        "--gpu-memory-budget", "80%", env=env,
    )  # fmt: skip

    def states() -> dict[str, str]:
        return {name: record(srv, name)["state"] for name in devices}

    for name in "dab":
        assert infer(srv, name)[0] == 200
    assert infer(srv, "c")[0] == 200  # measured: cuda:0 over, a goes (d frees nothing there)
    assert states() == {"a": "available", "b": "ready", "c": "ready", "d": "ready"}
    assert infer(srv, "a")[0] == 200  # its 6000 MiB known: b, now least recently used, goes
    assert states() == {"a": "ready", "b": "available", "c": "ready", "d": "ready"}
    status, _, body = srv.request("GET", "/admin/status")
    assert status == 200, body
    memory = json.loads(body)["memory"]
    assert memory["gpus"]["cuda:0"]["budget_bytes"] == int(16384 * MIB * 0.8)
    assert memory["gpus"]["cuda:0"]["resident_bytes"] == 12000 * MIB
    assert memory["gpus"]["cuda:1"]["resident_bytes"] == 6000 * MIB
    rows = {row["plugin"]: row for row in memory["resident"]}
    assert rows["runner/d@1.0.0"]["gpu_bytes"] == {"cuda:1": 6000 * MIB}
    assert memory["budget_bytes"] == 0  # no bound on the machine's memory: none evicts for it
    log = srv.log()
    assert "reason=overshoot" in log and "reason=room" in log
