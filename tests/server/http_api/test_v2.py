"""The KServe v2 data plane through aiohttp's test client, on real plugins and models."""

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import (
    ONNX_TYPES,
    identity_model,
    write_add_runner,
    write_plugin,
    write_processor,
)

TYPES = ONNX_TYPES
SAMPLES: dict[str, tuple[str, list[Any]]] = {
    "bool": ("BOOL", [True, False]), "u8": ("UINT8", [0, 255]), "u16": ("UINT16", [0, 65535]),
    "u32": ("UINT32", [0, 4294967295]), "u64": ("UINT64", [0, 2**64 - 1]),
    "i8": ("INT8", [-128, 127]), "i16": ("INT16", [-32768, 32767]),
    "i32": ("INT32", [-(2**31), 2**31 - 1]), "i64": ("INT64", [-(2**63), 2**63 - 1]),
    "f16": ("FP16", [0.5, -2.0]), "f32": ("FP32", [1.5, -0.25]), "f64": ("FP64", [1e300, -1e-300]),
    "str": ("BYTES", ["héllo", ""]),
}  # fmt: skip


def write_identity_runner(plugins_dir: Path) -> None:
    folder = write_plugin(
        plugins_dir, "runner", "ident", "1.0.0",
        '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\n', module=None,
    )  # fmt: skip
    identity_model(folder / "model.onnx", TYPES)


def v2_input(
    name: str, datatype: str, data: list[Any], shape: list[int] | None = None
) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape or [1, len(data)], "data": data}


