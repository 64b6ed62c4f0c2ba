"""A voice-activity detector with silero-vad's streaming contract on a real server: each
chunk reaches the model behind the last 64 samples the model saw before it (the context
the server keeps from the ``input`` each request sends), beside the recurrent state and
the sample rate. Every answer is the one silero's own wrapper gets from ONNX Runtime."""

import concurrent.futures
import json
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tomli_w
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper

from tests.helpers import ROOT, ServerProcess, write_plugin

CONTEXT, CHUNK, HIDDEN, RATE = 64, 512, 128, 16000
MANIFEST = ROOT / "tests" / "fixtures" / "silero_vad.toml"
"""The runner's manifest, as docs/plugins.md quotes it."""


def silero_model(path: Path) -> Path:
    """An ONNX model with silero-vad v5's contract at 16 kHz: ``input`` FP32 [N, 64 + 512]
    (the context, then the chunk), ``state`` FP32 [2, N, 128], ``sr`` an INT64 scalar;
    ``output`` [N, 1], a speech probability, and ``stateN`` [2, N, 128]. Two recurrent
    layers read every sample of ``input``, the context's weighing the most, so that a
    context gone astray changes the answers."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((CONTEXT + CHUNK, HIDDEN)) / np.sqrt(CONTEXT + CHUNK)
    w[:CONTEXT] *= 4.0
    u, v = (rng.standard_normal((2, HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
    out = rng.standard_normal((HIDDEN, 1)) * 3 / np.sqrt(HIDDEN)
    constants = {
        "W": w.astype(np.float32), "U": u, "V": v, "O": out.astype(np.float32),
        "zero": np.array(0, np.int64), "one": np.array(1, np.int64),
        "axis0": np.array([0], np.int64), "rate": np.array(RATE, np.float32),
    }  # fmt: skip
    nodes = [
        helper.make_node("Gather", ["state", "zero"], ["h0"], axis=0),  # [N, 128]
        helper.make_node("Gather", ["state", "one"], ["h1"], axis=0),
        helper.make_node("MatMul", ["input", "W"], ["heard"]),
        helper.make_node("MatMul", ["h0", "U"], ["kept0"]),
        helper.make_node("Add", ["heard", "kept0"], ["sum0"]),
        helper.make_node("Tanh", ["sum0"], ["n0"]),
        helper.make_node("MatMul", ["n0", "V"], ["up"]),
        helper.make_node("Add", ["up", "h1"], ["sum1"]),
        helper.make_node("Tanh", ["sum1"], ["n1"]),
        helper.make_node("Unsqueeze", ["n0", "axis0"], ["s0"]),
        helper.make_node("Unsqueeze", ["n1", "axis0"], ["s1"]),
        helper.make_node("Concat", ["s0", "s1"], ["stateN"], axis=0),
        helper.make_node("Cast", ["sr"], ["sr_f"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["sr_f", "rate"], ["scale"]),
        helper.make_node("MatMul", ["n1", "O"], ["logit"]),
        helper.make_node("Mul", ["logit", "scale"], ["scaled"]),
        helper.make_node("Sigmoid", ["scaled"], ["output"]),
    ]
    inputs = [
        helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", CONTEXT + CHUNK]),
        helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "N", HIDDEN]),
        helper.make_tensor_value_info("sr", TensorProto.INT64, []),
    ]
    outputs = [
        helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 1]),
        helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, "N", HIDDEN]),
    ]
    initializer = [numpy_helper.from_array(value, name) for name, value in constants.items()]
    graph = helper.make_graph(nodes, "silero_like", inputs, outputs, initializer=initializer)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def audio(seed: int, count: int) -> list[np.ndarray]:
    """``count`` chunks [1, 512] of noise, loud (speech) in some and quiet in others."""
    rng = np.random.default_rng(seed)
    loud = np.repeat(rng.random(count) > 0.5, CHUNK) + 0.05
    samples = (rng.standard_normal(count * CHUNK) * loud).astype(np.float32)
    return list(samples.reshape(count, 1, CHUNK))


class SileroWrapper:
    """silero-vad's ``OnnxWrapper.__call__`` over ONNX Runtime: zeros at the start, then the
    context kept from the input it concatenated (``x[..., -64:]``), and the state."""

    def __init__(self, model: Path, keep_context: bool = True) -> None:
        self.session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        self.keep_context = keep_context
        self.state = np.zeros((2, 1, HIDDEN), np.float32)
        self.context = np.zeros((1, CONTEXT), np.float32)

    def __call__(self, chunk: np.ndarray) -> np.ndarray:
        x = np.concatenate([self.context, chunk], axis=1)
        feed = {"input": x, "state": self.state, "sr": np.array(RATE, np.int64)}
        output, self.state = self.session.run(None, feed)
        if self.keep_context:
            self.context = x[..., -CONTEXT:]
        return np.asarray(output)


def reference(model: Path, chunks: list[np.ndarray], keep_context: bool = True) -> np.ndarray:
    wrapper = SileroWrapper(model, keep_context)
    return np.concatenate([wrapper(chunk) for chunk in chunks])


def send(client: Any, url: str, sequence_id: int | str, chunks: list[np.ndarray]) -> np.ndarray:
    """One stream through tritonclient's ``http`` or ``grpc``: its chunks and the rate only."""
    connection = client.InferenceServerClient(url=url)
    try:
        answers = []
        for i, chunk in enumerate(chunks):
            data = client.InferInput("input", [1, CHUNK], "FP32")
            data.set_data_from_numpy(chunk)
            rate = client.InferInput("sr", [], "INT64")
            rate.set_data_from_numpy(np.array(RATE, np.int64))
            result = connection.infer("vad", [data, rate], sequence_id=sequence_id,
                                      sequence_start=i == 0, sequence_end=i == len(chunks) - 1)  # fmt: skip
            answers.append(result.as_numpy("output"))
        return np.concatenate(answers)
    finally:
        connection.close()


