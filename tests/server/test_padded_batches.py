"""A real server keeps its ``max_tensor_elements`` on the batches it pads: two small
requests wide on different axes, queued behind a slow one, never merge into a padded
tensor past it, in a worker and in a runner process of its own."""

import concurrent.futures
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ServerProcess, write_plugin

WIDE = 300
BOUND = 1000

PADDING_RUNNER = """
    import time

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Sums:
        def infer(self, inputs):
            x = inputs["x"]
            if x.size == 1:
                time.sleep(1.0)  # the opener: the wide requests queue behind it
            rows = x.shape[0]
            return {"y": x.reshape(rows, -1).sum(1), "held": np.full(rows, x.size, np.int64)}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Sums()
"""


def infer(srv: ServerProcess, shape: list[int], value: float) -> dict[str, Any]:
    count = shape[0] * shape[1] * shape[2]
    body = {"inputs": [{"name": "x", "shape": shape, "datatype": "FP32", "data": [value] * count}]}
    status, _, raw = srv.request("POST", "/v2/models/pad/infer", body)
    assert status == 200, raw
    return {o["name"]: o["data"] for o in json.loads(raw)["outputs"]}


@pytest.mark.parametrize("isolated", [False, True], ids=["in-worker", "isolated"])
def test_requests_wide_on_different_axes_are_answered_in_batches_within_the_bound(
    isolated: bool, tmp_path: Path, plugins_dir: Path, models_dir: Path,
    server: Callable[..., ServerProcess],
) -> None:  # fmt: skip
    runner = 'isolation = "process"\n' if isolated else ""
    manifest = (
        f"[runner]\nmax_batch_size = 8\n{runner}"
        "[runner.batching.inputs]\nx = { ragged = 'pad', ragged_axes = [1, 2] }\n"
    )
    write_plugin(plugins_dir, "runner", "pad", "1.0.0", manifest, {"plugin.py": PADDING_RUNNER})
    config = tmp_path / "plugserve.toml"
    config.write_text(f"max_tensor_elements = {BOUND}\n")
    srv = server("--config", str(config), "--plugins-dir", str(plugins_dir),
                 "--models-dir", str(models_dir))  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        opener = pool.submit(infer, srv, [1, 1, 1], 1.0)
        time.sleep(0.3)
        tall = pool.submit(infer, srv, [1, WIDE, 1], 2.0)
        flat = pool.submit(infer, srv, [1, 1, WIDE], 3.0)
        answers = [f.result(timeout=30) for f in (opener, tall, flat)]
    assert [a["y"] for a in answers] == [[1.0], [2.0 * WIDE], [3.0 * WIDE]]
    assert all(a["held"][0] <= BOUND for a in answers), answers
