"""Loaded plugins by kind: where a runner's executions and a processor's calls run, what a
streaming runner refuses."""

import asyncio
import contextlib
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
    from plugserve.registry.execution.components import runner as components
    from plugserve.registry.lifecycle.registry import Registry
    from plugserve.registry.types import RequestContext

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
        assert components.Runner.runner_inputs(chain.runner, {"x": np.ones((1, 3))})
        assert checks == ["route 'last'", f"runner {chain.runner.label}"]
    finally:
        await registry.close()


SLEEPY = """
    import time

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Sleepy:
        def metadata(self):
            return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, -1]}]}

        def infer(self, inputs):
            time.sleep(float(inputs["x"].max()) / 1000)  # the largest value: milliseconds
            return {"y": np.ascontiguousarray(inputs["x"][:, -1:])}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Sleepy()
"""


async def _post(cli: Any, route: str, array: np.ndarray) -> None:
    raw = array.tobytes()
    x = {"name": "x", "datatype": "FP32", "shape": list(array.shape),
         "parameters": {"binary_data_size": len(raw)}}  # fmt: skip
    header = json.dumps({"inputs": [x]}).encode()
    resp = await cli.post(f"/v2/models/{route}/infer", data=header + raw,
                          headers={"Inference-Header-Content-Length": str(len(header))})  # fmt: skip
    assert resp.status == 200, await resp.text()


async def test_requests_that_come_together_batch_after_lone_ones_ran_on_the_loop(
    plugins_dir: Path, client: Callable[..., Any]
) -> None:
    """One process, the runner on its thread: lone requests, cheap and small, come to run
    on the event loop at once. A burst that follows must still batch: run at once each, on
    the loop where no batch forms while one runs, they stayed batches of one row, a third
    of the throughput (tests/benchmarks/serving.py after its c=1 runs)."""
    write_plugin(plugins_dir, "runner", "last", "1.0.0", "[runner]\nmax_batch_size = 64\n",
                 {"plugin.py": LAST_COLUMN})  # fmt: skip
    cli = await client()
    for _ in range(12):
        await _post(cli, "last", np.ones((1, 4), np.float32))
    assert await _inline_executions(cli) > 0  # lone requests run on the loop now

    async def executions() -> int:
        plugins = (await (await cli.get("/admin/plugins")).json())["plugins"]
        return int(plugins[0]["executions"])

    before = await executions()
    await asyncio.gather(*(_post(cli, "last", np.ones((1, 4), np.float32)) for _ in range(32)))
    assert await executions() - before < 16  # batches of more than two rows on average


async def test_a_worker_with_a_core_of_its_own_runs_cheap_batches_on_its_loop_but_no_huge_one(
    plugins_dir: Path, client: Callable[..., Any]
) -> None:
    """``inline_runners = "on"``: once the runner's last eight executions were cheap, a batch
    of more rows than a small batch's 4 runs on the event loop; one more than twice the
    bytes of the largest of them (one row of 4 MB: the attack above) still goes to a
    thread, however cheap its rows were."""
    write_plugin(plugins_dir, "runner", "last", "1.0.0", "[runner]\nmax_batch_size = 8\n",
                 {"plugin.py": LAST_COLUMN})  # fmt: skip
    cli = await client(inline_runners="on")
    for _ in range(10):
        await _post(cli, "last", np.ones((8, 16), np.float32))
    before = await _inline_executions(cli)
    await _post(cli, "last", np.ones((8, 16), np.float32))
    assert await _inline_executions(cli) == before + 1
    await _post(cli, "last", np.ones((1, 1_000_000), np.float32))
    assert await _inline_executions(cli) == before + 1


