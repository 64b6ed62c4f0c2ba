"""examples/ocr: RapidOCR's three PP-OCR models (from the rapidocr-onnxruntime package on
PyPI) served as a route, against the library's own results on the same images.

Skipped where rapidocr-onnxruntime is not installed; CI installs it (.ci/run).
"""

from __future__ import annotations

import base64
import concurrent.futures
import importlib.util
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from tests.helpers import ROOT, ServerProcess

rapidocr = pytest.importorskip("rapidocr_onnxruntime")
pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "ocr"
LINES = [
    ["Hello plugserve 2026", "ONNX models, served"],
    ["Invoice 4471", "Total: 129.50 EUR"],
    ["The quick brown fox", "jumps over the lazy dog"],
    ["Dynamic batching"],
]


def image(lines: list[str], width: int = 640) -> bytes:
    canvas = Image.new("RGB", (width, 90 + 80 * len(lines)), "white")
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default(size=40)
    for i, line in enumerate(lines):
        draw.text((20, 30 + 80 * i), line, fill="black", font=font)
    buffer = io.BytesIO()
    canvas.save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def library() -> Any:
    return rapidocr.RapidOCR()


@pytest.fixture
def ocr(tmp_path: Path, server: Callable[..., Any]) -> ServerProcess:
    spec = importlib.util.spec_from_file_location("prepare", EXAMPLE / "prepare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    models = module.prepare(tmp_path / "models")
    return server("--plugins-dir", str(EXAMPLE / "plugins"), "--models-dir", str(models))


def served(srv: ServerProcess, blob: bytes) -> list[tuple[str, float, np.ndarray]]:
    body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                        "parameters": {"content_type": "base64"},
                        "data": [base64.b64encode(blob).decode()]}]}  # fmt: skip
    status, _, raw = srv.request("POST", "/v2/models/ocr/infer", body)
    assert status == 200, raw
    outputs = {o["name"]: o for o in json.loads(raw)["outputs"]}
    boxes = np.array(outputs["box"]["data"], np.float32).reshape(outputs["box"]["shape"])
    return list(zip(outputs["text"]["data"], outputs["score"]["data"], boxes, strict=True))


def assert_same(got: list[tuple[str, float, np.ndarray]], expected: Any) -> None:
    assert [text for text, _, _ in got] == [text for _, text, _ in expected]
    for (_, score, box), (want_box, _, want_score) in zip(got, expected, strict=True):
        np.testing.assert_allclose(box, want_box, atol=1.0)
        assert score == pytest.approx(want_score, abs=1e-3)


def test_the_route_reads_what_the_library_reads(ocr: ServerProcess, library: Any) -> None:
    for lines in LINES:
        blob = image(lines)
        expected, _ = library(blob)
        assert expected, lines  # the library reads these images
        assert_same(served(ocr, blob), expected)


def test_concurrent_images_read_the_same_while_their_crops_batch(
    ocr: ServerProcess, library: Any
) -> None:
    blobs = [image(lines, width=560 + 40 * (i % 3)) for i, lines in enumerate(LINES * 4)]
    expected = [library(blob)[0] for blob in blobs]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda blob: served(ocr, blob), blobs))
    for got, want in zip(answers, expected, strict=True):
        assert_same(got, want)
    status, _, body = ocr.request("GET", "/admin/plugins")
    assert status == 200
    figures = {p["name"]: p.get("figures") or p for p in json.loads(body)["plugins"]}
    crops = sum(len(want) for want in expected)
    for name in ("ocr-cls", "ocr-rec"):  # every crop went through the server's runners
        assert figures[name]["batched_rows"] >= crops, figures[name]
    print({name: (figures[name]["batched_rows"], figures[name]["executions"])
           for name in ("ocr-det", "ocr-cls", "ocr-rec")})  # fmt: skip
