"""A 4 MiB FP32 input end to end: Triton's system shared memory against HTTP binary.

    python -m tests.benchmarks.shm [--requests 50] [--elements 1048576] [--workers 1]

One plugserve server, two ONNX routes on FP32 ``[1, elements]`` (4 MiB by
default): ``sum`` answers a single number (the input is what travels) and
``add`` answers ``x + 1`` (4 MiB back too). For each route, one
``tritonclient.http`` client at c=1 times ``--requests`` requests (after 5 of
warm-up) in two ways, each time with new data, so the client's own work counts:

- ``binary``: the input as binary tensor data in the body, the output binary;
- ``shm``: the client writes the input into a registered region
  (``set_shared_memory_region``) and, for ``add``, reads the output back from
  another (``get_contents_as_numpy``, copied); the body is JSON metadata only.

Prints the median and p90 per route and way, and the binary/shm ratio of the
medians (the issue asks for 2x or more on the 4 MiB input). Not run by CI.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from onnx import TensorProto, helper

from tests.helpers import ServerProcess, add_model, write_plugin

WARMUP = 5


def write_plugins(plugins: Path, elements: int) -> None:
    manifest = '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\n'
    add_model(
        write_plugin(plugins, "runner", "add", "1.0.0", manifest, module=None) / "model.onnx",
        1.0,
        elements,
    )
    folder = write_plugin(plugins, "runner", "sum", "1.0.0", manifest, module=None)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", elements])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)
    graph = helper.make_graph([node], "sum", [x], [y], initializer=[axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(folder / "model.onnx"))


def timed(
    call: Callable[[np.ndarray], np.ndarray],
    check: Callable[[np.ndarray, np.ndarray], None],
    elements: int,
    requests: int,
) -> list[float]:
    rng = np.random.default_rng(0)
    times = []
    for i in range(WARMUP + requests):
        x = rng.random((1, elements), dtype=np.float32)
        started = time.perf_counter()
        y = call(x)
        if i >= WARMUP:
            times.append(time.perf_counter() - started)
        check(x, y)
    return times


def binary_way(
    client: httpclient.InferenceServerClient, route: str
) -> Callable[[np.ndarray], np.ndarray]:
    def call(x: np.ndarray) -> np.ndarray:
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        result = client.infer(
            route, [inp], outputs=[httpclient.InferRequestedOutput("y", binary_data=True)]
        )
        y: np.ndarray = result.as_numpy("y")
        return y

    return call


def shm_way(
    client: httpclient.InferenceServerClient,
    route: str,
    elements: int,
    made: list[shm.SharedMemoryRegion],
) -> Callable[[np.ndarray], np.ndarray]:
    size = elements * 4
    out_size = size if route == "add" else 4
    tag = uuid.uuid4().hex[:8]
    ins = shm.create_shared_memory_region(f"in-{tag}", f"/plugserve-bench-in-{tag}", size)
    outs = shm.create_shared_memory_region(f"out-{tag}", f"/plugserve-bench-out-{tag}", out_size)
    made += [ins, outs]
    client.register_system_shared_memory(f"in-{tag}", f"/plugserve-bench-in-{tag}", size)
    client.register_system_shared_memory(f"out-{tag}", f"/plugserve-bench-out-{tag}", out_size)

    def call(x: np.ndarray) -> np.ndarray:
        shm.set_shared_memory_region(ins, [x])
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_shared_memory(f"in-{tag}", size)
        out = httpclient.InferRequestedOutput("y")
        out.set_shared_memory(f"out-{tag}", out_size)
        result = client.infer(route, [inp], outputs=[out])
        meta = result.get_output("y")
        return np.array(shm.get_contents_as_numpy(outs, np.float32, meta["shape"]))

    return call


def check_for(route: str) -> Callable[[np.ndarray, np.ndarray], None]:
    def check(x: np.ndarray, y: np.ndarray) -> None:
        want = x + 1 if route == "add" else x.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(y, want, rtol=1e-3)

    return check


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--elements", type=int, default=1 << 20)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "models").mkdir()
        write_plugins(root / "plugins", args.elements)
        srv = ServerProcess(
            "--plugins-dir",
            str(root / "plugins"),
            "--models-dir",
            str(root / "models"),
            "--workers",
            str(args.workers),
            log=root / "server.log",
        ).wait_ready(60)
        made: list[shm.SharedMemoryRegion] = []
        try:
            client = httpclient.InferenceServerClient(f"127.0.0.1:{srv.port}")
            print(
                f"{args.elements * 4 / 2**20:.1f} MiB FP32 input, c=1, {args.requests} requests, "
                f"{args.workers} worker(s); milliseconds"
            )
            print(f"{'route':6} {'way':7} {'median':>8} {'p90':>8}")
            for route in ("sum", "add"):
                medians = {}
                for way, call in (
                    ("binary", binary_way(client, route)),
                    ("shm", shm_way(client, route, args.elements, made)),
                ):
                    times = sorted(timed(call, check_for(route), args.elements, args.requests))
                    medians[way] = statistics.median(times)
                    p90 = times[int(0.9 * (len(times) - 1))]
                    print(f"{route:6} {way:7} {medians[way] * 1e3:8.2f} {p90 * 1e3:8.2f}")
                print(f"{route:6} binary/shm {medians['binary'] / medians['shm']:.2f}x")
            client.unregister_system_shared_memory()
        finally:
            for handle in made:
                shm.destroy_shared_memory_region(handle)
            srv.stop()


if __name__ == "__main__":
    main()
