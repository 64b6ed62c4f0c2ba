"""Errors through composition (graph waves, ``ctx.infer``) on a real server: a step's
refusal is the route's 400, a deadline is 504, a plugin's loop is the server's fault;
and ``ctx.infer`` reaches every route a client can, those that load on their first
request included."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.helpers import ServerProcess, write_add_runner, write_plugin

ON_DEMAND = 'load = "on_demand"'

REFUSE = """
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Refuse:
        async def process(self, data, ctx):
            raise ctx.InvalidInput("takes no such tensor")

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Refuse()
"""

LATE = """
    import time

    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Late:
        async def process(self, data, ctx):
            time.sleep(0.5)  # holds the event loop past the request's deadline
            answer = await ctx.infer("other", {"x": data["x"]})
            return {"y": answer["y"]}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Late()
"""

CALLS = """
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Calls:
        async def format(self, data, ctx):
            answer = await ctx.infer("{route}", {{"x": data["y"]}})
            return {{"y": answer["y"]}}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Calls()
"""

FAN_OUT = """
    import asyncio

    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class FanOut:
        async def format(self, data, ctx):
            async with asyncio.TaskGroup() as calls:
                good = calls.create_task(ctx.infer("rec", {"x": data["y"]}))
                calls.create_task(ctx.infer("rec", {"z": data["y"]}))  # rec refuses it
            return {"y": good.result()["y"]}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return FanOut()
"""

BIG = """
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Big:
        def __init__(self, mib, amount):
            self.weights = np.ones(mib * 1024 * 1024 // 8)  # touched: resident
            self.amount = amount

        def infer(self, inputs):
            return {"y": np.asarray(inputs["x"]) + self.amount}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Big(config["mib"], config["amount"])
"""

SLOW_LOAD = """
    import time

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Add:
        def infer(self, inputs):
            return {"y": np.asarray(inputs["x"]) + self.amount}

    @hookimpl
    def plugserve_create_component(plugin, config):
        time.sleep(config["load_s"])
        add = Add()
        add.amount = config["amount"]
        return add
"""

PAIR_ROUTE = """
[routes.pair]
outputs = ["a", "b"]

[[routes.pair.steps]]
runner = "add"
inputs = {{ x = "x" }}
outputs = {{ y = "a" }}

[[routes.pair.steps]]
processor = "{processor}"
inputs = ["x"]
outputs = {{ y = "b" }}
"""


def infer(srv: ServerProcess, route: str, **parameters: Any) -> tuple[int, Any]:
    body: dict[str, Any] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]
    }
    if parameters:
        body["parameters"] = parameters
    status, _, raw = srv.request("POST", f"/v2/models/{route}/infer", body)
    return status, json.loads(raw)


def grpc_code(srv: ServerProcess, route: str, timeout_us: int | None = None) -> str:
    """The gRPC status code of the same request over gRPC (``OK`` when answered)."""
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    x = grpcclient.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.array([[1, 2, 3, 4]], np.float32))
    try:
        client.infer(route, [x], timeout=timeout_us)
    except InferenceServerException as exc:
        return str(exc.status())
    finally:
        client.close()
    return "OK"


def outputs(answer: dict[str, Any]) -> dict[str, list[float]]:
    return {output["name"]: output["data"] for output in answer["outputs"]}


def write_pair(plugins_dir: Path, processor: str, source: str) -> None:
    """The graph route ``pair``: the runner ``add`` and the processor ``processor`` in one
    wave, both reading the request's ``x``."""
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1.0)
    write_plugin(plugins_dir, "preprocessor", processor, "1.0.0", files={"plugin.py": source})
    (plugins_dir / "routes.toml").write_text(PAIR_ROUTE.format(processor=processor))


