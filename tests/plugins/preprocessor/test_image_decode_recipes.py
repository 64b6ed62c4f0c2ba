"""docs/plugins.md's ``image_decode`` recipes, each against its model family's own
preprocessing written out here as the reference library writes it: a CRNN captcha OCR
(ddddocr's classification), a YOLOX letterbox (ddddocr's detection, on OpenCV) and an
ImageNet classifier (torchvision's Resize, CenterCrop, ToTensor, Normalize). Each tensor
is compared bit for bit. (tests/examples/test_captcha.py compares the first two with
ddddocr's own code, where it is installed.)"""

from __future__ import annotations

import io
import re
import tomllib
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.helpers import ROOT
from tests.plugins.bundled import context
from tests.plugins.preprocessor.test_image_decode import LATEST, decoder, images


def recipe(name: str) -> dict[str, Any]:
    """The ``[config]`` of the recipe docs/plugins.md heads with ``name``."""
    doc = (ROOT / "docs" / "plugins.md").read_text()
    found = re.search(rf"\n# {re.escape(name)}\n(.*?)```", doc, re.S)
    assert found, f"docs/plugins.md has no recipe {name!r}"
    config: dict[str, Any] = tomllib.loads(found.group(1))["config"]
    return config


def captchas() -> list[bytes]:
    """Captcha-like files of the kinds and sizes users send: noise behind coloured text
    in RGB, RGBA, palette and grey, as PNG, GIF and JPEG; sizes whose scaled width is
    within a rounding error of a whole number among them (98 x 49 at height 64)."""
    rng = np.random.default_rng(7)
    blobs = []
    for width, height in [(120, 40), (98, 49), (160, 60), (23, 10), (90, 35)]:
        pixels = rng.integers(150, 256, (height, width, 3), dtype=np.uint8)
        pixels[height // 3 : 2 * height // 3, width // 5 : 4 * width // 5] = rng.integers(
            0, 90, 3, dtype=np.uint8
        )
        image = Image.fromarray(pixels)
        for kind, mode in [("PNG", "RGB"), ("PNG", "RGBA"), ("GIF", "P"), ("JPEG", "L")]:
            converted = image.convert(mode)
            if mode == "RGBA":
                converted.putalpha(Image.fromarray(rng.integers(0, 256, (height, width), np.uint8)))
            buffer = io.BytesIO()
            converted.save(buffer, kind)
            blobs.append(buffer.getvalue())
    return blobs


def served(config: dict[str, Any], blob: bytes) -> tuple[np.ndarray, dict[str, Any] | None]:
    ctx = context()
    out = decoder(LATEST, **config).process(images(blob), ctx)
    return out[config["output"]], (ctx.state.get("image_decode") or [None])[0]


def crnn_reference(blob: bytes) -> np.ndarray:
    """ddddocr 1.6.1's ``OCREngine._preprocess_image`` for its bundled models."""
    image = Image.open(io.BytesIO(blob))
    width = int(image.size[0] * (64 / image.size[1]))
    image = image.resize((width, 64), Image.Resampling.LANCZOS).convert("L")
    array = np.array(image).astype(np.float32) / 255.0
    return array[np.newaxis, np.newaxis]


def test_crnn_ocr_input_is_ddddocr_s_bit_for_bit() -> None:
    config = recipe("CRNN captcha OCR (ddddocr)")
    for blob in captchas():
        got, _ = served(config, blob)
        want = crnn_reference(blob)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert np.array_equal(got, want)


def yolox_reference(blob: bytes) -> tuple[np.ndarray, float]:
    """ddddocr 1.6.1's ``DetectionEngine.get_bbox`` up to the model: ``preproc`` (YOLOX's
    own) on ``cv2.imdecode``."""
    import cv2

    img = cv2.imdecode(np.frombuffer(blob, np.uint8), cv2.IMREAD_COLOR)
    padded = np.ones((416, 416, 3), dtype=np.uint8) * 114
    r = min(416 / img.shape[0], 416 / img.shape[1])
    resized = cv2.resize(
        img, (int(img.shape[1] * r), int(img.shape[0] * r)), interpolation=cv2.INTER_LINEAR
    ).astype(np.uint8)
    padded[: int(img.shape[0] * r), : int(img.shape[1] * r)] = resized
    return np.ascontiguousarray(padded.transpose(2, 0, 1), dtype=np.float32)[np.newaxis], r


def test_yolox_letterbox_is_ddddocr_s_detection_input_bit_for_bit() -> None:
    """(23 x 10 among the sizes: ``int(23 * (416 / 23))`` is 415, so the image does not
    reach the right edge; the recipe's ``rounding = "int"`` keeps that.)"""
    pytest.importorskip("cv2")
    config = recipe("YOLOX detector letterbox (ddddocr)")
    for blob in captchas():
        got, placed = served(config, blob)
        want, ratio = yolox_reference(blob)
        assert got.shape == want.shape == (1, 3, 416, 416)
        assert np.array_equal(got, want)
        assert placed is not None and placed["scale"] == ratio


def imagenet_reference(blob: bytes) -> np.ndarray:
    """torchvision's ``Compose([Resize(256), CenterCrop(224), ToTensor(), Normalize(mean,
    std)])`` on a PIL image, step by step as torchvision.transforms.functional does it."""
    image = Image.open(io.BytesIO(blob)).convert("RGB")
    w, h = image.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = 256, int(256 * long / short)
    size = (new_short, new_long) if w <= h else (new_long, new_short)
    image = image.resize(size, Image.Resampling.BILINEAR)
    top = round((image.height - 224) / 2.0)
    left = round((image.width - 224) / 2.0)
    image = image.crop((left, top, left + 224, top + 224))
    tensor = np.asarray(image).transpose(2, 0, 1).astype(np.float32) / np.float32(255)
    mean = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
    std = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]
    return ((tensor - mean) / std)[np.newaxis]


@pytest.mark.parametrize(
    "size",
    [(500, 375), (375, 500), (257, 1000), (333, 333), (450, 301)],  # 382.7: floor, not round
)
def test_imagenet_input_is_torchvision_s_bit_for_bit(size: tuple[int, int]) -> None:
    rng = np.random.default_rng(size[0])
    photo = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    buffer = io.BytesIO()
    photo.save(buffer, "JPEG", quality=90)
    got, _ = served(recipe("ImageNet classifier (torchvision)"), buffer.getvalue())
    want = imagenet_reference(buffer.getvalue())
    assert got.shape == want.shape == (1, 3, 224, 224)
    assert np.array_equal(got, want)


def test_the_old_options_could_not_make_the_crnn_input() -> None:
    """What image_decode 1.0.0 offered at best (grey first, bilinear, a fixed size):
    another tensor, so another answer from the model."""
    blob = captchas()[0]
    want = crnn_reference(blob)
    got, _ = served(
        {"output": "x", "mode": "L", "size": [want.shape[3], 64], "scale": 1 / 255}, blob
    )
    assert got.shape == want.shape
    assert np.abs(got - want).max() > 0.05
