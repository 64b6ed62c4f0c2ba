"""Client input never yields a 5xx: bad input is a 400 that names what is wrong, from the
server's own checks or from a plugin's ``InvalidInput``, and never trips a circuit breaker."""

import asyncio
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto

from plugserve.registry.tensors.datatypes import V2_TO_NUMPY
from tests.helpers import (
    ONNX_TYPES,
    ROOT,
    ServerProcess,
    identity_model,
    write_add_runner,
    write_plugin,
)

X = {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}


def v2(*inputs: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"inputs": list(inputs), **fields}


async def error_of(resp: Any) -> str:
    doc = await resp.json()
    return str(doc["error"])


# -- datatypes: the request's must be the input's, unless the runner casts (finding 16) -----


async def test_a_datatype_other_than_the_inputs_is_400_naming_both(
    plugins_dir: Path, client
) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 16: INT64 or FP64 data to an FP32 input was accepted and cast."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client()
    for datatype in ("FP64", "INT64", "FP16"):
        resp = await cli.post("/v2/models/add/infer", json=v2({**X, "datatype": datatype}))
        assert resp.status == 400
        assert await error_of(resp) == f"input 'x' is FP32; the request sent {datatype}"
    raw = struct.pack("<4d", 0, 1, 2, 3)
    header = json.dumps(v2({**X, "datatype": "FP64", "data": None,
                            "parameters": {"binary_data_size": len(raw)}})).encode()  # fmt: skip
    resp = await cli.post("/v2/models/add/infer", data=header + raw,
                          headers={"Inference-Header-Content-Length": str(len(header))})  # fmt: skip
    assert resp.status == 400
    assert await error_of(resp) == "input 'x' is FP32; the request sent FP64"
    assert (await cli.post("/v2/models/add/infer", json=v2(X))).status == 200


