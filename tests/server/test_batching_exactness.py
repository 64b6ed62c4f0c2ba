"""What a real server does about batching that is not exact: a model whose batch axis is
fixed is refused at load with the fix; a batch the runner refuses and runs again one by
one is counted in ``/admin/plugins`` and said once in the log; and ``[runner.batching]
check`` turns batching off for a model whose batching changes its answers."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from tests.batching_models import dense_model, pair_model, quantized_model, write_model_runner
from tests.helpers import ServerProcess, metric

ROUNDS = 20
CALLS = 48


def figures(srv: ServerProcess, name: str) -> dict[str, Any]:
    status, _, body = srv.request("GET", "/admin/plugins")
    assert status == 200, body
    (record,) = [p for p in json.loads(body)["plugins"] if p["name"] == name]
    return dict(record.get("figures") or record)


def infer(srv: ServerProcess, route: str, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    body = {"inputs": [{"name": n, "datatype": "FP32", "shape": list(a.shape),
                        "data": a.reshape(-1).tolist()} for n, a in inputs.items()]}  # fmt: skip
    status, _, raw = srv.request("POST", f"/v2/models/{route}/infer", body)
    assert status == 200, raw
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in json.loads(raw)["outputs"]}


def log_lines(srv: ServerProcess, event: str) -> list[str]:
    return [line for line in srv.log().splitlines() if event in line]


def test_a_fixed_batch_axis_is_refused_at_load_naming_the_fix(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_model_runner(plugins_dir, "dense", dense_model)
    config = plugins_dir.parent / "plugserve.toml"
    config.write_text("watch = false\n")
    srv = server("--config", str(config), "--plugins-dir", str(plugins_dir),
                 "--models-dir", str(models_dir))  # fmt: skip
    write_model_runner(plugins_dir, "fixed", lambda p: dense_model(p, batch=1))
    status, _, body = srv.request("POST", "/admin/reload")
    assert status == 200, body
    (failed,) = json.loads(body)["failed"]
    assert failed["plugin"] == "runner/fixed@1.0.0"
    assert (
        "max_batch_size = 8, but the model fixes input 'x' to 1 on its batch axis 0"
        in (failed["error"])
    )
    assert "set max_batch_size = 0 to serve it unbatched" in failed["error"]
    # The fix it names: unbatched, the same model loads and answers.
    write_model_runner(
        plugins_dir, "fixed", lambda p: dense_model(p, batch=1), "max_batch_size = 1\n"
    )
    status, _, body = srv.request("POST", "/admin/plugins/runner/fixed/1.0.0/reload")
    assert status == 200, body
    assert infer(srv, "fixed", {"x": np.ones((1, 16), np.float32)})["y"].shape == (1, 8)


@pytest.mark.parametrize("isolation", ["", 'isolation = "process"\n'], ids=["worker", "isolated"])
def test_a_batch_run_again_one_by_one_is_counted_and_said_once(
    isolation: str, plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """``a [1, 1] @ b [1, 4]`` answers alone; any batch of two stacks ``b`` into the inner
    dimension and ONNX Runtime refuses it. Every batch then costs one execution more than
    its requests: ``executions`` is the requests answered plus the batches run again."""
    write_model_runner(
        plugins_dir, "pair", pair_model, "max_batch_size = 8\nmax_queue_delay_ms = 5\n" + isolation
    )
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    rng = np.random.default_rng(4)
    sent = 0
    for _ in range(ROUNDS):
        pairs = [{"a": rng.standard_normal((1, 1)).astype(np.float32),
                  "b": rng.standard_normal((1, 4)).astype(np.float32)} for _ in range(CALLS)]  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda p: infer(srv, "pair", p), pairs))
        sent += CALLS
        for pair, answer in zip(pairs, answers, strict=True):
            np.testing.assert_allclose(answer["y"], pair["a"] @ pair["b"], rtol=1e-5)
        if "batch_fallbacks" in figures(srv, "pair"):
            break
    said = figures(srv, "pair")
    fallbacks = said["batch_fallbacks"]
    assert fallbacks["count"] >= 1 and fallbacks["requests"] >= 2 * fallbacks["count"]
    assert "MatMul" in fallbacks["why"]
    assert said["executions"] == sent + fallbacks["count"], said
    (line,) = log_lines(srv, "batch_fallback")  # an isolated runner's process logs it
    assert "runner/pair@1.0.0" in line and "MatMul" in line
    metrics = srv.request("GET", "/metrics")[2].decode()
    assert metric(metrics, "plugserve_batch_fallbacks_total", name="pair") == fallbacks["count"]


def test_a_load_time_check_turns_batching_off_where_answers_change(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    check = "max_batch_size = 8\nmax_queue_delay_ms = 5\n[runner.batching]\ncheck = true\n"
    folder = write_model_runner(plugins_dir, "scores", quantized_model, check)
    write_model_runner(plugins_dir, "dense", dense_model, check)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    checked = figures(srv, "scores")["batching_check"]
    assert checked["batching"] == "off" and checked["exact"] is False
    assert [d["output"] for d in checked["differences"]] == ["y"]
    (line,) = log_lines(srv, "batching_off")
    assert "plugin=scores" in line and "outputs=['y']" in line and "dynamic quantization" in line
    exact = figures(srv, "dense")["batching_check"]
    assert exact["batching"] == "on" and exact["exact"] is True
    # Unbatched, each request runs alone and gets the answer it gets alone.
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(8)
    rows = [(rng.standard_normal((1, 16)) * rng.uniform(0.2, 5)).astype(np.float32)
            for _ in range(CALLS)]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda x: infer(srv, "scores", {"x": x}), rows))
    for x, answer in zip(rows, answers, strict=True):
        np.testing.assert_allclose(answer["y"], session.run(None, {"x": x})[0], rtol=1e-6)
    said = figures(srv, "scores")
    assert said["executions"] == said["batched_rows"] == CALLS, said
