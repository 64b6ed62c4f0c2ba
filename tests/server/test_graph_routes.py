"""Graph routes (``registry/execution/graph.py``): several runners and a processor as one
route, their tensors mapped from step to step, on a real server; and a plugin calling
another route in-process (``ctx.infer``)."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import ServerProcess, write_add_runner, write_plugin

BATCHING = "max_batch_size = 16\nmax_queue_delay_ms = 5"

CROP = """
    import asyncio

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Crop:
        async def process(self, data, ctx):
            await asyncio.sleep(0)
            return {"crops": np.asarray(data["image"]) * np.asarray(data["boxes"])}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Crop()
"""

REFINE = """
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Refine:
        async def format(self, data, ctx):
            answer = await ctx.infer("rec", {"x": data["y"]})
            return {"z": answer["y"]}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Refine()
"""

OCR_ROUTE = """
[routes.ocr]
outputs = ["text"]

[[routes.ocr.steps]]
runner = "det{det_version}"
inputs = {{ x = "image" }}
outputs = {{ y = "boxes" }}

[[routes.ocr.steps]]
processor = "crop"
inputs = ["image", "boxes"]
outputs = ["crops"]

[[routes.ocr.steps]]
runner = "rec"
inputs = {{ x = "crops" }}
outputs = {{ y = "text" }}
"""


def write_det(plugins_dir: Path, version: str = "1.0.0") -> None:
    write_add_runner(plugins_dir, "det", version, amount=10.0, runner=BATCHING)


def write_rec(plugins_dir: Path) -> None:
    write_add_runner(plugins_dir, "rec", "1.0.0", amount=100.0, runner=BATCHING)


def write_crop(plugins_dir: Path) -> None:
    write_plugin(plugins_dir, "preprocessor", "crop", "1.0.0", files={"plugin.py": CROP})


def write_routes(plugins_dir: Path, det_version: str = "") -> None:
    (plugins_dir / "routes.toml").write_text(OCR_ROUTE.format(det_version=det_version))


def image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 4)).astype(np.float32)


def infer(srv: ServerProcess, route: str, name: str, x: np.ndarray) -> tuple[int, Any]:
    body = {"inputs": [{"name": name, "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}]}  # fmt: skip
    status, _, raw = srv.request("POST", f"/v2/models/{route}/infer", body)
    answer = json.loads(raw)
    if status != 200:
        return status, answer
    (output,) = answer["outputs"]
    return status, (output["name"], np.array(output["data"], np.float32).reshape(output["shape"]))


def figures(srv: ServerProcess, name: str) -> dict[str, Any]:
    status, _, body = srv.request("GET", "/admin/plugins")
    assert status == 200, body
    (record,) = [p for p in json.loads(body)["plugins"] if p["name"] == name]
    return record.get("figures") or record


@pytest.fixture
def ocr(plugins_dir: Path, models_dir: Path, server: Callable[..., Any]) -> ServerProcess:
    write_det(plugins_dir)
    write_crop(plugins_dir)
    write_rec(plugins_dir)
    write_routes(plugins_dir)
    return server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))


def test_a_graph_answers_as_its_stages_called_one_by_one(ocr: ServerProcess) -> None:
    for seed in range(5):
        x = image(seed)
        status, (_, boxes) = infer(ocr, "det", "x", x)  # the detector's own route
        assert status == 200
        crops = x * boxes  # the processor, as its code computes it
        status, (_, text) = infer(ocr, "rec", "x", crops)
        assert status == 200
        status, answer = infer(ocr, "ocr", "image", x)
        assert status == 200, answer
        assert answer[0] == "text" and answer[1].tobytes() == text.tobytes()
    status, _, body = ocr.request("GET", "/v2/models/ocr")
    metadata = json.loads(body)
    assert status == 200 and [t["name"] for t in metadata["inputs"]] == ["image"], metadata
    assert [t["name"] for t in metadata["outputs"]] == ["text"], metadata
    status, _, body = ocr.request("GET", "/admin/routes")
    (route,) = [r for r in json.loads(body)["routes"] if r["name"] == "ocr"]
    assert route["ready"] and [s.get("runner") or s.get("preprocessor") for s in
                               route["serving"]["graph"]] == ["runner/det@1.0.0",
                               "preprocessor/crop@1.0.0", "runner/rec@1.0.0"]  # fmt: skip


def test_concurrent_requests_of_a_graph_batch_in_each_runner(ocr: ServerProcess) -> None:
    inputs = [image(seed) for seed in range(64)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda x: infer(ocr, "ocr", "image", x), inputs))
    for x, (status, (_, text)) in zip(inputs, answers, strict=True):
        assert status == 200
        np.testing.assert_allclose(text, x * (x + 10) + 100, rtol=1e-6)
    for runner in ("det", "rec"):
        counted = figures(ocr, runner)
        assert counted["batched_rows"] == 64, counted
        assert counted["executions"] < 64, counted  # batched: fewer runs than requests


def test_a_graph_never_goes_live_half_built(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """The route first, then its parts in the worst order (the step it pins last): until
    the last part is ready every request is a 503 naming what the graph waits for, never a
    500 or a wrong answer; then it answers."""
    write_routes(plugins_dir, det_version="@2.0.0")
    srv = server(
        "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir), "--no-strict-readiness"
    )  # the route declared before its parts: a partial start
    x = image(0)
    steps: list[Callable[[], None]] = [
        lambda: write_rec(plugins_dir),
        lambda: write_crop(plugins_dir),
        lambda: write_det(plugins_dir, "1.0.0"),  # not the version the route pins
        lambda: write_det(plugins_dir, "2.0.0"),
    ]
    for drop in steps[:-1]:
        drop()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # the parts load meanwhile: never a half graph
            status, answer = infer(srv, "ocr", "image", x)
            assert status == 503, answer
            assert "waits for its graph" in answer["error"], answer
            time.sleep(0.05)
    status, answer = infer(srv, "ocr", "image", x)
    assert "runner det has no version 2.0.0" in answer["error"] or "det@2.0.0" in answer["error"]
    steps[-1]()
    deadline = time.monotonic() + 30
    while (result := infer(srv, "ocr", "image", x))[0] != 200:
        assert result[0] == 503, result
        assert time.monotonic() < deadline, result
        time.sleep(0.05)
    np.testing.assert_allclose(result[1][1], x * (x + 10) + 100, rtol=1e-6)


def test_a_plugin_calls_another_route_in_process(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """``ctx.infer("rec", ...)`` from a postprocessor runs the rec route without HTTP,
    through rec's own queue (its executions count it)."""
    write_rec(plugins_dir)
    write_plugin(plugins_dir, "postprocessor", "refine", "1.0.0", files={"plugin.py": REFINE})
    route = '[route]\npostprocess = ["refine"]'
    write_add_runner(plugins_dir, "det", "1.0.0", amount=10.0, route=route)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    x = image(3)
    status, answer = infer(srv, "det", "x", x)
    assert status == 200, answer
    assert answer[0] == "z"
    np.testing.assert_allclose(answer[1], x + 110, rtol=1e-6)
    assert figures(srv, "rec")["batched_rows"] == 1