def test_a_step_refusing_its_input_beside_another_is_the_routes_400(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """Two steps in one wave, one refusing its input: the client gets that step's 400
    naming its plugin (over gRPC, ``INVALID_ARGUMENT``), and the server logs no fault
    for it."""
    write_pair(plugins_dir, "refuse", REFUSE)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    for _ in range(3):
        status, answer = infer(srv, "pair")
        assert status == 400, answer
        assert answer["plugin"] == "preprocessor/refuse@1.0.0", answer
        assert "takes no such tensor" in answer["error"], answer
    assert grpc_code(srv, "pair") == "StatusCode.INVALID_ARGUMENT"
    log = srv.log()
    assert "Traceback" not in log and "internal_error" not in log, log[-2000:]


def test_a_deadline_passing_in_one_step_of_a_wave_is_504(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """A step that holds the event loop past the request's deadline and then calls a route
    (its runner refuses the late request with the deadline's error) beside another step:
    the request is a 504 (over gRPC, ``DEADLINE_EXCEEDED``), as a deadline is wherever it
    passes."""
    write_pair(plugins_dir, "late", LATE)
    write_add_runner(plugins_dir, "other", "1.0.0", amount=2.0)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    for _ in range(3):
        status, answer = infer(srv, "pair", timeout=200_000)  # 0.2 s
        assert status == 504, answer
        assert "deadline" in answer["error"], answer
    assert grpc_code(srv, "pair", timeout_us=200_000) == "StatusCode.DEADLINE_EXCEEDED"
    status, answer = infer(srv, "pair")
    assert status == 200, answer
    assert outputs(answer) == {"a": [2.0, 3.0, 4.0, 5.0], "b": [3.0, 4.0, 5.0, 6.0]}


def test_a_plugin_calling_its_own_route_is_a_server_fault_not_the_clients(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """A postprocessor whose ``ctx.infer`` calls its own route loops until routes nest too
    deep: a 500 (the plugin's fault), never a 400 (the client's)."""
    write_plugin(plugins_dir, "postprocessor", "again", "1.0.0",
                 files={"plugin.py": CALLS.format(route="loop")})  # fmt: skip
    write_add_runner(plugins_dir, "loop", "1.0.0", route='[route]\npostprocess = ["again"]')
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    status, answer = infer(srv, "loop")
    assert status == 500, answer
    assert "more than 8 deep" in answer["error"], answer


def test_a_route_refusing_a_plugins_concurrent_call_is_the_plugins_400(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """A postprocessor calls rec twice at once (its own ``TaskGroup``), rec refusing one
    call: the request is rec's 400 named for the postprocessor, not a 500."""
    write_plugin(plugins_dir, "postprocessor", "fan-out", "1.0.0",
                 files={"plugin.py": FAN_OUT})  # fmt: skip
    write_add_runner(plugins_dir, "det", "1.0.0", route='[route]\npostprocess = ["fan-out"]')
    write_add_runner(plugins_dir, "rec", "1.0.0")
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    status, answer = infer(srv, "det")
    assert status == 400, answer
    assert answer["plugin"] == "postprocessor/fan-out@1.0.0" and "'z'" in answer["error"], answer


@pytest.mark.workers(1, 2)
def test_ctx_infer_loads_a_route_that_loads_on_its_first_request(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """Under ``--default-load on_demand``, a postprocessor's ``ctx.infer("rec")`` loads rec
    as a client's request to rec would: every request is answered, rec loaded once a
    worker."""
    write_plugin(plugins_dir, "postprocessor", "refine", "1.0.0",
                 files={"plugin.py": CALLS.format(route="rec")})  # fmt: skip
    write_add_runner(plugins_dir, "det", "1.0.0", amount=10.0,
                     route='[route]\npostprocess = ["refine"]')  # fmt: skip
    write_add_runner(plugins_dir, "rec", "1.0.0", amount=100.0)
    srv = server(
        "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
        "--default-load", "on_demand",
    )  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(lambda _: infer(srv, "det"), range(10)))
    for status, answer in answers:
        assert status == 200, answer
        assert outputs(answer) == {"y": [111.0, 112.0, 113.0, 114.0]}
    loads = [line for line in srv.log().splitlines() if "plugin_demanded" in line]
    assert 2 <= len(loads) <= 4, loads  # det and rec, once in each worker that served


def test_ctx_infer_loads_on_demand_within_a_memory_budget(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """Three versions of 64 MiB that load on demand, a budget that holds two: ``a``'s
    postprocessor calls ``b``, whose load evicts the idle ``c`` (never ``a``, in use);
    then ``c``'s request evicts one of them in turn, and ``a`` loads both again."""
    write_plugin(plugins_dir, "postprocessor", "then-b", "1.0.0",
                 files={"plugin.py": CALLS.format(route="b")})  # fmt: skip
    for name, amount in (("a", 1.0), ("b", 10.0), ("c", 100.0)):
        route = '\n[route]\npostprocess = ["then-b"]' if name == "a" else ""
        write_plugin(
            plugins_dir, "runner", name, "1.0.0",
            f"[config]\nmib = 64\namount = {amount}\n[runner]\n{ON_DEMAND}\n{route}",
            files={"plugin.py": BIG},
        )  # fmt: skip
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--memory-budget", "150MiB")  # fmt: skip
    for _ in range(3):
        status, answer = infer(srv, "c")
        assert status == 200, answer
        status, answer = infer(srv, "a")
        assert status == 200, answer
        assert outputs(answer) == {"y": [12.0, 13.0, 14.0, 15.0]}
    assert srv.log().count("plugin_evicted") >= 3


def test_ctx_infer_past_the_deadline_while_its_route_loads_is_504(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """A postprocessor's ``ctx.infer("rec")`` waits for rec, which loads on its first
    request and takes 3 s to: a request with 0.5 s left is the request's 504 (its deadline
    passed), not the route's 503; rec's load goes on, and serves once done. Its own route
    loads on demand too, in 0.2 s, before its answer's time bound starts: the request's
    deadline passes during the wait for rec, before that bound does."""
    write_plugin(plugins_dir, "postprocessor", "refine", "1.0.0",
                 files={"plugin.py": CALLS.format(route="rec")})  # fmt: skip
    for name, amount, load_s in (("det", 10.0, 0.2), ("rec", 100.0, 3.0)):
        route = '\n[route]\npostprocess = ["refine"]' if name == "det" else ""
        write_plugin(
            plugins_dir, "runner", name, "1.0.0",
            f"[config]\namount = {amount}\nload_s = {load_s}\n[runner]\n{ON_DEMAND}\n{route}",
            files={"plugin.py": SLOW_LOAD},
        )  # fmt: skip
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    status, answer = infer(srv, "det", timeout=500_000)  # 0.5 s
    assert status == 504, answer
    assert "deadline" in answer["error"], answer
    status, answer = infer(srv, "det")  # waits for the load under way
    assert status == 200, answer
    assert outputs(answer) == {"y": [111.0, 112.0, 113.0, 114.0]}


def test_a_request_past_its_deadline_while_its_route_loads_is_504(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """A client's request to a route that loads on its first request, in 3 s, with 0.5 s
    to live: its deadline passes during the wait (504), not the route's 503; the load goes
    on, and the next request is served once it is done."""
    write_plugin(plugins_dir, "runner", "rec", "1.0.0",
                 f"[config]\namount = 100.0\nload_s = 3.0\n[runner]\n{ON_DEMAND}\n",
                 files={"plugin.py": SLOW_LOAD})  # fmt: skip
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    status, answer = infer(srv, "rec", timeout=500_000)  # 0.5 s
    assert status == 504, answer
    assert "deadline" in answer["error"], answer
    status, answer = infer(srv, "rec")
    assert status == 200, answer
