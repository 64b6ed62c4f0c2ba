"""examples/captcha: ddddocr's captcha OCR and detector (from the ddddocr package on PyPI)
served as two routes whose preprocessors are the bundled image_decode, configured, against
the library's own answers and its own preprocessing on the same images.

Skipped where ddddocr (or OpenCV, which its detector needs) is not installed; CI installs
both (.ci/run).
"""

from __future__ import annotations

import base64
import concurrent.futures
import importlib.util
import io
import json
import random
import string
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from plugserve.registry.plugins.imports import import_plugin, package_name
from tests.helpers import ROOT, ServerProcess
from tests.plugins.bundled import context

ddddocr = pytest.importorskip("ddddocr")
pytest.importorskip("cv2")
pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "captcha"
ALPHABET = string.ascii_letters + string.digits


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def captcha(text: str, seed: int, kind: str = "PNG") -> bytes:
    """A text captcha: coloured characters at jittered heights over a noisy background
    with a few lines through it; some as JPEG, some as palette GIFs, some with alpha."""
    rng = random.Random(seed)
    width, height = 24 + 26 * len(text) + rng.randrange(0, 30), rng.choice([40, 50, 60])
    background = tuple(rng.randrange(200, 256) for _ in range(3))
    image = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(image)
    for _ in range(width * height // 12):
        draw.point((rng.randrange(width), rng.randrange(height)), fill=_colour(rng, 120, 230))
    font = ImageFont.load_default(size=height * 2 // 3)
    for i, char in enumerate(text):
        at = (12 + 26 * i + rng.randrange(-2, 3), rng.randrange(0, height // 4))
        draw.text(at, char, fill=_colour(rng, 0, 110), font=font)
    for _ in range(2):
        ends = [(rng.randrange(width), rng.randrange(height)) for _ in range(2)]
        draw.line(ends, fill=_colour(rng, 60, 160), width=1)
    if kind == "RGBA":
        image = image.convert("RGBA")
        kind = "PNG"
    buffer = io.BytesIO()
    image.save(buffer, kind)
    return buffer.getvalue()


def clicks(seed: int) -> bytes:
    """A click captcha: a few large characters scattered over a textured background."""
    rng = random.Random(seed)
    image = Image.new("RGB", (320, 160), _colour(rng, 150, 220))
    draw = ImageDraw.Draw(image)
    for _ in range(30):
        box = (
            sorted(rng.randrange(320) for _ in range(2)),
            sorted(rng.randrange(160) for _ in range(2)),
        )
        draw.rectangle((box[0][0], box[1][0], box[0][1], box[1][1]), fill=_colour(rng, 120, 230))
    font = ImageFont.load_default(size=40)
    for i in range(rng.randrange(3, 6)):
        at = (10 + 60 * i + rng.randrange(0, 15), rng.randrange(10, 100))
        draw.text(at, rng.choice(ALPHABET), fill=_colour(rng, 0, 80), font=font)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG" if seed % 2 else "PNG")
    return buffer.getvalue()


def _colour(rng: random.Random, low: int, high: int) -> tuple[int, int, int]:
    return rng.randrange(low, high), rng.randrange(low, high), rng.randrange(low, high)


KINDS = ["PNG", "JPEG", "GIF", "RGBA"]
TEXTS = ["".join(random.Random(i).choices(ALPHABET, k=4 + i % 3)) for i in range(12)]
CAPTCHAS = [captcha(text, i, KINDS[i % 4]) for i, text in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest: Path = load(EXAMPLE / "prepare.py", "captcha_prepare").prepare(
        tmp_path_factory.mktemp("captcha")
    )
    return dest


@pytest.fixture(scope="module")
def served(prepared: Path) -> Iterator[ServerProcess]:
    log = prepared / "server.log"
    server = ServerProcess(
        "--plugins-dir", str(prepared / "plugins"), "--models-dir", str(prepared / "models"),
        "--grpc-port", "0", log=log,
    ).wait_ready(60)  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ocr() -> Any:
    return ddddocr.DdddOcr(show_ad=False)


@pytest.fixture(scope="module")
def det() -> Any:
    return ddddocr.DdddOcr(det=True, ocr=False, show_ad=False)


def v2(server: ServerProcess, route: str, blob: bytes) -> dict[str, Any]:
    body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                        "parameters": {"content_type": "base64"},
                        "data": [base64.b64encode(blob).decode()]}]}  # fmt: skip
    status, _, raw = server.request("POST", f"/v2/models/{route}/infer", body)
    assert status == 200, raw
    return {o["name"]: o for o in json.loads(raw)["outputs"]}


def read(server: ServerProcess, blob: bytes) -> str:
    text: str = v2(server, "captcha", blob)["text"]["data"][0]
    return text


def boxes(server: ServerProcess, blob: bytes) -> list[list[int]]:
    found = v2(server, "captcha-det", blob)["boxes"]
    data = np.array(found["data"], np.int64).reshape(found["shape"])
    return [[int(v) for v in box] for box in data]


def decoder(prepared: Path, name: str) -> Any:
    """The example's preprocessor ``name`` (image_decode, configured) as prepared."""
    folder = prepared / "plugins" / "preprocessor" / name / "1.0.0"
    module = import_plugin(folder, "plugin.py", package_name("preprocessor", name, "1.0.0"))
    config = tomllib.loads((folder / "plugin.toml").read_text())["config"]
    return module.ImageDecode(config)


def test_the_ocr_input_is_the_library_s_own_bit_for_bit(prepared: Path, ocr: Any) -> None:
    component = decoder(prepared, "captcha_ocr_input")
    for blob in CAPTCHAS:
        got = component.process({"image": np.array([blob], dtype=object)}, context())["input1"]
        want = ocr.ocr_engine._preprocess_image(Image.open(io.BytesIO(blob)), False)
        assert got.shape == want.shape and np.array_equal(got, want)


def test_the_detector_input_is_the_library_s_own_bit_for_bit(prepared: Path, det: Any) -> None:
    import cv2

    component = decoder(prepared, "captcha_det_input")
    for blob in [clicks(seed) for seed in range(4)] + CAPTCHAS[:4]:
        got = component.process({"image": np.array([blob], dtype=object)}, context())["images"]
        image = cv2.imdecode(np.frombuffer(blob, np.uint8), cv2.IMREAD_COLOR)
        want, _ = det.detection_engine.preproc(image, (416, 416))
        assert got.shape == (1, *want.shape) and np.array_equal(got[0], want)


def test_the_route_reads_what_the_library_reads(served: ServerProcess, ocr: Any) -> None:
    expected = [ocr.classification(blob) for blob in CAPTCHAS]
    assert [read(served, blob) for blob in CAPTCHAS] == expected
    right = sum(want.lower() == text.lower() for want, text in zip(expected, TEXTS, strict=True))
    assert right >= len(TEXTS) // 2, (expected, TEXTS)  # the model reads these captchas


def test_a_predict_body_and_concurrent_requests_read_the_same(
    served: ServerProcess, ocr: Any
) -> None:
    blob = CAPTCHAS[0]
    status, _, raw = served.request(
        "POST", "/predict/captcha", blob, headers={"Content-Type": "image/png"}
    )
    assert status == 200, raw
    assert json.loads(raw)["text"] == [ocr.classification(blob)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda blob: read(served, blob), CAPTCHAS))
    assert answers == [ocr.classification(blob) for blob in CAPTCHAS]


def test_the_detector_route_finds_the_library_s_boxes(served: ServerProcess, det: Any) -> None:
    images = [clicks(seed) for seed in range(8)]
    expected = [det.detection(blob) for blob in images]
    assert [boxes(served, blob) for blob in images] == expected
    assert sum(len(found) for found in expected) >= len(images)  # it finds characters


def test_what_is_not_one_image_is_a_400_naming_it(served: ServerProcess) -> None:
    status, _, raw = served.request(
        "POST", "/predict/captcha", b"GIF89a not really", headers={"Content-Type": "image/gif"}
    )
    assert status == 400, raw
    assert "image 0 cannot be decoded" in json.loads(raw)["error"]
    body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [2],
                        "parameters": {"content_type": "base64"},
                        "data": [base64.b64encode(CAPTCHAS[1]).decode()] * 2}]}  # fmt: skip
    status, _, raw = served.request("POST", "/v2/models/captcha/infer", body)
    assert status == 400, raw  # the model takes one image at a time
    assert "'input1'" in json.loads(raw)["error"]
