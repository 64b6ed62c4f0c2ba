"""Encoded images served end to end: the bundled ``image_decode`` before an ONNX runner,
images sent by tritonclient as BYTES, in v2 JSON as base64, and as a raw ``/predict``
body; images of different sizes batch together once resized."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from PIL import Image

from tests.helpers import ROOT, ServerProcess, _save, write_plugin

COLORS = [(255, 0, 0), (0, 255, 0), (10, 20, 30), (255, 255, 255)]


def mean_color_model(path: Path) -> Path:
    """``colors`` [N, 3]: each image's mean per channel, of ``image`` FP32 [N, 3, 32, 32]."""
    image = helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 32, 32])
    colors = helper.make_tensor_value_info("colors", TensorProto.FLOAT, ["N", 3])
    node = helper.make_node("ReduceMean", ["image"], ["colors"], axes=[2, 3], keepdims=0)
    return _save(helper.make_graph([node], "mean", [image], [colors]), path)


def encoded(width: int, height: int, color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture
def colors(plugins_dir: Path, models_dir: Path, server: Callable[..., Any]) -> ServerProcess:
    bundled = ROOT / "plugins" / "preprocessor" / "image_decode" / "1.0.0"
    mine = plugins_dir / "preprocessor" / "image_decode" / "1.0.0"
    shutil.copytree(bundled, mine)
    manifest = mine / "plugin.toml"
    manifest.write_text(manifest.read_text().replace("size = [224, 224]", "size = [32, 32]"))
    folder = write_plugin(
        plugins_dir, "runner", "colors", "1.0.0",
        '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\nmax_batch_size = 16\n'
        'max_queue_delay_ms = 5\n[route]\npreprocess = ["image_decode"]\n',
        module=None,
    )  # fmt: skip
    mean_color_model(folder / "model.onnx")
    return server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))


def expected(*colors: tuple[int, int, int]) -> np.ndarray:
    return np.array(colors, np.float32) / 255


def test_tritonclient_sends_encoded_images_as_bytes(colors: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{colors.port}")
    try:
        blobs = np.array([encoded(40, 20, COLORS[0]), encoded(7, 90, COLORS[1])], dtype=object)
        image = httpclient.InferInput("image", [2], "BYTES")
        image.set_data_from_numpy(blobs, binary_data=True)
        answer = client.infer("colors", [image]).as_numpy("colors")
    finally:
        client.close()
    np.testing.assert_allclose(answer, expected(COLORS[0], COLORS[1]), atol=1e-6)


def test_v2_json_takes_base64_when_the_input_says_so(colors: ServerProcess) -> None:
    blob = encoded(33, 17, COLORS[2])
    body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                        "parameters": {"content_type": "base64"},
                        "data": [base64.b64encode(blob).decode()]}]}  # fmt: skip
    status, _, raw = colors.request("POST", "/v2/models/colors/infer", body)
    assert status == 200, raw
    data = json.loads(raw)["outputs"][0]["data"]
    np.testing.assert_allclose(data, expected(COLORS[2])[0], atol=1e-6)
    # Without content_type a JSON string is the bytes themselves: base64 text is no image.
    del body["inputs"][0]["parameters"]
    status, _, raw = colors.request("POST", "/v2/models/colors/infer", body)
    assert status == 400 and b"cannot be decoded" in raw, raw
    body["inputs"][0]["parameters"] = {"content_type": "base64"}
    body["inputs"][0]["data"] = ["not base64!"]
    status, _, raw = colors.request("POST", "/v2/models/colors/infer", body)
    assert status == 400 and b"element 0 is not base64" in raw, raw


def test_a_raw_predict_body_is_one_image(colors: ServerProcess) -> None:
    status, _, raw = colors.request(
        "POST", "/predict/colors", encoded(12, 12, COLORS[3]),
        headers={"Content-Type": "image/png"},
    )  # fmt: skip
    assert status == 200, raw
    np.testing.assert_allclose(json.loads(raw)["colors"], expected(COLORS[3]), atol=1e-6)


def test_images_of_different_sizes_batch_once_resized(colors: ServerProcess) -> None:
    sizes = [(8 + 3 * i, 20 + i) for i in range(32)]

    def send(i: int) -> np.ndarray:
        blob = encoded(*sizes[i], COLORS[i % 4])
        body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                            "parameters": {"content_type": "base64"},
                            "data": [base64.b64encode(blob).decode()]}]}  # fmt: skip
        status, _, raw = colors.request("POST", "/v2/models/colors/infer", body)
        assert status == 200, raw
        return np.array(json.loads(raw)["outputs"][0]["data"], np.float32)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(send, range(32)))
    for i, answer in enumerate(answers):
        np.testing.assert_allclose(answer, expected(COLORS[i % 4])[0], atol=1e-6)
    status, _, body = colors.request("GET", "/admin/plugins")
    assert status == 200, body
    (record,) = [p for p in json.loads(body)["plugins"] if p["name"] == "colors"]
    figures = record.get("figures") or record
    assert figures["batched_rows"] == 32 and figures["executions"] < 32, figures
    assert "cannot_batch" not in figures