async def test_cast_inputs_casts_but_never_loses_a_value(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 16: ``[runner] cast_inputs = true`` opts in; a lossy cast is still 400."""
    write_add_runner(plugins_dir, "add", "1.0.0", runner="cast_inputs = true")
    cli = await client()
    for datatype in ("FP64", "INT64", "INT8"):
        resp = await cli.post("/v2/models/add/infer", json=v2({**X, "datatype": datatype}))
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["outputs"][0]["data"] == [1, 2, 3, 4]
    resp = await cli.post(
        "/v2/models/add/infer", json=v2({**X, "datatype": "FP64", "data": [1e300, 0, 0, 0]})
    )
    assert resp.status == 400
    assert "1e+300 (element 0) does not fit FP32: outside its range" in await error_of(resp)
    resp = await cli.post("/v2/models/add/infer", json=v2({**X, "datatype": "BYTES",
                                                            "data": ["a"] * 4}))  # fmt: skip
    assert resp.status == 400 and "BYTES cannot be converted to FP32" in await error_of(resp)


async def test_a_plain_json_body_to_a_runner_is_converted_exactly(
    plugins_dir: Path, client
) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 16, /predict: JSON numbers reach the runner's dtype without a loss."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client()
    assert (await cli.post("/predict/add", json={"x": [[0, 1, 2, 3]]})).status == 200
    resp = await cli.post("/predict/add", json={"x": [[1e300, 1, 2, 3]]})
    assert resp.status == 400 and "does not fit FP32: outside its range" in await error_of(resp)
    resp = await cli.post("/predict/add", json={"x": [[True, 1, 2, 3]]})
    assert resp.status == 400 and "booleans among numbers" in await error_of(resp)


# -- the first stage's declared inputs (finding 15) -----------------------------------------

PICKY = """
    import numpy as np
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Picky:
        def process(self, data, ctx):
            return {"x": data["features"] * 1}      # a KeyError without the server's check

        def metadata(self):
            return {"inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}]}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Picky()
"""


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        ({**X, "name": "q"}, "unknown input(s) ['q']; route 'add' takes ['features']"),
        ({**X, "name": "features", "datatype": "FP64"},
         "input 'features' is FP32; the request sent FP64"),
        ({**X, "name": "features", "shape": [4]},
         "input 'features' has shape [4], route 'add' takes [-1, 4] (-1: any)"),
        ({**X, "name": "features", "shape": [2, 2]},
         "input 'features' has shape [2, 2], route 'add' takes [-1, 4] (-1: any)"),
    ],
)  # fmt: skip
async def test_inputs_are_checked_against_the_first_stages_metadata(
    plugins_dir: Path, client, tensor: dict[str, Any], message: str
) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 15: on a route whose first stage is a preprocessor, an unknown input
    name was a 500 (KeyError in the plugin) where a runner-only route answered 400."""
    write_plugin(plugins_dir, "preprocessor", "picky", "1.0.0", files={"plugin.py": PICKY})
    write_add_runner(plugins_dir, "add", "1.0.0", route='[route]\npreprocess = ["picky"]\n')
    cli = await client()
    resp = await cli.post("/v2/models/add/infer", json=v2(tensor))
    assert resp.status == 400
    assert await error_of(resp) == message
    good = await cli.post("/v2/models/add/infer", json=v2({**X, "name": "features"}))
    assert good.status == 200, await good.text()


# -- the bundled plugins (finding 15) --------------------------------------------------------


@pytest.fixture
async def iris(client):  # type: ignore[no-untyped-def]
    return await client(plugins_dir=ROOT / "plugins", models_dir=ROOT / "models")


@pytest.mark.parametrize(
    ("body", "headers", "message"),
    [
        (b'{"input": [[5.1, 3.5, 1.4, 0.2]]}', {"Content-Type": "application/x-www-form-urlencoded"},
         "preprocessor/scale@1.0.0: expects a JSON body: send Content-Type: application/json"),
        (b'{"input": [[5.1, 3.5, 1.4]]}', {"Content-Type": "application/json"},
         "expects rows of 4 features, shape [rows, 4]; got [1, 3]"),
        (b'{"input": 5.1}', {"Content-Type": "application/json"},
         "expects rows of 4 features, shape [rows, 4]; got []"),
        (b'{"features": [[5.1, 3.5, 1.4, 0.2]]}', {"Content-Type": "application/json"},
         "missing input 'input'; got ['features']"),
        (b'{"input": [["a", "b", "c", "d"]]}', {"Content-Type": "application/json"},
         "expects rows of numbers"),
        (b'{"input": [[1e300, 1, 1, 1]]}', {"Content-Type": "application/json"},
         "features must be finite numbers within FP32's range"),
    ],
)  # fmt: skip
async def test_the_bundled_scale_preprocessor_answers_400_for_client_mistakes(
    iris, body: bytes, headers: dict[str, str], message: str
) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 15: ``curl -d`` (form-urlencoded) to /predict/iris, a wrong feature
    count, a rank-0 or a missing input blamed the bundled preprocessor with a 500."""
    resp = await iris.post("/predict/iris", data=body, headers=headers)
    assert resp.status == 400
    doc = await resp.json()
    assert message in doc["error"] and doc["plugin"] == "preprocessor/scale@1.0.0"
    good = await iris.post("/predict/iris", json={"input": [[5.1, 3.5, 1.4, 0.2]]})
    assert (await good.json())["label"] == ["setosa"]


async def test_the_bundled_iris_route_checks_v2_inputs(iris) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 15 on the bundled route: an unknown input name is a 400."""
    resp = await iris.post("/v2/models/iris/infer", json=v2({**X, "name": "features"}))
    assert resp.status == 400
    assert await error_of(resp) == "unknown input(s) ['features']; route 'iris' takes ['input']"
    meta = await (await iris.get("/v2/models/iris")).json()
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]


# -- non-UTF-8 BYTES to an ONNX string input (finding 14) ------------------------------------


async def test_non_utf8_bytes_to_an_onnx_string_input_is_400_alone(
    plugins_dir: Path, client
) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 14: a 500 counted by the breaker (five: 503 for everyone for 10 s),
    and good requests batched with the bad one failed too."""
    folder = write_plugin(
        plugins_dir, "runner", "text", "1.0.0",
        '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\nmax_batch_size = 16\n'
        "max_queue_delay_ms = 50\nbreaker_failures = 2\n",
        module=None,
    )  # fmt: skip
    identity_model(folder / "model.onnx", {"s": TensorProto.STRING})
    cli = await client()

    def request(element: bytes) -> tuple[bytes, dict[str, str]]:
        raw = b"".join(struct.pack("<I", len(e)) + e for e in (element, b"ok"))
        header = json.dumps(v2({"name": "in_s", "datatype": "BYTES", "shape": [1, 2],
                                "parameters": {"binary_data_size": len(raw)}})).encode()  # fmt: skip
        return header + raw, {"Inference-Header-Content-Length": str(len(header))}

    async def post(element: bytes) -> tuple[int, dict[str, Any]]:
        body, headers = request(element)
        resp = await cli.post("/v2/models/text/infer", data=body, headers=headers)
        return resp.status, await resp.json()

    for _ in range(5):
        status, doc = await post(b"\xff\xfe")
        assert status == 400
        assert doc["error"] == (
            "runner/text@1.0.0: input 'in_s' element 0 is not UTF-8 text, "
            "which ONNX string tensors need"
        )
    assert (await post(b"fine"))[0] == 200  # the breaker is untouched
    # Bad and good requests together: the good ones are answered, the bad ones alone fail.
    results = await asyncio.gather(*(post(b"\xff" if i % 4 == 1 else b"good") for i in range(12)))
    assert [s for s, _ in results] == [400 if i % 4 == 1 else 200 for i in range(12)]
    assert results[0][1]["outputs"][0]["data"] == ["good", "ok"]
    row = (await (await cli.get("/admin/plugins")).json())["plugins"][0]
    assert row["circuit"] == "closed" and row["circuit_trips"] == 0


# -- plugins say "bad input" with InvalidInput (the class) -----------------------------------

REFUSING = """
    import asyncio
    import numpy as np
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Pre:
        def process(self, data, ctx):
            if ctx.parameters.get("refuse") == "pre":
                raise ctx.InvalidInput("expected 4 features, got 3")
            return data

    class Post:
        def format(self, data, ctx):
            if ctx.parameters.get("refuse") == "post":
                raise ctx.InvalidInput("cannot format that")
            return data

    class Runner:
        def __init__(self, plugin):
            self.plugin = plugin
            self.batches = []

        def validate(self, inputs):
            if (inputs["x"] == 7).any():
                raise self.plugin.InvalidInput("7 is not allowed")

        async def infer(self, inputs):
            await asyncio.sleep(0.3 if (inputs["x"] == 0).all() else 0.02)  # 0: hold the runner
            self.batches.append(len(inputs["x"]))
            if (inputs["x"] < 0).any():
                raise self.plugin.InvalidInput("negative values")
            return {"y": inputs["x"] * 2, "batch": np.full(len(inputs["x"]), len(self.batches))}

        def metadata(self):
            return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}]}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return {"preprocessor": Pre, "postprocessor": Post}.get(plugin.type, Runner)(
            *([plugin] if plugin.type == "runner" else [])
        )
