"""The bundled ``image_decode`` preprocessor, called directly: decode, convert, resize or
letterbox, scale and normalize, lay out; and what it refuses. What 1.0.0 does, 1.1.0 does
the same under the same options (each test here runs on both); 1.1.0's own options are
tested in test_image_decode_options.py, and its recipes against their reference libraries
in test_image_decode_recipes.py."""

from __future__ import annotations

import functools
import io
import struct
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import structlog
from PIL import Image, ImageFile

from plugserve.registry.errors import InvalidInput
from plugserve.registry.plugins.imports import import_plugin, package_name
from plugserve.registry.types import PluginInfo
from tests.plugins.bundled import PLUGINS, context

VERSIONS = ["1.0.0", "1.1.0"]
LATEST = VERSIONS[-1]


@pytest.fixture(params=VERSIONS)
def version(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def where(version: str) -> Path:
    return PLUGINS / "preprocessor" / "image_decode" / version


@functools.cache
def module(version: str) -> ModuleType:
    """The version's ``plugin.py``, imported as the server imports it (a package of its
    own, so its sibling modules import relatively)."""
    package = package_name("preprocessor", "image_decode", version)
    return import_plugin(where(version), "plugin.py", package)


def decoder(version: str, **config: Any) -> Any:
    """The version's component, made by its own hook from its bundled ``[config]`` with
    ``config`` changed."""
    defaults = tomllib.loads((where(version) / "plugin.toml").read_text())["config"]
    info = PluginInfo(
        "image_decode", version, "preprocessor", where(version), structlog.get_logger()
    )
    return module(version).plugserve_create_component(plugin=info, config={**defaults, **config})


def encoded(width: int, height: int, color: Any, kind: str = "PNG", mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height), color).save(buffer, kind)
    return buffer.getvalue()


def images(*blobs: bytes) -> dict[str, np.ndarray]:
    return {"image": np.array(blobs, dtype=object)}


def test_images_of_any_size_leave_as_one_nchw_batch_scaled_to_0_1(version: str) -> None:
    out = decoder(version).process(
        images(encoded(10, 20, (255, 0, 0)), encoded(300, 100, (0, 128, 255), "JPEG")),
        context(),
    )["image"]
    assert out.shape == (2, 3, 224, 224) and out.dtype == np.float32
    assert out[0, :, 5, 5].tolist() == [1.0, 0.0, 0.0]
    np.testing.assert_allclose(out[1, :, 100, 100], [0, 128 / 255, 1], atol=0.02)  # JPEG


def test_letterbox_keeps_the_aspect_and_says_where_the_image_went(version: str) -> None:
    ctx = context()
    out = decoder(
        version, size=[64, 64], resize="letterbox", layout="NHWC", datatype="UINT8"
    ).process(images(encoded(64, 32, (200, 10, 10))), ctx)["image"]
    assert out.shape == (1, 64, 64, 3) and out.dtype == np.uint8
    assert out[0, 0, 0].tolist() == [114, 114, 114]  # padding above
    assert out[0, 32, 32].tolist() == [200, 10, 10]
    assert ctx.state["image_decode"] == [
        {"width": 64, "height": 32, "scale": 1.0, "pad_x": 0, "pad_y": 16}
    ]


def test_grey_images_normalized_per_channel(version: str) -> None:
    out = decoder(version, mode="L", size=[8, 8], mean=[0.5], std=[0.25]).process(
        images(encoded(8, 8, 255, mode="L")), context()
    )["image"]
    assert out.shape == (1, 1, 8, 8)
    np.testing.assert_allclose(out, 2.0)  # (1 - 0.5) / 0.25