def assert_answers(got: np.ndarray, want: np.ndarray, what: str) -> None:
    # A batch's products may round the last bit otherwise than a batch of one; a context
    # gone astray is off by tenths (test_a_stream_answers_as_silero_s_wrapper).
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=what)


@pytest.fixture(params=["in-worker", "isolated"])
def vad(
    request: pytest.FixtureRequest, plugins_dir: Path, models_dir: Path,
    server: Callable[..., Any],
) -> tuple[ServerProcess, Path]:  # fmt: skip
    """The docs' manifest served by one worker, or by two workers reaching one runner
    process that keeps the sequences; and the model file."""
    isolated = request.param == "isolated"
    manifest = tomllib.loads(MANIFEST.read_text())
    if isolated:
        manifest["runner"].update(isolation="process", instances=1)
    folder = write_plugin(plugins_dir, "runner", "vad", "1.0.0", tomli_w.dumps(manifest), module=None)  # fmt: skip
    model = silero_model(folder / "model.onnx")
    workers = ("--workers", "2") if isolated else ()
    srv = server(*workers, "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    return srv, model


def test_a_stream_answers_as_silero_s_wrapper(vad: tuple[ServerProcess, Path]) -> None:
    """Every speech probability of a 48-chunk stream is the wrapper's; the same model fed
    without the context it saw gives others, and flips decisions."""
    srv, model = vad
    chunks = audio(1, 48)
    got = send(httpclient, f"127.0.0.1:{srv.port}", 7, chunks)
    want = reference(model, chunks)
    assert_answers(got, want, "one stream")
    blind = reference(model, chunks, keep_context=False)
    assert np.abs(want - blind).max() > 0.1
    assert int(((want > 0.5) != (blind > 0.5)).sum()) >= 3


def test_streams_batched_together_keep_each_its_own_context(
    vad: tuple[ServerProcess, Path],
) -> None:
    """12 concurrent streams, half over HTTP and half over gRPC, batch together; each is
    answered as the wrapper answers it alone."""
    srv, model = vad
    streams = {i: audio(100 + i, 24) for i in range(12)}
    urls = {httpclient: f"127.0.0.1:{srv.port}", grpcclient: srv.grpc_url}
    clients = {i: (httpclient, grpcclient)[i % 2] for i in streams}
    with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
        futures = {
            i: pool.submit(send, clients[i], urls[clients[i]], f"stream-{i}", chunks)
            for i, chunks in streams.items()
        }
        answers = {i: f.result() for i, f in futures.items()}
    for i, chunks in streams.items():
        assert_answers(answers[i], reference(model, chunks), f"stream {i}")
    stats = json.loads(srv.request("GET", "/v2/models/vad/stats")[2])["model_stats"][0]
    assert stats["inference_count"] == 12 * 24, stats
    mean_batch = stats["inference_count"] / stats["execution_count"]
    print(f"mean batch {mean_batch:.2f} rows over {stats['execution_count']} executions")
    assert mean_batch > 1.0, stats


def infer(srv: ServerProcess, chunk: np.ndarray, **parameters: object) -> tuple[int, Any]:
    body = {
        "inputs": [
            {"name": "input", "datatype": "FP32", "shape": list(chunk.shape),
             "data": chunk.ravel().tolist()},
            {"name": "sr", "datatype": "INT64", "shape": [], "data": [RATE]},
        ],
        "parameters": {"sequence_id": "s", **parameters},
    }  # fmt: skip
    status, _, raw = srv.request("POST", "/v2/models/vad/infer", body)
    answer = json.loads(raw)
    return status, answer["outputs"][0]["data"] if status == 200 else answer["error"]


def test_clients_send_chunks_and_a_restart_begins_in_silence(
    vad: tuple[ServerProcess, Path],
) -> None:
    """The metadata shows the chunk a client sends ([-1, 512]), not the model's 576
    samples, and hides the state; the model's whole input is refused (400) and changes
    nothing; a restart begins from zeros again."""
    srv, model = vad
    status, _, body = srv.request("GET", "/v2/models/vad")
    assert status == 200, body
    metadata = json.loads(body)
    assert [(t["name"], t["shape"]) for t in metadata["inputs"]] == [
        ("input", [-1, CHUNK]), ("sr", []),
    ]  # fmt: skip
    assert [t["name"] for t in metadata["outputs"]] == ["output"]
    first, second = audio(3, 4), audio(4, 4)
    got = [infer(srv, first[0], sequence_start=True), infer(srv, first[1])]
    status, error = infer(srv, np.zeros((1, CONTEXT + CHUNK), np.float32))
    assert status == 400 and "shape [1, 576]" in error, error
    got += [infer(srv, chunk) for chunk in first[2:]]
    assert all(status == 200 for status, _ in got), got
    assert_answers(np.ravel([d for _, d in got]), reference(model, first).ravel(), "first")
    again = [infer(srv, chunk, sequence_start=i == 0) for i, chunk in enumerate(second)]
    assert all(status == 200 for status, _ in again), again
    assert_answers(np.ravel([d for _, d in again]), reference(model, second).ravel(), "again")
    assert infer(srv, second[0], sequence_end=True)[0] == 200
