"""Issue 29 finding 5: one client's bad tensors never open a runner's circuit for the others.

A backend that refuses a request's inputs (ONNX Runtime's INVALID_ARGUMENT, or a kernel's
shape check at run time) answers that request 400 with the backend's message and is not
counted by the circuit breaker; a batch it fails is run again one request at a time, so
the request at fault alone fails. Real servers, real ONNX models built with ``onnx``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from tests.helpers import ServerProcess, _save, until, write_plugin

BAD_REQUESTS = 6
"""More than the runner's ``breaker_failures`` (4): each one counted would open the circuit."""


def matmul_model(path: Path) -> Path:
    """``y = a @ b`` whose inner dimensions are symbolic under different names (K, M): ONNX
    Runtime accepts any shapes at the door and its MatMul kernel refuses unequal ones."""
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", "K"])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["M", "P"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "P"])
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    return _save(helper.make_graph([node], "matmul", [a, b], [y]), path)


def write_matmul_runner(plugins: Path, isolation: str) -> None:
    folder = write_plugin(
        plugins, "runner", "matmul", "1.0.0",
        f'[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\nisolation = "{isolation}"\n'
        "breaker_failures = 4\nbreaker_reset_s = 60\n",
        module=None,
    )  # fmt: skip
    matmul_model(folder / "model.onnx")


def tensor(name: str, array: np.ndarray) -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "shape": list(array.shape),
            "data": array.reshape(-1).tolist()}  # fmt: skip


def matmul_http(srv: ServerProcess, a: np.ndarray, b: np.ndarray) -> tuple[int, dict[str, Any]]:
    body = {"inputs": [tensor("a", a), tensor("b", b)]}
    code, _, raw = srv.request("POST", "/v2/models/matmul/infer", body)
    return code, json.loads(raw)


def matmul_grpc(srv: ServerProcess, a: np.ndarray, b: np.ndarray) -> tuple[int, dict[str, Any]]:
    """The same call through tritonclient's gRPC client: its status as the HTTP one it maps."""
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    inputs = []
    for name, array in (("a", a), ("b", b)):
        each = grpcclient.InferInput(name, list(array.shape), "FP32")
        each.set_data_from_numpy(array)
        inputs.append(each)
    try:
        result = client.infer("matmul", inputs)
    except InferenceServerException as exc:
        status = {"StatusCode.INVALID_ARGUMENT": 400, "StatusCode.UNAVAILABLE": 503}
        return status.get(str(exc.status()), 500), {"error": exc.message()}
    finally:
        client.close()
    return 200, {"outputs": [{"name": "y", "data": result.as_numpy("y").reshape(-1).tolist()}]}


def runner_row(srv: ServerProcess, name: str) -> dict[str, Any]:
    _, _, raw = srv.request("GET", "/admin/plugins")
    return next(p for p in json.loads(raw)["plugins"] if p["name"] == name)


@pytest.mark.parametrize(
    ("isolation", "call"),
    [("none", matmul_http), ("process", matmul_grpc)],
    ids=["in-worker-http", "isolated-grpc"],
)
def test_inputs_the_backend_refuses_are_400s_that_never_open_the_circuit(
    server: Callable[..., ServerProcess],
    tmp_path: Path,
    isolation: str,
    call: Callable[[ServerProcess, np.ndarray, np.ndarray], tuple[int, dict[str, Any]]],
) -> None:
    """Issue 29 finding 5: a request whose shapes ONNX Runtime refuses (MatMul inner
    dimensions 3 and 2) answered 500 and counted for the breaker: after 4 of them every
    client got 503 "circuit open". In a worker over HTTP, and (the variant) in an isolated
    runner process over gRPC."""
    plugins = tmp_path / "plugins"
    write_matmul_runner(plugins, isolation)
    srv = server("--plugins-dir", str(plugins), "--models-dir", str(tmp_path / "models"))
    bad_a, bad_b = np.ones((2, 3), np.float32), np.ones((2, 4), np.float32)
    for _ in range(BAD_REQUESTS):
        code, answer = call(srv, bad_a, bad_b)
        assert code == 400, answer
        error = answer["error"]
        assert "runner/matmul@1.0.0" in error and "MatMul dimension mismatch" in error, error
        assert "onnxruntime_src" not in error and ".h:" not in error, error  # no internal paths
    good_a = np.arange(6, dtype=np.float32).reshape(2, 3)
    code, answer = call(srv, good_a, np.ones((3, 2), np.float32))
    assert code == 200, answer  # another client: served, the circuit closed
    assert answer["outputs"][0]["data"] == [3.0, 3.0, 12.0, 12.0]
    assert runner_row(srv, "matmul").get("circuit", "closed") == "closed"
    assert "Traceback" not in srv.log()


