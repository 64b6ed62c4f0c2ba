"""ONNX models whose batching is exact, or not, or not possible, written with the onnx package
for the tests of batching's exactness (and a runner folder to serve each)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from tests.helpers import _save, write_plugin

FEATURES, CLASSES = 16, 8


def dense_model(path: Path, batch: Any = "N", out_batch: Any = None) -> Path:
    """``y = x @ w + b``, FP32 ``x [batch, 16]`` to ``y [out_batch, 8]`` (as declared; the
    model returns a row per input row whatever ``out_batch`` says), fixed random weights."""
    rng = np.random.default_rng(7)
    w = numpy_helper.from_array(rng.standard_normal((FEATURES, CLASSES)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(CLASSES).astype(np.float32), "b")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, FEATURES])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [out_batch or batch, CLASSES])
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["y"]),
    ]
    return _save(helper.make_graph(nodes, "dense", [x], [y], initializer=[w, b]), path)


def quantized_model(path: Path) -> Path:
    """:func:`dense_model` dynamically quantized: each MatMul quantizes its input with one
    scale for the whole batch, so a row's answer depends on its batch-mates."""
    source = dense_model(path.with_name(path.stem + "-float.onnx"))
    quantize_dynamic(str(source), str(path), weight_type=QuantType.QInt8)
    return path


def batch_sum_model(path: Path) -> Path:
    """``y = sum over the batch of x``, declared ``[1, 8]`` and truly one row: its answer
    cannot be split per request."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", CLASSES])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, CLASSES])
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)
    return _save(helper.make_graph([node], "batch_sum", [x], [y], initializer=[axes]), path)


def ragged_model(path: Path, reduce: str) -> Path:
    """``y [N, 1]`` = ``reduce`` (``ReduceSum``: padding with zeros changes nothing;
    ``ReduceMean``: it does, unmasked) of each row of ``x [N, T]``, T ragged."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])
    if reduce == "ReduceSum":  # opset 17: its axes an input, ReduceMean's an attribute
        axes = [numpy_helper.from_array(np.array([1], np.int64), "axes")]
        node = helper.make_node(reduce, ["x", "axes"], ["y"], keepdims=1)
    else:
        axes, node = [], helper.make_node(reduce, ["x"], ["y"], axes=[1], keepdims=1)
    return _save(helper.make_graph([node], "ragged", [x], [y], initializer=axes), path)


def misdeclared_model(path: Path) -> Path:
    """``x [N, 8]`` returned as ``[N, 1, 8]`` while the model declares output ``y`` as
    ``[1, seqlen]``: a shape it contradicts on every run."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", CLASSES])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seqlen"])
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    node = helper.make_node("Unsqueeze", ["x", "axes"], ["y"])
    return _save(helper.make_graph([node], "misdeclared", [x], [y], initializer=[axes]), path)


def pair_model(path: Path) -> Path:
    """``y = a @ b``, ``a [N, K]`` and ``b [M, P]`` both dynamic: a request alone runs, while
    a batch of two (``b``'s rows stacked too) has ``K != M`` and ONNX Runtime refuses it."""
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", "K"])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["M", "P"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "P"])
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    return _save(helper.make_graph([node], "pair", [a, b], [y]), path)


def write_model_runner(
    plugins_dir: Path, name: str, build: Any, runner: str = "max_batch_size = 8\n"
) -> Path:
    """A declarative ``onnxruntime`` runner ``name`` over ``build(folder / "model.onnx")``;
    ``runner`` is TOML added to its ``[runner]`` table (and any tables after it)."""
    manifest = f'[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\n{runner}'
    folder = write_plugin(plugins_dir, "runner", name, "1.0.0", manifest, module=None)
    build(folder / "model.onnx")
    return folder
