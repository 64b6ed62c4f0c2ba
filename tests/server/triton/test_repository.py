"""Triton's model repository extension with tritonclient: index, load, load with config, unload."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from plugserve.registry.errors import ModelLoadFailed
from plugserve.server.triton.repository import runner_overrides
from tests.helpers import ServerProcess, write_add_runner
from tests.server.triton.conftest import write_python, write_scores


def states(client: httpclient.InferenceServerClient) -> dict[tuple[str, str], str]:
    return {(r["name"], r["version"]): r["state"] for r in client.get_model_repository_index()}


def every_connection(
    srv: ServerProcess, ask: Callable[[httpclient.InferenceServerClient], Any]
) -> set[Any]:
    """What 8 new connections answer: with several workers, more than one worker answers."""
    answers = set()
    for _ in range(8):
        client = httpclient.InferenceServerClient(url=f"127.0.0.1:{srv.port}")
        answers.add(ask(client))
        client.close()
    return answers


@pytest.mark.slow
@pytest.mark.workers(1, 2)
def test_index_unload_and_load_as_triton_examples_do(
    triton: httpclient.InferenceServerClient, triton_server: ServerProcess
) -> None:
    assert states(triton) == {
        ("double", "1.0.0"): "READY",
        ("scores", "2.0.0"): "READY",
        ("scores", "1.0.0"): "READY",
    }
    triton.unload_model("scores")
    assert not triton.is_model_ready("scores")
    assert not triton.is_model_ready("scores", model_version="1")
    assert every_connection(triton_server, lambda c: c.is_model_ready("scores")) == {False}
    index = triton.get_model_repository_index()
    assert {(r["version"], r["state"], r["reason"]) for r in index if r["name"] == "scores"} == {
        ("1.0.0", "UNAVAILABLE", "unloaded"),
        ("2.0.0", "UNAVAILABLE", "unloaded"),
    }
    assert triton.is_model_ready("double")  # the other route is untouched
    triton.load_model("scores")
    assert triton.is_model_ready("scores") and triton.is_model_ready("scores", model_version="1")
    inp = httpclient.InferInput("x", [1, 5], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 5), np.float32))
    assert triton.infer("scores", [inp]).as_numpy("y").tolist() == [[1.0] * 5]  # 2.0.0 serves
    with pytest.raises(InferenceServerException) as info:
        triton.load_model("wrong_model_name")
    assert info.value.status() == "400"
    assert info.value.message() == (
        "failed to load 'wrong_model_name', failed to poll from model repository"
    )
    with pytest.raises(InferenceServerException) as info:
        triton.unload_model("wrong_model_name")
    assert info.value.status() == "404"


@pytest.mark.slow
@pytest.mark.workers(1, 2)
def test_a_config_overrides_runner_settings_until_the_next_load_from_files(
    triton: httpclient.InferenceServerClient, triton_server: ServerProcess
) -> None:
    assert triton.get_model_config("scores")["max_batch_size"] == 8
    # Triton's simple_http_model_control.py: a malformed config, then one with a string integer.
    with pytest.raises(InferenceServerException) as info:
        triton.load_model("scores", config='"parameters": {"config": {{"max_batch_size": "16"}}}')
    assert "failed to load" in info.value.message()
    assert triton.is_model_ready("scores")  # what served keeps serving
    triton.load_model("scores", config='{"max_batch_size":"16"}')
    config = triton.get_model_config("scores")
    assert config["max_batch_size"] == 16
    assert every_connection(
        triton_server, lambda c: c.get_model_config("scores")["max_batch_size"]
    ) == {16}
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 500  # the file's
    # A config as get_model_config answers it, changed: derived fields are taken as they are.
    config["dynamic_batching"]["max_queue_delay_microseconds"] = 2000
    config["instance_group"][0]["count"] = 1
    triton.load_model("scores", config=json.dumps(config))
    after = triton.get_model_config("scores")
    assert after["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert after["instance_group"][0]["count"] == 1 and after["max_batch_size"] == 16
    with pytest.raises(InferenceServerException) as info:
        triton.load_model("scores", config='{"max_batch_size": 2000000}')
    assert info.value.message().startswith("failed to load 'scores', ")
    assert "max_batch_size" in info.value.message()
    assert triton.get_model_config("scores")["max_batch_size"] == 16
    triton.load_model("scores")  # from its files again
    assert every_connection(
        triton_server, lambda c: c.get_model_config("scores")["max_batch_size"]
    ) == {8}


@pytest.mark.slow
@pytest.mark.workers(1, 2)
def test_repository_calls_follow_the_admin_rules(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_scores(plugins_dir)
    write_python(plugins_dir)
    srv = server(
        "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
        env={"PLUGSERVE_ADMIN_TOKEN": "s3cret-admin-token"},
    )  # fmt: skip
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{srv.port}")
    for call in (
        client.get_model_repository_index,
        lambda: client.unload_model("scores"),
        lambda: client.load_model("scores"),
    ):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == "401"
    assert client.is_model_ready("scores")
    admin = {"Authorization": "Bearer s3cret-admin-token"}
    client.unload_model("scores", headers=admin)
    assert not client.is_model_ready("scores")
    client.load_model("scores", headers=admin)
    assert client.is_model_ready("scores")
    assert len(client.get_model_repository_index(headers=admin)) == 2
    client.close()


def test_what_a_config_may_set() -> None:
    config = (
        '{"name": "scores", "platform": "onnxruntime_onnx", "max_batch_size": 4,'
        ' "dynamic_batching": {"max_queue_delay_microseconds": "1500",'
        ' "preferred_batch_size": [2, 4], "priority_levels": 2},'
        ' "instance_group": [{"count": 2, "kind": "KIND_CPU"}, {"count": 1}],'
        ' "input": [{"name": "x", "format": "FORMAT_NHWC", "dims": [5]}],'
        ' "output": [{"name": "y"}]}'
    )
    assert runner_overrides("scores", config) == {
        "max_batch_size": 4,
        "max_queue_delay_ms": 1.5,
        "preferred_batch_sizes": [2, 4],
        "priority_levels": 2,
        "instances": 3,
        "formats": {"x": "FORMAT_NHWC"},
    }
    for bad, why in [
        ('{"name": "other"}', "is not the route"),
        ('{"max_batch_size": 1.5}', "must be an integer"),
        ('{"max_batch_size": true}', "must be an integer"),
        ('{"optimization": {}}', "'optimization' is not supported"),
        ('{"dynamic_batching": {"preserve_ordering": true}}', "is not supported"),
        ("[1]", "must be a JSON object"),
        ("[" * 10_000, "not valid JSON"),
    ]:
        with pytest.raises(ModelLoadFailed, match=why) as info:
            runner_overrides("scores", bad)
        assert info.value.message.startswith("failed to load 'scores', ")


async def test_a_route_named_apart_from_its_runner_loads_again_after_an_unload(
    plugins_dir: Path, client: Any
) -> None:
    """While none of its versions is loaded, a route named by [route] name is not in the
    table (its runner's own name stands there): its files still say which runner it is."""
    write_add_runner(plugins_dir, "iris", "1.0.0", route='[route]\nname = "flowers"\n')
    cli = await client()
    assert (await cli.post("/v2/repository/models/flowers/unload")).status == 200
    assert (await cli.get("/v2/models/flowers/ready")).status == 404
    index = await (await cli.post("/v2/repository/index", data=b"")).json()
    assert index == [
        {"name": "iris", "version": "1.0.0", "state": "UNAVAILABLE", "reason": "unloaded"}
    ]
    resp = await cli.post("/v2/repository/models/flowers/load", json={})
    assert resp.status == 200, await resp.text()
    assert await resp.json() == {"name": "flowers", "loaded": ["runner/iris@1.0.0"]}
    assert (await cli.get("/v2/models/flowers/ready")).status == 200
    ready = await (await cli.post("/v2/repository/index", json={"ready": True})).json()
    assert [(r["name"], r["state"]) for r in ready] == [("flowers", "READY")]
    for body, why in [(b"[1]", "JSON object"), (b'{"ready": 1}', "'ready' must be")]:
        resp = await cli.post("/v2/repository/index", data=body)
        assert resp.status == 400 and why in (await resp.json())["error"]
    files = {"parameters": {"config": "{}", "file:1/model.onnx": "AAAA"}}
    resp = await cli.post("/v2/repository/models/flowers/load", json=files)
    assert resp.status == 400 and "file overrides" in (await resp.json())["error"]