def test_a_runner_that_fails_every_call_still_opens_its_circuit(
    server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """What the breaker is for stays: the runner's own failure (ONNX Runtime's Fail about
    memory, not about the inputs) counts, and 4 of them open the circuit."""
    plugins = tmp_path / "plugins"
    folder = write_plugin(
        plugins, "runner", "matmul", "1.0.0",
        "[runner]\nbreaker_failures = 4\nbreaker_reset_s = 60\n",
        {"plugin.py": BROKEN_SESSION},
    )  # fmt: skip
    matmul_model(folder / "model.onnx")
    srv = server("--plugins-dir", str(plugins), "--models-dir", str(tmp_path / "models"))
    a, b = np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)
    for _ in range(4):
        code, answer = matmul_http(srv, a, b)
        assert code == 500 and "Failed to allocate memory" in answer["error"], answer
    code, answer = matmul_http(srv, a, b)
    assert code == 503 and "circuit open" in answer["error"], answer


BROKEN_SESSION = """
    import numpy as np
    import pluggy
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Broken:  # an out-of-memory session: the runner's fault whatever the inputs
        def infer(self, inputs):
            raise Fail(
                "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running "
                "MatMul node. Name:'' Status Message: bfc_arena.cc:360 AllocateRawInternal "
                "Failed to allocate memory for requested buffer of size 4398046511104"
            )

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Broken()
"""


LOOKUP = """
    import os
    import time

    import numpy as np
    import onnxruntime as ort
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Lookup:
        \"\"\"Embeddings through its own ONNX Runtime session; index 5 waits for the gate
        file, holding the runner while the test queues the next requests.\"\"\"

        def __init__(self, config):
            self.session = ort.InferenceSession(config["model"], providers=["CPUExecutionProvider"])
            self.gate = config["gate"]

        def metadata(self):
            return {"inputs": [{"name": "idx", "datatype": "INT64", "shape": [-1]}]}

        def infer(self, inputs):
            if (inputs["idx"] == 5).any():
                until = time.monotonic() + 30
                while not os.path.exists(self.gate) and time.monotonic() < until:
                    time.sleep(0.01)
            return {"y": self.session.run(None, {"idx": inputs["idx"]})[0]}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Lookup(config)
"""


def lookup_model(path: Path) -> Path:
    """``y = table[idx]``: a table of 10 rows of 4; an index out of range is refused by
    ONNX Runtime's Gather kernel (INVALID_ARGUMENT), whatever the batch."""
    table = numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), name="table")
    idx = helper.make_tensor_value_info("idx", TensorProto.INT64, ["N"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "idx"], ["y"])], "lookup", [idx], [y], [table]
    )
    return _save(graph, path)


def test_a_batch_with_one_refused_request_answers_its_batch_mates(
    server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """Issue 29 finding 5, in a batch (the variant: a runner of the plugin's own calling ONNX
    Runtime itself): a good, a bad and a good request share one batch, which ONNX Runtime
    refuses for the bad one's index; the batch runs again one request at a time: 200, 400,
    200, and the circuit stays closed."""
    plugins = tmp_path / "plugins"
    gate = tmp_path / "gate"
    model = lookup_model(tmp_path / "lookup.onnx")
    write_plugin(
        plugins, "runner", "lookup", "1.0.0",
        f'[config]\nmodel = "{model}"\ngate = "{gate}"\n'
        "[runner]\nmax_batch_size = 3\nmax_queue_delay_ms = 30000\nbreaker_failures = 1\n",
        {"plugin.py": LOOKUP},
    )  # fmt: skip
    srv = server("--plugins-dir", str(plugins), "--models-dir", str(tmp_path / "models"))
    answers: dict[int, tuple[int, dict[str, Any]]] = {}

    def post(index: int) -> None:
        body = {"inputs": [{"name": "idx", "datatype": "INT64", "shape": [1], "data": [index]}]}
        code, _, raw = srv.request("POST", "/v2/models/lookup/infer", body)
        answers[index] = (code, json.loads(raw))

    holder = threading.Thread(target=post, args=(5,))
    holder.start()
    until(lambda: runner_row(srv, "lookup")["executions"] == 1, 20, "the holding request runs")
    batch = [threading.Thread(target=post, args=(i,)) for i in (1, 99, 2)]
    for thread in batch:
        thread.start()
    until(lambda: runner_row(srv, "lookup")["queued"] == 3, 20, "three requests queued together")
    gate.touch()
    for thread in [holder, *batch]:
        thread.join(30)
    assert {i: code for i, (code, _) in answers.items()} == {5: 200, 1: 200, 99: 400, 2: 200}
    assert answers[1][1]["outputs"][0]["data"] == [4, 5, 6, 7]
    assert answers[2][1]["outputs"][0]["data"] == [8, 9, 10, 11]
    error = answers[99][1]["error"]
    assert error.startswith("runner/lookup@1.0.0: ONNX Runtime refused the inputs: Gather:"), error
    assert "out of data bounds" in error
    row = runner_row(srv, "lookup")
    # the holder alone, the batch of three refused, then each of the three alone
    assert (row["executions"], row["batched_rows"]) == (5, 7)
    assert (row["circuit"], row["circuit_trips"]) == ("closed", 0)