"""


def write_refusing_chain(plugins_dir: Path) -> None:
    files = {"plugin.py": REFUSING}
    write_plugin(plugins_dir, "preprocessor", "pre", "1.0.0", files=files)
    write_plugin(plugins_dir, "postprocessor", "post", "1.0.0", files=files)
    write_plugin(
        plugins_dir, "runner", "refuse", "1.0.0",
        "[runner]\nmax_batch_size = 8\nmax_queue_delay_ms = 20\nbreaker_failures = 2\n"
        '[route]\npreprocess = ["pre"]\npostprocess = ["post"]\n',
        files,
    )  # fmt: skip


def xs(value: float, **parameters: Any) -> dict[str, Any]:
    return v2({"name": "x", "datatype": "FP32", "shape": [1], "data": [value]},
              parameters=parameters)  # fmt: skip


async def test_plugins_refuse_bad_input_with_a_400_naming_them(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    """The documented way for plugins to say "bad input": ``ctx.InvalidInput`` in processors,
    ``plugin.InvalidInput`` in runners (and their ``validate()``); never counted by the breaker."""
    write_refusing_chain(plugins_dir)
    cli = await client()
    cases = [
        (xs(1, refuse="pre"), "preprocessor/pre@1.0.0: expected 4 features, got 3"),
        (xs(1, refuse="post"), "postprocessor/post@1.0.0: cannot format that"),
        (xs(-1), "runner/refuse@1.0.0: negative values"),
        (xs(7), "runner/refuse@1.0.0: 7 is not allowed"),
    ]
    for _ in range(3):  # more than breaker_failures
        for body, message in cases:
            resp = await cli.post("/v2/models/refuse/infer", json=body)
            assert resp.status == 400
            doc = await resp.json()
            assert doc["error"] == message and doc["plugin"] == message.split(":")[0]
    resp = await cli.post("/v2/models/refuse/infer", json=xs(1))
    assert resp.status == 200 and (await resp.json())["outputs"][0]["data"] == [2]
    row = next(
        p for p in (await (await cli.get("/admin/plugins")).json())["plugins"]
        if p["type"] == "runner"
    )  # fmt: skip
    assert row["circuit"] == "closed" and row["circuit_trips"] == 0


async def test_a_batch_refused_as_bad_input_is_run_again_one_by_one(
    plugins_dir: Path, client
) -> None:  # type: ignore[no-untyped-def]
    """A runner that refuses a whole batch: the bad request gets 400, its batch-mates 200."""
    write_refusing_chain(plugins_dir)
    cli = await client()

    async def post(value: float) -> tuple[int, Any]:
        resp = await cli.post("/v2/models/refuse/infer", json=xs(value))
        return resp.status, await resp.json()

    first = asyncio.create_task(post(0))  # holds the runner; the next four queue and batch
    await asyncio.sleep(0.05)
    rest = await asyncio.gather(post(1), post(-1), post(2), post(3))
    assert (await first)[0] == 200
    assert [s for s, _ in rest] == [200, 400, 200, 200]
    assert [d["outputs"][0]["data"] for s, d in rest if s == 200] == [[2], [4], [6]]
    runner = next(
        p for p in (await (await cli.get("/admin/plugins")).json())["plugins"]
        if p["type"] == "runner"
    )  # fmt: skip
    # one alone, the batch of four refused, then each of the four alone
    assert (runner["executions"], runner["batched_rows"]) == (6, 9)


# -- request parameters and headers (finding 15) ---------------------------------------------


async def test_odd_priority_and_timeout_values_are_never_a_500(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 15: ``priority`` = "²" was a 500 (str.isdigit accepts it)."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client()
    body = {"x": [[0, 1, 2, 3]]}
    for priority in ("²", "٣", "1" * 5000, "-1", "1.5"):
        resp = await cli.post("/predict/add", params={"priority": priority}, json=body)
        assert resp.status == 400, priority
        assert "priority" in await error_of(resp)
    assert (await cli.post("/predict/add", params={"priority": "1"}, json=body)).status == 200
    for timeout in (2**70, 1e308):  # huge budgets: no overflow, no 500
        resp = await cli.post("/v2/models/add/infer", json=v2(X, parameters={"timeout": timeout}))
        assert resp.status == 200, await resp.text()
    resp = await cli.post("/v2/models/add/infer", json=v2(X),
                          headers={"X-Request-Timeout": "1e999"})  # fmt: skip
    assert resp.status == 200


async def test_a_sticky_header_that_is_not_utf8_is_served(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 15: a 0xff byte in a sticky-route header was a 500 with a traceback."""
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    write_add_runner(plugins_dir, "add", "2.0.0", amount=2)
    (plugins_dir / "routes.toml").write_text(
        '[routes.add]\nrunner = { "add@1.0.0" = 50, "add@2.0.0" = 50 }\nsticky = "x-user-id"\n'
    )
    cli = await client()
    body = json.dumps(v2(X)).encode()

    async def raw_post(user: bytes) -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(cli.server.host, cli.server.port)
        writer.write(
            b"POST /v2/models/add/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"X-User-ID: " + user + b"\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        response = await reader.read()
        writer.close()
        status = int(response.split(b" ", 2)[1])
        variant = next(
            (line for line in response.split(b"\r\n") if line.startswith(b"X-Plugserve-Variant")),
            b"",
        )
        return status, variant

    served = {await raw_post(b"user-\xff\xfe") for _ in range(5)}
    assert len(served) == 1 and next(iter(served))[0] == 200  # served, and sticky


def documented_example() -> str:
    text = (ROOT / "docs" / "plugins.md").read_text()
    section = text[text.index("### Bad input") :]
    return section[section.index("```python\n") + 10 : section.index("```\n", 10)]


async def test_the_documented_bad_input_example_works(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    """The example of docs/plugins.md ("Bad input") runs as written."""
    files = {"plugin.py": documented_example()}
    write_plugin(plugins_dir, "preprocessor", "features", "1.0.0", files=files)
    write_plugin(plugins_dir, "runner", "doubler", "1.0.0",
                 '[route]\npreprocess = ["features"]\n', files)  # fmt: skip
    cli = await client()
    ok = await cli.post("/predict/doubler", json={"x": [[1, 2, 3, 4]]})
    assert (await ok.json()) == {"y": [[2, 4, 6, 8]]}
    for body, message in [
        ({"x": [[1, 2, 3]]}, "preprocessor/features@1.0.0: expected rows of 4 features, got"),
        ({"x": [[-1, 2, 3, 4]]}, "runner/doubler@1.0.0: x must not be negative"),
    ]:
        resp = await cli.post("/predict/doubler", json=body)
        assert resp.status == 400 and (await error_of(resp)).startswith(message)
    resp = await cli.post("/predict/doubler", data=b"x=1")
    assert resp.status == 400 and "expects a JSON body" in await error_of(resp)


# -- the class, against a real server: no client input yields a 5xx -------------------------

leaves = (
    st.none() | st.booleans() | st.integers(-(2**64), 2**64)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=3)
)  # fmt: skip
names = st.sampled_from(["input", "x", "in_s", "in_f16", "in_i8", "in_bool", "in_u64", "q"])
datatypes = st.sampled_from([*V2_TO_NUMPY, "BF16"])


@st.composite
def tensor(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    """A v2 input, often well-formed in layout and wrong in content, JSON or binary."""
    name, datatype = draw(names), draw(datatypes)
    shape = draw(st.lists(st.integers(0, 4) | st.sampled_from([2**62, 2**31]), min_size=0,
                          max_size=3) | st.just([1, 4]))  # fmt: skip
    count = 1
    for dim in shape:
        count *= dim
    entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
    if draw(st.booleans()):
        raw = draw(st.binary(max_size=24) | st.just(b"\xff\xfe\x02\x00" * 4))
        if datatype == "BYTES" and draw(st.booleans()):
            elements = draw(st.lists(st.binary(max_size=4), min_size=min(count, 8),
                                     max_size=min(count, 8)))  # fmt: skip
            raw = b"".join(struct.pack("<I", len(e)) + e for e in elements)
        entry["parameters"] = {"binary_data_size": len(raw)}
        return entry, raw
    size = min(count, 8)
    entry["data"] = draw(st.lists(leaves, min_size=size, max_size=size) | leaves)
    return entry, b""


@pytest.mark.slow
def test_no_hostile_v2_request_gets_a_5xx(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """The class of findings 14-16 against a real server: whatever the request, 4xx or 200,
    never a 5xx, and the server keeps serving (its circuit breakers stay closed)."""
    shutil.copytree(ROOT / "plugins", plugins_dir, dirs_exist_ok=True)
    folder = write_plugin(
        plugins_dir, "runner", "ident", "1.0.0",
        '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\nmax_batch_size = 8\n'
        "breaker_failures = 1\n",
        module=None,
    )  # fmt: skip
    kinds = {"s": "str", "f16": "f16", "i8": "i8", "u64": "u64", "bool": "bool"}
    identity_model(folder / "model.onnx", {k: ONNX_TYPES[v] for k, v in kinds.items()})
    write_add_runner(plugins_dir, "add", "1.0.0", runner="cast_inputs = true\nbreaker_failures = 1")
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(ROOT / "models"))

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        st.sampled_from(["iris", "ident", "add"]),
        st.lists(tensor(), min_size=1, max_size=3),
        st.fixed_dictionaries(
            {}, optional={"binary_data_output": leaves, "priority": leaves, "timeout": leaves}
        ),
        st.booleans(),
    )
    def check(
        route: str, tensors: list[tuple[dict[str, Any], bytes]], parameters: dict[str, Any],
        predict: bool,
    ) -> None:  # fmt: skip
        header = json.dumps({"inputs": [t for t, _ in tensors], "parameters": parameters})
        binary = b"".join(raw for _, raw in tensors)
        if predict:
            body = {t["name"]: t.get("data") for t, _ in tensors}
            status, _, text = srv.request("POST", f"/predict/{route}", json.dumps(body).encode(),
                                          {"Content-Type": "application/json"})  # fmt: skip
        else:
            headers = {"Inference-Header-Content-Length": str(len(header))} if binary else {}
            status, _, text = srv.request(
                "POST", f"/v2/models/{route}/infer", header.encode() + binary, headers
            )
        assert status < 500, (status, text)

    check()
    for plugin in json.loads(srv.request("GET", "/admin/plugins")[2])["plugins"]:
        assert plugin.get("circuit", "closed") == "closed", plugin
    assert "Traceback" not in srv.log()