async def test_health_and_server_metadata(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    cli = await client()
    assert (await (await cli.get("/v2/health/live")).json()) == {"live": True}
    resp = await cli.get("/v2/health/ready")
    assert resp.status == 200 and (await resp.json()) == {"ready": True}
    meta = await (await cli.get("/v2")).json()
    assert meta["name"] == "plugserve" and "binary_tensor_data" in meta["extensions"]


async def test_model_metadata_and_ready_with_versions(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    write_add_runner(plugins_dir, "add", "2.0.0", amount=2)
    cli = await client()
    meta = await (await cli.get("/v2/models/add")).json()
    assert meta["name"] == "add"
    assert meta["versions"] == ["2.0.0", "1.0.0"]
    assert meta["platform"] == "onnxruntime"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]
    assert meta["chain"]["runner"] == "runner/add@2.0.0"
    versioned = await (await cli.get("/v2/models/add/versions/1.0.0")).json()
    assert versioned["chain"]["runner"] == "runner/add@1.0.0"
    ready = await cli.get("/v2/models/add/ready")
    assert ready.status == 200 and (await ready.json())["ready"] is True
    assert (await cli.get("/v2/models/add/versions/1.0.0/ready")).status == 200
    assert (await cli.get("/v2/models/add/versions/9.0.0/ready")).status == 404
    assert (await cli.get("/v2/models/nope/ready")).status == 404
    assert (await cli.get("/v2/models/nope")).status == 404


async def test_json_infer_of_every_datatype_roundtrips(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_identity_runner(plugins_dir)
    cli = await client()
    body = {
        "id": "req-7",
        "inputs": [v2_input(f"in_{k}", dt, data) for k, (dt, data) in SAMPLES.items()],
    }
    resp = await cli.post("/v2/models/ident/infer", json=body)
    assert resp.status == 200, await resp.text()
    doc = await resp.json()
    assert doc["id"] == "req-7"
    assert doc["model_name"] == "ident" and doc["model_version"] == "1.0.0"
    outputs = {o["name"]: o for o in doc["outputs"]}
    for key, (datatype, data) in SAMPLES.items():
        out = outputs[f"out_{key}"]
        assert out["datatype"] == datatype and out["shape"] == [1, 2]
        assert out["data"] == data, key


async def test_binary_request_and_response_of_every_datatype(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_identity_runner(plugins_dir)
    cli = await client()
    from plugserve.registry.tensors.datatypes import numpy_dtype

    arrays: dict[str, np.ndarray] = {}
    chunks, inputs = [], []
    for key, (datatype, data) in SAMPLES.items():
        if datatype == "BYTES":
            raw = b"".join(struct.pack("<I", len(s.encode())) + s.encode() for s in data)
        else:
            arrays[key] = np.array([data], dtype=numpy_dtype(datatype))
            raw = arrays[key].tobytes()
        chunks.append(raw)
        inputs.append({"name": f"in_{key}", "datatype": datatype, "shape": [1, 2],
                       "parameters": {"binary_data_size": len(raw)}})  # fmt: skip
    header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    resp = await cli.post(
        "/v2/models/ident/infer",
        data=header + b"".join(chunks),
        headers={"Inference-Header-Content-Length": str(len(header)),
                 "Content-Type": "application/octet-stream"},
    )  # fmt: skip
    assert resp.status == 200, await resp.text()
    body = await resp.read()
    size = int(resp.headers["Inference-Header-Content-Length"])
    doc = json.loads(body[:size])
    offset = size
    for out in doc["outputs"]:
        n = out["parameters"]["binary_data_size"]
        raw = body[offset : offset + n]
        offset += n
        key = out["name"][4:]
        datatype, data = SAMPLES[key]
        assert "data" not in out
        if datatype == "BYTES":
            assert raw == chunks[list(SAMPLES).index(key)]
        else:
            np.testing.assert_array_equal(np.frombuffer(raw, numpy_dtype(datatype)), arrays[key][0])
    assert offset == len(body)


async def test_requested_outputs_filter_and_choose_binary(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_identity_runner(plugins_dir)
    cli = await client()
    body = {
        "inputs": [v2_input(f"in_{k}", dt, data) for k, (dt, data) in SAMPLES.items()],
        "outputs": [{"name": "out_f32", "parameters": {"binary_data": True}}, {"name": "out_i8"}],
    }
    resp = await cli.post("/v2/models/ident/infer", json=body)
    raw = await resp.read()
    size = int(resp.headers["Inference-Header-Content-Length"])
    doc = json.loads(raw[:size])
    assert [o["name"] for o in doc["outputs"]] == ["out_f32", "out_i8"]
    assert doc["outputs"][1]["data"] == [-128, 127]
    assert np.frombuffer(raw[size:], np.float32).tolist() == [1.5, -0.25]
    body["outputs"] = [{"name": "nope"}]
    resp = await cli.post("/v2/models/ident/infer", json=body)
    assert resp.status == 400 and "unknown output(s) ['nope']" in (await resp.json())["error"]


async def test_chain_runs_preprocess_runner_postprocess(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_processor(plugins_dir, "preprocessor", "pre", "1.0.0", 10)
    write_processor(plugins_dir, "postprocessor", "post", "1.0.0", 100)
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1,
                     route='[route]\npreprocess = ["pre"]\npostprocess = ["post"]\n')  # fmt: skip
    write_add_runner(plugins_dir, "add", "2.0.0", amount=2,
                     route='[route]\npreprocess = ["pre"]\npostprocess = ["post"]\n')  # fmt: skip
    cli = await client()
    body = {"inputs": [v2_input("x", "FP32", [0, 1, 2, 3])]}
    doc = await (await cli.post("/v2/models/add/infer", json=body)).json()
    assert doc["outputs"][0]["data"] == [112, 113, 114, 115]
    assert doc["model_version"] == "2.0.0"
    doc = await (await cli.post("/v2/models/add/versions/1.0.0/infer", json=body)).json()
    assert doc["outputs"][0]["data"] == [111, 112, 113, 114]
    assert doc["model_version"] == "1.0.0"


ASYNC_RUNNER = """
    import asyncio
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Slow:
        def __init__(self, delay):
            self.delay = delay
        async def infer(self, inputs):
            await asyncio.sleep(self.delay)
            return {"y": inputs["x"] * 2}
        def metadata(self):
            return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
                    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}]}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Slow(config["delay"])
"""


async def test_async_module_runner(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_plugin(plugins_dir, "runner", "slow", "1.0.0", "[config]\ndelay = 0\n",
                 {"plugin.py": ASYNC_RUNNER})  # fmt: skip
    cli = await client()
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1, 2]}]}
    doc = await (await cli.post("/v2/models/slow/infer", json=body)).json()
    assert doc["outputs"][0]["data"] == [2, 4]
    meta = await (await cli.get("/v2/models/slow")).json()
    assert meta["platform"] == "python"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"inputs": []}', "'inputs' must be a non-empty list"),
        (b'{"inputs": [{"name": "x", "datatype": "FP99", "shape": [1], "data": [1]}]}', "FP99"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1]}]}',
         "needs 2 elements, the data has 1"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": [1]}]}',
         "non-negative integers"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ["a"]}]}',
         "FP32 takes JSON numbers; the data holds strings"),
        (b'{"inputs": [{"name": "x", "datatype": "UINT8", "shape": [1], "data": [300]}]}',
         "does not fit UINT8"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}', "neither 'data'"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]},'
         b' {"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}', "appears twice"),
        (b'{"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": [1]}]}',
         "BYTES elements must be strings"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}], "id": 5}',
         "'id' must be a string"),
        (b'{"inputs": [{"name": "q", "datatype": "FP32", "shape": [1,4], "data": [1,2,3,4]}]}',
         "unknown input(s) ['q']; route 'add' takes ['x']"),
    ],
)  # fmt: skip
async def test_malformed_requests_are_400_with_a_clear_error(
    plugins_dir: Path,
    client,
    body: bytes,
    message: str,  # type: ignore[no-untyped-def]
) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client()
    resp = await cli.post("/v2/models/add/infer", data=body)
    assert resp.status == 400
    doc = await resp.json()
    assert message in doc["error"], doc


@pytest.mark.parametrize(
    ("header", "chunk", "message"),
    [
        ("abc", b"", "must be an integer"),
        ("9999", b"", "outside the body"),
        (None, b"\x00" * 8, "runs past the body"),
        (None, b"\x00" * 20, "belong to no input"),
    ],
)
async def test_malformed_binary_requests_are_400(
    plugins_dir: Path,
    client,
    header: str | None,
    chunk: bytes,
    message: str,  # type: ignore[no-untyped-def]
) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client()
    doc = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                  "parameters": {"binary_data_size": 16}}]}).encode()  # fmt: skip
    resp = await cli.post(
        "/v2/models/add/infer",
        data=doc + chunk,
        headers={"Inference-Header-Content-Length": header or str(len(doc))},
    )
    assert resp.status == 400
    assert message in (await resp.json())["error"]
