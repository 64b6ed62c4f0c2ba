"""The bundled ``image_decode`` preprocessor, called directly: decode, convert, resize or
letterbox, scale and normalize, lay out; and what it refuses."""

from __future__ import annotations

import io
import tomllib
from typing import Any

import numpy as np
import pytest
from PIL import Image

from plugserve.registry.errors import InvalidInput
from tests.plugins.bundled import context, create_component, folder


def encoded(width: int, height: int, color: Any, kind: str = "PNG", mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), color).save(buffer, kind)
    return buffer.getvalue()


def decoder(**config: Any) -> Any:
    component = create_component("preprocessor", "image_decode")
    if config:  # the bundled defaults, with these changed
        defaults = tomllib.loads((folder("preprocessor", "image_decode") / "plugin.toml").read_text())
        module = type(component)
        component = module({**defaults["config"], **config}, InvalidInput)
    return component


def images(*blobs: bytes) -> dict[str, np.ndarray]:
    return {"image": np.array(blobs, dtype=object)}


def test_images_of_any_size_leave_as_one_nchw_batch_scaled_to_0_1() -> None:
    out = decoder().process(
        images(encoded(10, 20, (255, 0, 0)), encoded(300, 100, (0, 128, 255), "JPEG")),
        context(),
    )["image"]
    assert out.shape == (2, 3, 224, 224) and out.dtype == np.float32
    assert out[0, :, 5, 5].tolist() == [1.0, 0.0, 0.0]
    np.testing.assert_allclose(out[1, :, 100, 100], [0, 128 / 255, 1], atol=0.02)  # JPEG


def test_letterbox_keeps_the_aspect_and_says_where_the_image_went() -> None:
    ctx = context()
    out = decoder(size=[64, 64], resize="letterbox", layout="NHWC", datatype="UINT8").process(
        images(encoded(64, 32, (200, 10, 10))), ctx
    )["image"]
    assert out.shape == (1, 64, 64, 3) and out.dtype == np.uint8
    assert out[0, 0, 0].tolist() == [114, 114, 114]  # padding above
    assert out[0, 32, 32].tolist() == [200, 10, 10]
    assert ctx.state["image_decode"] == [
        {"width": 64, "height": 32, "scale": 1.0, "pad_x": 0, "pad_y": 16}
    ]


def test_grey_images_normalized_per_channel() -> None:
    out = decoder(mode="L", size=[8, 8], mean=[0.5], std=[0.25]).process(
        images(encoded(8, 8, 255, mode="L")), context()
    )["image"]
    assert out.shape == (1, 1, 8, 8)
    np.testing.assert_allclose(out, 2.0)  # (1 - 0.5) / 0.25


def test_other_inputs_pass_through_and_output_may_be_renamed() -> None:
    out = decoder(output="pixels").process(
        {**images(encoded(4, 4, (0, 0, 0))), "threshold": np.array([0.5])}, context()
    )
    assert sorted(out) == ["pixels", "threshold"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (images(b"not an image"), "image 0 cannot be decoded"),
        ({"other": np.array([b"x"], dtype=object)}, "expects input 'image'"),
        (images(), "holds no image"),
        ({"image": np.array([1.5], dtype=object)}, "image 0 is float, not encoded bytes"),
    ],
)
def test_what_is_not_an_image_is_a_clear_400(data: Any, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        decoder().process(data, context())


def test_a_decompression_bomb_is_refused_before_it_is_decoded() -> None:
    bomb = encoded(4000, 4000, 0, mode="L")  # 16 MP, a few KiB of PNG
    with pytest.raises(InvalidInput, match="over 1000000 pixels"):
        decoder(max_pixels=1_000_000).process(images(bomb), context())


def test_images_of_different_sizes_without_a_size_are_refused() -> None:
    with pytest.raises(InvalidInput, match="different sizes"):
        decoder(size=[]).process(
            images(encoded(4, 4, (0, 0, 0)), encoded(5, 4, (0, 0, 0))), context()
        )