async def test_one_slow_execution_sends_the_next_batches_to_a_thread(
    plugins_dir: Path, client: Callable[..., Any]
) -> None:
    """A cost that depends on the content: after one execution over the loop's 10 ms budget,
    the next eight run on a thread, however small; one over a quarter of it (a thread
    descheduled mid-batch, as often) does not."""
    write_plugin(plugins_dir, "runner", "sleepy", "1.0.0", "[runner]\nmax_batch_size = 8\n",
                 {"plugin.py": SLEEPY})  # fmt: skip
    cli = await client(inline_runners="on")
    fast = np.zeros((8, 4), np.float32)
    for _ in range(9):
        await _post(cli, "sleepy", fast)

    async def running_inline() -> int:
        """Fast batches until one runs inline: a loaded machine may deschedule a thread
        mid-batch, and more than two spikes among the last eight keep the next off."""
        for _ in range(40):
            before = await _inline_executions(cli)
            await _post(cli, "sleepy", fast)
            if await _inline_executions(cli) > before:
                return before + 1
        raise AssertionError("no fast batch ran inline in 40")

    for _ in range(3):  # a loaded machine may stretch the 4 ms sleep past the 10 ms budget
        before = await running_inline()
        await _post(cli, "sleepy", np.full((8, 4), 4.0, np.float32))  # 4 ms: a spike, let pass
        await _post(cli, "sleepy", fast)
        if await _inline_executions(cli) == before + 2:
            break
    else:
        raise AssertionError("after a 4 ms spike, the next fast batch ran on a thread 3 times")
    await _post(cli, "sleepy", np.full((8, 4), 12.0, np.float32))  # 12 ms: on the loop, once
    ran = await _inline_executions(cli)
    for _ in range(7):
        await _post(cli, "sleepy", fast)
    assert await _inline_executions(cli) == ran  # the slow one is among the last eight


async def test_a_runner_with_instances_or_a_zero_inline_budget_keeps_its_threads(
    plugins_dir: Path, client: Callable[..., Any]
) -> None:
    write_plugin(plugins_dir, "runner", "last", "1.0.0",
                 "[runner]\nmax_batch_size = 8\ninline_budget_us = 0\n",
                 {"plugin.py": LAST_COLUMN})  # fmt: skip
    write_plugin(plugins_dir, "runner", "pair", "1.0.0",
                 "[runner]\nmax_batch_size = 8\ninstances = 2\n",
                 {"plugin.py": LAST_COLUMN})  # fmt: skip
    cli = await client(inline_runners="on")
    for _ in range(12):
        await _post(cli, "last", np.ones((8, 16), np.float32))
        await _post(cli, "pair", np.ones((8, 16), np.float32))
    plugins = (await (await cli.get("/admin/plugins")).json())["plugins"]
    assert {p["name"]: p["inline_executions"] for p in plugins} == {"last": 0, "pair": 0}


NAPPING_PROCESSOR = """
    import threading
    import time

    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Nap:
        def process(self, data, ctx):
            ctx.state["thread"] = threading.current_thread().name
            time.sleep(data.get("nap", 0))
            return data

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Nap()
"""


async def test_a_cancelled_processor_call_on_its_thread_is_waited_for(
    plugins_dir: Path, models_dir: Path
) -> None:
    """Issue 29 finding 1: a synchronous processor runs on its own thread; a request cancelled
    meanwhile (its client hung up) stops waiting, but the call stays counted until the thread
    returns, so an unload waits for it, as for a runner's call."""
    import asyncio

    from plugserve.registry.lifecycle.registry import Registry
    from plugserve.registry.types import RequestContext
    from tests.helpers import write_add_runner

    write_plugin(
        plugins_dir, "preprocessor", "nap", "1.0.0", files={"plugin.py": NAPPING_PROCESSOR}
    )
    write_add_runner(plugins_dir, "add", "1.0.0", route='[route]\npreprocess = ["nap"]\n')
    registry = Registry(plugins_dir, models_dir)
    await registry.start()
    try:
        chain = registry.routes.resolve("add", None)
        nap = chain.preprocess[0]
        ctx = RequestContext(request_id="r", route="add", parameters={}, headers={},
                             content_type="application/json", body_bytes=20)  # fmt: skip
        chain.enter()
        try:
            task = asyncio.ensure_future(chain.run({"nap": 1.0}, ctx))
            for _ in range(200):
                if "thread" in ctx.state:
                    break
                await asyncio.sleep(0.01)
            assert ctx.state["thread"].startswith(nap.label)  # its own thread, not the loop's
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            chain.leave()
        assert nap.executing == 1
        assert not await nap.wait_idle(0.05)
        assert await nap.wait_idle(10)
        assert nap.executing == 0
    finally:
        await registry.close()


