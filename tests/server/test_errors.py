"""Every error status of the contract, as JSON from the one middleware."""

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import write_add_runner, write_plugin, write_streaming_runner

X = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}]}

RAISING = """
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Flaky:
        def __init__(self):
            self.calls = 0
        def process(self, data, ctx):
            self.calls += 1
            if self.calls == 1:
                raise KeyError("secret-detail")
            return data

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Flaky()
"""

SLOW = """
    import asyncio, time
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Slow:
        def __init__(self, delay, blocking):
            self.delay, self.blocking = delay, blocking
        def infer(self, inputs):
            time.sleep(self.delay)
            return {"y": inputs["x"]}

    class AsyncSlow(Slow):
        async def infer(self, inputs):
            await asyncio.sleep(self.delay)
            return {"y": inputs["x"]}

    @hookimpl
    def plugserve_create_component(plugin, config):
        cls = Slow if config.get("blocking") else AsyncSlow
        return cls(config["delay"], config.get("blocking"))
"""


def write_slow(plugins_dir: Path, delay: float, blocking: bool = False, runner: str = "") -> None:
    write_plugin(
        plugins_dir, "runner", "slow", "1.0.0",
        f"[config]\ndelay = {delay}\nblocking = {str(blocking).lower()}\n{runner}",
        {"plugin.py": SLOW},
    )  # fmt: skip


async def test_plugin_that_raises_is_500_naming_it_without_traceback(
    plugins_dir: Path, client
) -> None:  # type: ignore[no-untyped-def]
    write_plugin(plugins_dir, "preprocessor", "flaky", "1.0.0", files={"plugin.py": RAISING})
    write_add_runner(plugins_dir, "add", "1.0.0", route='[route]\npreprocess = ["flaky"]\n')
    cli = await client()
    resp = await cli.post("/v2/models/add/infer", json=X)
    assert resp.status == 500
    doc = await resp.json()
    assert doc["error"] == "plugin preprocessor/flaky@1.0.0 raised KeyError: 'secret-detail'"
    assert doc["plugin"] == "preprocessor/flaky@1.0.0"
    assert "Traceback" not in await resp.text()
    again = await cli.post("/v2/models/add/infer", json=X)
    assert again.status == 200  # the server and the plugin keep serving


