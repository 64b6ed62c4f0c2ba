"""A loaded runner's calls: where its executions run."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers import write_plugin

LAST_COLUMN = """
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class LastColumn:
        def metadata(self):
            return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, -1]}]}

        def infer(self, inputs):
            return {"y": np.ascontiguousarray(inputs["x"][:, -1:])}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return LastColumn()
"""


async def _inline_executions(cli: Any) -> int:
    plugins = (await (await cli.get("/admin/plugins")).json())["plugins"]
    return int(plugins[0]["inline_executions"])


async def test_a_large_request_of_few_rows_never_runs_on_the_event_loop(
    plugins_dir: Path, client: Callable[..., Any]
) -> None:
    """Attack round after issue 12: once small batches proved cheap, any batch of at most 4
    rows ran on the event loop, however large: one row of 15 M floats to a runner sorting its
    row held /v2/health/live for 0.95 s (0.06 s on the runner's thread)."""
    write_plugin(plugins_dir, "runner", "last", "1.0.0", "[runner]\nmax_batch_size = 8\n",
                 {"plugin.py": LAST_COLUMN})  # fmt: skip
    cli = await client()

    async def infer(columns: int) -> None:
        raw = np.ones((1, columns), np.float32).tobytes()
        x = {"name": "x", "datatype": "FP32", "shape": [1, columns],
             "parameters": {"binary_data_size": len(raw)}}  # fmt: skip
        header = json.dumps({"inputs": [x]}).encode()
        resp = await cli.post("/v2/models/last/infer", data=header + raw,
                              headers={"Inference-Header-Content-Length": str(len(header))})  # fmt: skip
        assert resp.status == 200, await resp.text()

    for _ in range(12):
        await infer(4)
    small = await _inline_executions(cli)
    assert small > 0  # cheap small batches do run inline
    await infer(1_000_000)
    assert await _inline_executions(cli) == small
    await infer(4)
    assert await _inline_executions(cli) == small + 1