async def test_a_streaming_runner_called_for_one_answer_refuses_in_no_protocol_s_words(
    plugins_dir: Path, models_dir: Path
) -> None:
    """The core names the route, not the front ends' calls that stream: each words it."""
    import pytest

    from plugserve.registry.errors import InvalidInput, StreamingOnly
    from plugserve.registry.lifecycle.registry import Registry
    from plugserve.registry.types import RequestContext
    from tests.helpers import write_streaming_runner

    write_streaming_runner(plugins_dir, "steps", "steps")
    registry = Registry(plugins_dir, models_dir)
    await registry.start()
    try:
        chain = registry.routes.resolve("steps", None)
        ctx = RequestContext(request_id="r", route="steps", parameters={}, headers={},
                             content_type="application/json")  # fmt: skip
        chain.enter()
        try:
            with pytest.raises(StreamingOnly) as refused:
                await chain.run({"n": np.array([2], np.int64)}, ctx)
        finally:
            chain.leave()
        assert isinstance(refused.value, InvalidInput) and refused.value.status == 400
        assert refused.value.route == "steps"
        message = refused.value.message
        assert "'steps'" in message
        for word in ("HTTP", "gRPC", "generate", "/v1", "ModelStreamInfer", "decoupled"):
            assert word not in message
    finally:
        await registry.close()


MEAN_RUNNER = """
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Mean:
        def infer(self, inputs):
            image = inputs["image"]
            return {"y": image.reshape(image.shape[0], -1).mean(axis=1, keepdims=True)}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Mean()
"""

PASS_ON = """
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class PassOn:
        def process(self, data, ctx):
            return data

    @hookimpl
    def plugserve_create_component(plugin, config):
        return PassOn()
"""


async def _inline_of(cli: Any, name: str) -> int:
    plugins = (await (await cli.get("/admin/plugins")).json())["plugins"]
    return int(next(p["inline_executions"] for p in plugins if p["name"] == name))


def _gif(screen: int) -> bytes:
    """35 bytes: one 1x1 frame on a ``screen`` x ``screen`` logical screen (decoded whole)."""
    import struct

    head = b"GIF89a" + struct.pack("<HHBBB", screen, screen, 0, 0, 0)
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0x80) + b"\x00\x00\x00\xff\xff\xff"
    return head + frame + b"\x02\x02\x44\x01\x00\x3b"


async def test_only_a_processor_declaring_its_cost_by_size_runs_on_the_event_loop(
    plugins_dir: Path, client: Callable[..., Any]
) -> None:
    """``image_decode`` (no ``[processor] cost``: a few bytes can decode to megapixels)
    runs every call on its thread, however cheap its last ones; the processor after it
    (``cost = "size"``) runs cheap calls inline, but not one handed a 2.25 MP image decoded
    from a 35-byte GIF: a call's size counts the tensors it is handed."""
    from tests.plugins.bundled import folder

    source = (folder("preprocessor", "image_decode") / "plugin.py").read_text()
    write_plugin(plugins_dir, "preprocessor", "image_decode", "1.0.0",
                 '[config]\nsize = []\nmode = "L"\n', {"plugin.py": source})  # fmt: skip
    write_plugin(plugins_dir, "preprocessor", "after", "1.0.0",
                 '[processor]\ncost = "size"\n', {"plugin.py": PASS_ON})  # fmt: skip
    write_plugin(plugins_dir, "runner", "see", "1.0.0",
                 '[route]\npreprocess = ["image_decode", "after"]\n',
                 {"plugin.py": MEAN_RUNNER})  # fmt: skip
    cli = await client()
    import io

    from PIL import Image

    small = io.BytesIO()
    Image.new("L", (4, 4), 255).save(small, "PNG")

    async def predict(body: bytes) -> None:
        resp = await cli.post("/predict/see", data=body, headers={"Content-Type": "image/png"})
        assert resp.status == 200, await resp.text()

    for sent in range(48):  # a call descheduled past the budget keeps the next eight off
        await predict(small.getvalue())
        if sent >= 11 and await _inline_of(cli, "after"):
            break
    cheap = await _inline_of(cli, "after")
    assert cheap > 0
    assert await _inline_of(cli, "image_decode") == 0
    await predict(_gif(1500))
    assert await _inline_of(cli, "after") == cheap
    assert await _inline_of(cli, "image_decode") == 0


def test_a_call_s_size_is_its_request_s_bytes_and_what_it_is_handed() -> None:
    from plugserve.registry.execution.components.inline import CALL_MAX_ELEMENTS, call_bytes

    image = np.zeros((1, 3, 224, 224), np.float32)
    assert call_bytes({"image": image, "k": 3}, 35) == 35 + image.nbytes
    assert call_bytes(b"abcd", 4) == 8
    texts = np.array(["ab", "cde"], dtype=object)
    assert call_bytes({"text": texts}, 10) == 10 + 5 + texts.nbytes
    assert call_bytes({"text": np.array(["a"] * (CALL_MAX_ELEMENTS + 1), dtype=object)}, 1) is None
    assert call_bytes({"x": image}, None) is None