async def test_unknown_route_version_and_path_are_404_json(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client()
    for path, message in [
        ("/v2/models/nope/infer", "Request for unknown model: 'nope' is not found"),
        ("/v2/models/add/versions/3.0.0/infer", "no runner version '3.0.0'"),
        ("/predict/nope", "Request for unknown model: 'nope' is not found"),
    ]:
        resp = await cli.post(path, json=X)
        assert resp.status == 404
        assert message in (await resp.json())["error"]
    resp = await cli.get("/no/such/path")
    assert resp.status == 404 and (await resp.json()) == {"error": "Not Found"}
    resp = await cli.get("/v2/models/add/infer")
    assert resp.status == 405 and "POST" in resp.headers["Allow"]
    assert (await resp.json()) == {"error": "Method Not Allowed"}


async def test_body_over_the_limit_is_413(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client(max_body_bytes=1024)
    resp = await cli.post("/v2/models/add/infer", data=b"x" * 2048)
    assert resp.status == 413
    assert "error" in await resp.json()
    assert (await cli.post("/v2/models/add/infer", json=X)).status == 200


async def test_full_runner_queue_is_429_with_retry_after(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_slow(plugins_dir, 1.0, runner="[runner]\nmax_queue_size = 2\n")
    cli = await client()
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}
    # One executes (batching is off) and two wait: the queue is full.
    first = [asyncio.create_task(cli.post("/v2/models/slow/infer", json=body)) for _ in range(3)]
    await asyncio.sleep(0.3)
    resp = await cli.post("/v2/models/slow/infer", json=body)
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "1"
    assert "2 requests queued, its max_queue_size" in (await resp.json())["error"]
    assert [r.status for r in await asyncio.gather(*first)] == [200, 200, 200]


async def test_route_whose_stage_failed_is_503(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_plugin(plugins_dir, "preprocessor", "broken", "1.0.0", files={"plugin.py": "raise SystemError('x')"})  # fmt: skip
    write_add_runner(plugins_dir, "add", "1.0.0", route='[route]\npreprocess = ["broken"]\n')
    cli = await client()
    resp = await cli.post("/v2/models/add/infer", json=X)
    assert resp.status == 503
    error = (await resp.json())["error"]
    assert "preprocessor broken has no ready version (1.0.0 failed:" in error
    assert "SystemError: x" in error
    assert (await cli.get("/v2/models/add/ready")).status == 503


async def test_deadline_passed_is_504_from_parameter_or_header(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_slow(plugins_dir, 0.5)
    cli = await client()
    x = {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}
    resp = await cli.post(
        "/v2/models/slow/infer", json={"inputs": [x], "parameters": {"timeout": 50_000}}
    )
    assert resp.status == 504
    assert "deadline of 0.05 s passed" in (await resp.json())["error"]
    resp = await cli.post("/v2/models/slow/infer", json={"inputs": [x]},
                          headers={"X-Request-Timeout": "0.05"})  # fmt: skip
    assert resp.status == 504
    resp = await cli.post("/v2/models/slow/infer", json={"inputs": [x]},
                          headers={"X-Request-Timeout": "soon"})  # fmt: skip
    assert resp.status == 400
    resp = await cli.post("/v2/models/slow/infer", json={"inputs": [x]},
                          headers={"X-Request-Timeout": "5"})  # fmt: skip
    assert resp.status == 200


async def test_deadline_on_a_blocking_runner_thread_is_504(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_slow(plugins_dir, 0.3, blocking=True)
    cli = await client()
    x = {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}
    resp = await cli.post("/v2/models/slow/infer", json={"inputs": [x]},
                          headers={"X-Request-Timeout": "0.05"})  # fmt: skip
    assert resp.status == 504
    await asyncio.sleep(0.4)
    assert (await cli.post("/v2/models/slow/infer", json={"inputs": [x]})).status == 200


async def test_every_response_carries_a_request_id(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    cli = await client()
    resp = await cli.get("/v2/models/nope", headers={"X-Request-ID": "abc-123"})
    assert resp.headers["X-Request-ID"] == "abc-123"
    resp = await cli.get("/v2/health/live")
    assert len(resp.headers["X-Request-ID"]) == 32


@pytest.mark.parametrize("given", ["a" * 129, "two words", "tab\there", "caf\u00e9", "\udcff"])
async def test_an_odd_client_request_id_is_replaced(plugins_dir: Path, client, given: str) -> None:  # type: ignore[no-untyped-def]
    """Attack round after issue 12: an 8,000-character X-Request-ID was echoed and written to
    every log line of its request; an id must be short printable ASCII, else one is made."""
    cli = await client()
    resp = await cli.get(
        "/v2/health/live",
        headers={"X-Request-ID": given.encode("utf-8", "surrogateescape").decode("latin-1")},
    )
    assert resp.status == 200
    shown = resp.headers["X-Request-ID"]
    assert shown != given and len(shown) == 32


async def test_priority_and_tenant_reach_the_scheduler(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_slow(plugins_dir, 0.0, runner="[runner]\npriority_levels = 2\n")
    cli = await client()
    x = {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}
    ok = await cli.post("/v2/models/slow/infer", json={"inputs": [x], "parameters": {"priority": 1}},
                        headers={"X-Tenant-ID": "acme"})  # fmt: skip
    assert ok.status == 200
    for bad, message in [("high", "non-negative integer"), (3, "outside 1..2")]:
        resp = await cli.post(
            "/v2/models/slow/infer", json={"inputs": [x], "parameters": {"priority": bad}}
        )
        assert resp.status == 400
        assert message in (await resp.json())["error"]


@pytest.mark.parametrize(
    ("inputs", "status", "message"),
    [
        ([{"name": f"x{i}", "datatype": "FP32", "shape": [1], "data": [1]} for i in range(5)], 400,
         "5 inputs; at most 4"),
        ([{"name": "x", "datatype": "FP32", "shape": [1] * 7, "data": [1]}], 400, "rank 7; at most 6"),
        ([{"name": "x", "datatype": "FP32", "shape": [1000, 1000], "data": [1]}], 413,
         "1000000 elements; at most 4096"),
    ],
)  # fmt: skip
async def test_request_limits(
    plugins_dir: Path, client, inputs: list[dict[str, Any]], status: int, message: str
) -> None:  # type: ignore[no-untyped-def]
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client(max_inputs=4, max_tensor_rank=6, max_tensor_elements=4096)
    resp = await cli.post("/v2/models/add/infer", json={"inputs": inputs})
    assert resp.status == status
    assert message in (await resp.json())["error"]


async def test_no_request_makes_the_server_allocate_for_a_shape_it_does_not_carry(
    plugins_dir: Path, client
) -> None:  # type: ignore[no-untyped-def]
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client(max_bytes_elements=1 << 26)  # by default 2^25 BYTES elements get 413
    header = json.dumps({"inputs": [{"name": "s", "datatype": "BYTES", "shape": [1 << 25],
                                     "parameters": {"binary_data_size": 8}}]}).encode()  # fmt: skip
    resp = await cli.post("/v2/models/add/infer", data=header + b"\x00" * 8,
                          headers={"Inference-Header-Content-Length": str(len(header))})  # fmt: skip
    assert resp.status == 400
    assert "cannot hold 33554432 BYTES elements" in (await resp.json())["error"]
    deep = b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    resp = await cli.post("/v2/models/add/infer", data=deep)
    assert resp.status == 400
    assert "not valid JSON" in (await resp.json())["error"]


FLAKY_RUNNER = """
    import numpy as np
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Flaky:
        def infer(self, inputs):
            if float(np.asarray(inputs["x"]).reshape(-1)[0]) < 0:
                raise RuntimeError("broken")
            return {"y": inputs["x"]}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Flaky()
"""


async def test_a_failing_runner_opens_its_circuit_and_recovers(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_plugin(plugins_dir, "runner", "flaky", "1.0.0", "[runner]\nbreaker_failures = 3\nbreaker_reset_s = 1.5\n",
                 {"plugin.py": FLAKY_RUNNER})  # fmt: skip
    cli = await client()

    async def call(x: float) -> int:
        resp = await cli.post("/v2/models/flaky/infer",
                              json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [x]}]})  # fmt: skip
        return resp.status

    assert [await call(-1) for _ in range(3)] == [500, 500, 500]
    resp = await cli.post(
        "/v2/models/flaky/infer",
        json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]},
    )
    assert resp.status == 503
    assert "circuit open" in (await resp.json())["error"]
    row = (await (await cli.get("/admin/plugins")).json())["plugins"][0]
    assert (row["circuit"], row["circuit_trips"]) == ("open", 1)
    metrics = await (await cli.get("/metrics")).text()
    assert 'plugserve_circuit_open{name="flaky",type="runner",version="1.0.0"} 1.0' in metrics
    await asyncio.sleep(1.55)
    assert await call(1) == 200  # the half-open probe succeeds: closed again
    row = (await (await cli.get("/admin/plugins")).json())["plugins"][0]
    assert row["circuit"] == "closed"
    assert (
        'plugserve_circuit_open{name="flaky",type="runner",version="1.0.0"} 0.0'
        in await (await cli.get("/metrics")).text()
    )


async def test_a_route_over_its_rate_limit_answers_429(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_add_runner(
        plugins_dir, "add", "1.0.0", route="[route]\nrate_limit = { rps = 1, burst = 2 }\n"
    )
    write_add_runner(plugins_dir, "free", "1.0.0")
    (plugins_dir / "routes.toml").write_text(
        '[routes.strict]\nrunner = "free"\nrate_limit = { rps = 0.5, burst = 1 }\n'
    )
    cli = await client()
    statuses = [(await cli.post("/v2/models/add/infer", json=X)).status for _ in range(3)]
    assert statuses == [200, 200, 429]
    resp = await cli.post("/v2/models/add/infer", json=X)
    assert resp.headers["Retry-After"] == "1"
    assert "over its rate limit of 1 requests/s" in (await resp.json())["error"]
    assert [(await cli.post("/v2/models/free/infer", json=X)).status for _ in range(5)] == [200] * 5
    assert [(await cli.post("/v2/models/strict/infer", json=X)).status for _ in range(2)] == [
        200,
        429,
    ]
    await asyncio.sleep(1.05)
    assert (await cli.post("/v2/models/add/infer", json=X)).status == 200
    routes = {r["name"]: r for r in (await (await cli.get("/admin/routes")).json())["routes"]}
    assert routes["add"]["rate_limit"] == {"rps": 1.0, "burst": 2}
    assert routes["strict"]["rate_limit"] == {"rps": 0.5, "burst": 1}


async def test_a_streaming_route_called_for_one_answer_over_http_is_400_naming_the_streaming_calls(
    plugins_dir: Path, client
) -> None:  # type: ignore[no-untyped-def]
    """The registry refuses in its own words (``StreamingOnly``); HTTP says which calls stream."""
    write_streaming_runner(plugins_dir, "steps", "steps")
    cli = await client()
    expected = (
        "HTTP end point doesn't support models with decoupled transaction policy: "
        "route 'steps' streams its responses; call .../generate_stream, "
        ".../generate or gRPC ModelStreamInfer (or /v1 for an OpenAI route)"
    )
    n = {"inputs": [{"name": "n", "datatype": "INT64", "shape": [1], "data": [2]}]}
    for path, body in [("/v2/models/steps/infer", n), ("/predict/steps", {"n": [2]})]:
        resp = await cli.post(path, json=body)
        assert resp.status == 400
        assert await resp.json() == {"error": expected}
