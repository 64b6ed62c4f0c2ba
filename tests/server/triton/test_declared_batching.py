"""Declared batching on a real server: a streaming audio model whose state is batched on
axis 1 and whose sample rate is one scalar for the batch (``[runner.batching]``), through
Triton's own clients, and what the server says of a runner whose inputs cannot batch."""

import concurrent.futures
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.helpers import ServerProcess, write_vad_runner

STEPS = 5
SEQUENCES = 16
RATE = 16000


def chunks(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 4)).astype(np.float32) for _ in range(STEPS)]


def library_outputs(model: Path, xs: list[np.ndarray]) -> list[np.ndarray]:
    """The sequence run by ONNX Runtime alone, its state carried by hand."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    state = np.zeros((2, 1, 3), np.float32)
    answers = []
    for x in xs:
        output, state = session.run(None, {"input": x, "state": state, "sr": np.array(RATE)})
        answers.append(output)
    return answers


def send(client: Any, url: str, sequence_id: int, xs: list[np.ndarray]) -> list[np.ndarray]:
    """One sequence through tritonclient's ``http`` or ``grpc``: only its chunks and rate."""
    connection = client.InferenceServerClient(url=url)
    try:
        answers = []
        for i, x in enumerate(xs):
            chunk = client.InferInput("input", [1, 4], "FP32")
            chunk.set_data_from_numpy(x)
            rate = client.InferInput("sr", [], "INT64")
            rate.set_data_from_numpy(np.array(RATE, np.int64))
            result = connection.infer("vad", [chunk, rate], sequence_id=sequence_id,
                                      sequence_start=i == 0, sequence_end=i == len(xs) - 1)  # fmt: skip
            answers.append(result.as_numpy("output"))
        return answers
    finally:
        connection.close()


def vad_record(srv: ServerProcess) -> dict[str, Any]:
    status, _, body = srv.request("GET", "/admin/plugins")
    assert status == 200, body
    (record,) = [p for p in json.loads(body)["plugins"] if p["name"] == "vad"]
    return record


@pytest.mark.parametrize("isolated", [False, True], ids=["in-worker", "isolated"])
def test_a_stateful_model_batches_its_state_on_axis_1_and_answers_as_the_library(
    isolated: bool, plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """16 concurrent sequences, half over HTTP and half over gRPC, each answered as ONNX
    Runtime answers the sequence alone, while their requests batch together."""
    folder = write_vad_runner(
        plugins_dir, runner='isolation = "process"\ninstances = 1' if isolated else ""
    )
    workers = ("--workers", "2") if isolated else ()
    srv = server(*workers, "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    inputs = {i: chunks(i) for i in range(SEQUENCES)}
    urls = {httpclient: f"127.0.0.1:{srv.port}", grpcclient: f"127.0.0.1:{srv.grpc_port}"}
    with concurrent.futures.ThreadPoolExecutor(SEQUENCES) as pool:
        futures = {
            i: pool.submit(send, client, urls[client], 500 + i, inputs[i])
            for i, client in ((i, (httpclient, grpcclient)[i % 2]) for i in range(SEQUENCES))
        }
        answers = {i: f.result() for i, f in futures.items()}
    for i in range(SEQUENCES):
        expected = library_outputs(folder / "model.onnx", inputs[i])
        for got, want in zip(answers[i], expected, strict=True):
            # A batch's reductions may round the last bit otherwise than a batch of one;
            # a state gone astray is off by whole chunks.
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=str(i))
    record = vad_record(srv)
    figures = record.get("figures") or record
    executions, rows = figures.get("executions"), figures.get("batched_rows")
    if executions:  # the worker's runner (an isolated one's count is its process's)
        mean = rows / executions
        print(f"mean batch at {SEQUENCES} sequences: {mean:.2f} ({rows} rows, {executions} runs)")
        assert rows == SEQUENCES * STEPS and mean > 1.0, figures
    assert "cannot_batch" not in json.dumps(record)


@pytest.mark.parametrize("isolated", [False, True], ids=["in-worker", "isolated"])
def test_an_input_that_cannot_batch_is_said_once_and_counted(
    isolated: bool, plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """Undeclared, the model's scalar rate and its state (rows on axis 1) keep every request
    apart: ``/admin/plugins`` counts it and says why, and the log says it once (a runner
    process's log included)."""
    runner = 'isolation = "process"\ninstances = 1' if isolated else ""
    write_vad_runner(plugins_dir, runner=runner, batching="", sequence="")
    workers = ("--workers", "2") if isolated else ()
    srv = server(*workers, "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    body = {
        "inputs": [
            {"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1.0] * 4},
            {"name": "state", "datatype": "FP32", "shape": [2, 1, 3], "data": [0.0] * 6},
            {"name": "sr", "datatype": "INT64", "shape": [], "data": [RATE]},
        ]
    }

    def call(_: int) -> int:
        return srv.request("POST", "/v2/models/vad/infer", body)[0]

    for _ in range(20):
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            assert set(pool.map(call, range(64))) == {200}
        record = vad_record(srv)
        if "cannot_batch" in (record.get("figures") or record):
            break
    record = vad_record(srv)
    said = (record.get("figures") or record)["cannot_batch"]
    assert said["count"] >= 1
    assert said["why"].startswith("input 'sr' has 0 dimensions and no batch axis 0: declare it")
    assert srv.log().count("cannot_batch") == 1, srv.log()[-3000:]
