"""The ``onnxruntime`` backend reads what a model lets a batch hold when it loads: a fixed
batch axis on an input is refused with the fixes, an output declared fixed is run on a
batch of two to see, and nothing is refused where requests never batch."""

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from onnx import TensorProto, helper
from structlog.testing import capture_logs

from plugserve.registry.backends.onnxruntime import OnnxRuntimeRunner, create_runner
from plugserve.registry.errors import PluginLoadError
from plugserve.registry.types import PluginInfo
from tests.batching_models import batch_sum_model, dense_model
from tests.helpers import _save, vad_model


def load(tmp_path: Path, model: Path, **runner: Any) -> OnnxRuntimeRunner:
    info = PluginInfo("m", "1.0.0", "runner", tmp_path, structlog.get_logger())
    return create_runner(info, runner, model)


def test_an_input_fixed_on_its_batch_axis_is_refused_with_the_fixes(tmp_path: Path) -> None:
    model = dense_model(tmp_path / "fixed.onnx", batch=1)
    with pytest.raises(PluginLoadError) as refused:
        load(tmp_path, model, max_batch_size=8)
    message = refused.value.message
    assert "max_batch_size = 8, but the model fixes input 'x' to 1 on its batch axis 0" in message
    assert "set max_batch_size = 0" in message and "[runner.batching]" in message
    assert "dynamic_axes={'x': {0: 'batch'}}" in message
    for unbatched in (0, 1):  # the first fix: it loads, and a request of one row runs
        runner = load(tmp_path, model, max_batch_size=unbatched)
        assert runner.infer({"x": np.ones((1, 16), np.float32)})["y"].shape == (1, 8)


def test_the_declared_batch_axis_is_the_one_checked(tmp_path: Path) -> None:
    """``state [2, N, 3]`` holds its rows on axis 1: fixed on axis 0 is no fault once
    declared; a scalar ``sr`` declared shared has no batch axis to check."""
    batching = {"inputs": {"state": {"axis": 1}, "sr": {"shared": True}},
                "outputs": {"stateN": {"axis": 1}}}  # fmt: skip
    runner = load(tmp_path, vad_model(tmp_path / "vad.onnx"), max_batch_size=8, batching=batching)
    assert runner.metadata()["inputs"][1]["shape"] == [2, -1, 3]
    wrong = {"inputs": {"state": {"axis": 2}, "sr": {"shared": True}}}
    with pytest.raises(PluginLoadError, match="fixes input 'state' to 3 on its batch axis 2"):
        load(tmp_path, vad_model(tmp_path / "vad.onnx"), max_batch_size=8, batching=wrong)


def test_a_model_whose_requests_never_batch_is_not_refused(tmp_path: Path) -> None:
    """Undeclared, the scalar ``sr`` keeps every request apart (``cannot_batch`` says so at
    run time): ``state``'s fixed axis 0 then never meets a batch."""
    runner = load(tmp_path, vad_model(tmp_path / "vad.onnx"), max_batch_size=8)
    assert runner.metadata()["inputs"][2]["shape"] == []


def test_an_output_declared_fixed_that_holds_the_rows_loads_with_a_warning(
    tmp_path: Path,
) -> None:
    model = dense_model(tmp_path / "out.onnx", out_batch=1)
    with capture_logs() as logs:
        runner = load(tmp_path, model, max_batch_size=8)
    (said,) = [e for e in logs if e["event"] == "output_shape_contradicted"]
    assert (said["output"], said["declared"], said["returned"]) == ("y", [1, 8], [2, 8])
    assert said["log_level"] == "warning" and "dynamic on axis 0" in said["fix"]
    assert runner.infer({"x": np.ones((3, 16), np.float32)})["y"].shape == (3, 8)


def test_an_output_that_does_not_hold_the_rows_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PluginLoadError) as refused:
        load(tmp_path, batch_sum_model(tmp_path / "sum.onnx"), max_batch_size=4)
    message = refused.value.message
    assert "output 'y' (declared [1, 8]) returned [1, 8] for a batch of 2 rows" in message
    assert "a batch's answers could not be split" in message and "max_batch_size = 0" in message
    assert load(tmp_path, batch_sum_model(tmp_path / "sum.onnx")).metadata()  # unbatched: fine


def test_an_output_on_another_axis_is_refused_naming_the_axis_that_holds_the_rows(
    tmp_path: Path,
) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, "N"])
    model = _save(helper.make_graph([helper.make_node("Transpose", ["x"], ["y"])], "t", [x], [y]),
                  tmp_path / "t.onnx")  # fmt: skip
    with pytest.raises(PluginLoadError, match=r"returned \[4, 2\] .*; axis 1 holds them"):
        load(tmp_path, model, max_batch_size=8)
    declared = {"outputs": {"y": {"axis": 1}}}
    assert load(tmp_path, model, max_batch_size=8, batching=declared).metadata()