def test_other_inputs_pass_through_and_output_may_be_renamed(version: str) -> None:
    out = decoder(version, output="pixels").process(
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
def test_what_is_not_an_image_is_a_clear_400(version: str, data: Any, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        decoder(version).process(data, context())


def test_a_decompression_bomb_is_refused_before_it_is_decoded(version: str) -> None:
    bomb = encoded(4000, 4000, 0, mode="L")  # 16 MP, a few KiB of PNG
    with pytest.raises(InvalidInput, match="over max_pixels = 1000000 pixels"):
        decoder(version, max_pixels=1_000_000).process(images(bomb), context())


def test_images_of_different_sizes_without_a_size_are_refused(version: str) -> None:
    with pytest.raises(InvalidInput, match="different sizes"):
        decoder(version, size=[]).process(
            images(encoded(4, 4, (0, 0, 0)), encoded(5, 4, (0, 0, 0))), context()
        )


def gif(screen: int, frames: int = 1) -> bytes:
    """A GIF of ``frames`` 1x1 frames on a ``screen`` x ``screen`` logical screen, built byte
    by byte (35 bytes for one frame): Pillow decodes each frame onto the whole screen."""
    out = b"GIF89a" + struct.pack("<HHBBB", screen, screen, 0, 0, 0)  # no global palette
    for _ in range(frames):
        out += b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0x80)  # 1x1, a local palette
        out += b"\x00\x00\x00\xff\xff\xff" + b"\x02\x02\x44\x01\x00"  # LZW: clear, 0, end
    return out + b"\x3b"


def test_max_pixels_bounds_the_request_from_headers_before_any_image_is_decoded(
    version: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Six 35-byte GIFs, each 36 MP on screen and under max_pixels (40 MP), are 216 MP of
    decoding in a 430-byte request: refused, naming max_pixels, before any is decoded."""
    loads: list[object] = []
    real = ImageFile.ImageFile.load

    def load(image: ImageFile.ImageFile) -> Any:
        loads.append(image)
        return real(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    with pytest.raises(
        InvalidInput, match=r"over max_pixels = 40000000 pixels \(image 1: 6000x6000"
    ):
        decoder(version).process(images(*[gif(6000)] * 6), context())
    assert loads == []


def test_every_frame_of_an_animated_image_counts_toward_max_pixels(version: str) -> None:
    decoder(version, max_pixels=1000, size=[2, 2]).process(images(gif(20, frames=2)), context())
    with pytest.raises(InvalidInput, match=r"20x20, 3 frame\(s\), made 2x2; 1200"):
        decoder(version, max_pixels=1000, size=[2, 2]).process(images(gif(20, frames=3)), context())


def test_many_tiny_images_count_what_they_become_before_any_is_decoded(
    version: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """2000 copies of a 35-byte 1x1 GIF (70 KB) would each become 3 x 224 x 224 floats
    (1.2 GB in all): each counts 224 x 224 pixels toward max_pixels, refused before any
    is decoded."""

    def load(image: ImageFile.ImageFile) -> Any:
        raise AssertionError("an image was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    with pytest.raises(
        InvalidInput,
        match=r"over max_pixels = 40000000 pixels \(image 797: 1x1, 1 frame\(s\), made 224x224",
    ):
        decoder(version).process(images(*[gif(1)] * 2000), context())


def test_the_output_holds_at_most_max_pixels_times_the_channels(version: str) -> None:
    tiny = encoded(1, 1, (9, 9, 9))
    out = decoder(version, size=[8, 8], max_pixels=128).process(images(tiny, tiny), context())[
        "image"
    ]
    assert out.shape == (2, 3, 8, 8) and out.size == 3 * 128
    with pytest.raises(InvalidInput, match="over max_pixels = 128 pixels"):
        decoder(version, size=[8, 8], max_pixels=128).process(images(tiny, tiny, tiny), context())
    no_size = decoder(version, size=[], max_pixels=2).process(images(tiny, tiny), context())[
        "image"
    ]
    assert no_size.shape == (2, 3, 1, 1)


def saved(image: Image.Image, kind: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, kind, **options)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("image", "kind", "expected"),
    [
        (Image.new("I;16", (4, 4), 4096), "PNG", 4096 / 65535),  # 1/16 of full scale
        (Image.new("I;16", (4, 4), 4096), "TIFF", 4096 / 65535),
        (Image.new("F", (4, 4), 0.5), "TIFF", 0.5),  # a float image: 1.0 is full scale
    ],
)
def test_deep_images_reach_the_model_scaled_to_their_full_scale(
    version: str, image: Image.Image, kind: str, expected: float
) -> None:
    blob = saved(image, kind)
    for mode, channels in (("RGB", 3), ("L", 1), ("RGBA", 4)):
        out = decoder(version, mode=mode, size=[8, 8]).process(images(blob), context())["image"]
        assert out.shape == (1, channels, 8, 8)
        np.testing.assert_allclose(out[0, :3], expected, rtol=1e-4)
        if mode == "RGBA":
            np.testing.assert_allclose(out[0, 3], 1.0)  # opaque
    raw = decoder(version, mode="L", size=[], datatype="UINT8").process(images(blob), context())[
        "image"
    ]
    assert raw.dtype == np.uint8 and raw.flatten().tolist() == [round(expected * 255)] * 16


def test_a_letterboxed_deep_image_is_padded_with_fill(version: str) -> None:
    blob = saved(Image.new("I;16", (8, 4), 65535), "PNG")
    out = decoder(version, mode="RGB", size=[8, 8], resize="letterbox", fill=51).process(
        images(blob), context()
    )["image"]
    np.testing.assert_allclose(out[0, :, 0, 0], 0.2, rtol=1e-5)  # 51 / 255 above
    np.testing.assert_allclose(out[0, :, 4, 4], 1.0, rtol=1e-5)


def test_exif_orientation_turns_the_image_as_a_person_sees_it(version: str) -> None:
    """A phone's photo: stored 4 wide and 2 high, left half red, with EXIF Orientation 6
    (shown turned 90 degrees clockwise): the model gets it 2 wide, 4 high, red on top."""
    stored = Image.new("RGB", (4, 2), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 2, 2))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation
    ctx = context()
    out = decoder(version, size=[], resize="letterbox").process(
        images(saved(stored, "PNG", exif=exif)), ctx
    )["image"]
    assert out.shape == (1, 3, 4, 2)
    assert out[0, :, 0, 0].tolist() == [1.0, 0.0, 0.0]
    assert out[0, :, 3, 1].tolist() == [0.0, 0.0, 1.0]
    assert ctx.state["image_decode"][0]["width"] == 2


def two_idat_png() -> tuple[bytes, int]:
    """A PNG of noise whose image data fills two IDAT chunks, and where the second starts."""
    noise = np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8)
    data = saved(Image.fromarray(noise), "PNG")
    at, found = 8, []
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at : at + 8])
        if kind == b"IDAT":
            found.append(at)
        at += 12 + length
    assert len(found) >= 2
    return data, found[1]


@pytest.mark.parametrize("into", [4, 5, 6, 7])
def test_a_png_cut_inside_a_chunk_header_after_image_data_is_a_400(version: str, into: int) -> None:
    """Pillow raises SyntaxError for it, "broken PNG file": a 400, never a 500."""
    data, second = two_idat_png()
    with pytest.raises(InvalidInput, match="image 0 cannot be decoded"):
        decoder(version).process(images(data[: second + into]), context())


@pytest.mark.parametrize("kind", ["PNG", "GIF", "JPEG", "TIFF", "WEBP", "BMP"])
def test_any_truncated_or_corrupt_file_is_a_400_or_an_image(version: str, kind: str) -> None:
    noise = np.random.default_rng(1).integers(0, 256, (24, 24, 3), dtype=np.uint8)
    data = saved(Image.fromarray(noise), kind)
    broken = [data[:cut] for cut in range(0, len(data), max(1, len(data) // 40))]
    for at in range(0, len(data), max(1, len(data) // 40)):
        flipped = bytearray(data)
        flipped[at] ^= 0xA5
        broken.append(bytes(flipped))
    component = decoder(version, size=[8, 8], max_pixels=4096)
    for blob in broken:
        try:
            out = component.process(images(blob), context())["image"]
        except InvalidInput:
            continue
        assert out.shape == (1, 3, 8, 8)
