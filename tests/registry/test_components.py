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


async def test_a_runner_first_in_its_chain_checks_a_request_once(
    plugins_dir: Path, models_dir: Path, monkeypatch: Any
) -> None:
    """Review of issue 12: a v2 request to a route whose first stage is its runner was
    checked against the runner's declared inputs twice (route, then runner)."""
    from registry import components
    from registry.registry import Registry
    from registry.types import RequestContext

    write_plugin(plugins_dir, "runner", "last", "1.0.0", files={"plugin.py": LAST_COLUMN})
    registry = Registry(plugins_dir, models_dir)
    await registry.start()
    checks: list[str] = []
    real = components.conform

    def counted(*args: Any, **kwargs: Any) -> Any:
        checks.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(components, "conform", counted)
    try:
        chain = registry.routes.resolve("last", None)
        ctx = RequestContext(request_id="r", route="last", parameters={}, headers={},
                             content_type="application/json")  # fmt: skip
        chain.enter()
        try:
            out = await chain.run({"x": np.ones((1, 3), np.float32)}, ctx)
        finally:
            chain.leave()
        assert out["y"].tolist() == [[1.0]]
        assert checks == ["route 'last'"]
        # What a preprocessor hands a runner is checked by the runner, as before.
        assert components.LoadedPlugin.runner_inputs(chain.runner, {"x": np.ones((1, 3))})
        assert checks == ["route 'last'", f"runner {chain.runner.label}"]
    finally:
        await registry.close()


async def test_a_worker_with_a_core_of_its_own_runs_cheap_batches_on_its_loop_but_no_huge_one(
    plugins_dir: Path, client: Callable[..., Any]
) -> None:
    """``inline_runners = "on"``: once the runner's cost per byte is known, batches of any
    rows run on the event loop when they fit the loop's budget (5 ms); a request of one row
    but 4 MB (the attack above, by bytes) still goes to a thread."""
    write_plugin(plugins_dir, "runner", "last", "1.0.0", "[runner]\nmax_batch_size = 8\n",
                 {"plugin.py": LAST_COLUMN})  # fmt: skip
    cli = await client(inline_runners="on")

    async def infer(rows: int, columns: int) -> None:
        raw = np.ones((rows, columns), np.float32).tobytes()
        x = {"name": "x", "datatype": "FP32", "shape": [rows, columns],
             "parameters": {"binary_data_size": len(raw)}}  # fmt: skip
        header = json.dumps({"inputs": [x]}).encode()
        resp = await cli.post("/v2/models/last/infer", data=header + raw,
                              headers={"Inference-Header-Content-Length": str(len(header))})  # fmt: skip
        assert resp.status == 200, await resp.text()

    for _ in range(10):
        await infer(8, 16)
    before = await _inline_executions(cli)
    await infer(8, 16)  # 8 rows: more than a small batch's 4, inside the budget
    assert await _inline_executions(cli) == before + 1
    await infer(1, 1_000_000)
    assert await _inline_executions(cli) == before + 1


async def test_runners_stay_on_their_threads_unless_asked_or_every_core_has_a_worker() -> None:
    from server.config import Settings, usable_cores

    assert not Settings().runners_on_loop  # one worker: as before
    assert Settings(inline_runners="on").runners_on_loop
    assert not Settings(workers=2, inline_runners="off").runners_on_loop
    cores = usable_cores()
    assert Settings(workers=max(2, cores)).runners_on_loop
    if cores > 2:
        assert not Settings(workers=2).runners_on_loop
