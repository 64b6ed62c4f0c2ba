"""Triton's model configuration of a route, read with tritonclient and parsed as its proto."""

import pytest
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.slow


def test_an_onnx_route_with_batching_formats_and_labels(
    triton: httpclient.InferenceServerClient,
) -> None:
    config = triton.get_model_config("scores")
    assert config == {
        "name": "scores",
        "platform": "onnxruntime_onnx",
        "backend": "onnxruntime",
        "version_policy": {"all": {}},
        "max_batch_size": 8,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [5], "format": "FORMAT_NCHW"}],
        "output": [
            {"name": "y", "data_type": "TYPE_FP32", "dims": [5], "label_filename": "labels.txt"}
        ],
        "instance_group": [{"name": "scores", "count": 2, "kind": "KIND_CPU"}],
        "dynamic_batching": {"preferred_batch_size": [4, 8], "max_queue_delay_microseconds": 500},
    }
    # What the gRPC service answers: the same JSON as Triton's ModelConfig message.
    message = json_format.ParseDict(config, model_config_pb2.ModelConfig())
    assert message.input[0].format == model_config_pb2.ModelInput.FORMAT_NCHW
    assert message.dynamic_batching.max_queue_delay_microseconds == 500
    assert message.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU


def test_a_python_runner_without_batching_keeps_whole_shapes(
    triton: httpclient.InferenceServerClient,
) -> None:
    config = triton.get_model_config("double")
    assert config["backend"] == "python" and "platform" not in config
    assert config["max_batch_size"] == 0 and "dynamic_batching" not in config
    assert config["input"] == [
        {"name": "in", "data_type": "TYPE_INT32", "dims": [2, 3], "format": "FORMAT_NONE"}
    ]
    assert [o["name"] for o in config["output"]] == ["out", "raw"]
    json_format.ParseDict(config, model_config_pb2.ModelConfig())


def test_a_version_and_an_unknown_route(triton: httpclient.InferenceServerClient) -> None:
    for version in ("1.0.0", "1", "2"):
        assert triton.get_model_config("scores", model_version=version)["name"] == "scores"
    with pytest.raises(InferenceServerException) as info:
        triton.get_model_config("nope")
    assert info.value.message() == "Request for unknown model: 'nope' is not found"
    with pytest.raises(InferenceServerException) as info:
        triton.get_model_config("scores", model_version="7")
    assert "no runner version '7'" in info.value.message()
