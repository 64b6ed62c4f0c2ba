"""``image_decode`` 1.1.0's options for real models: resize modes that keep the aspect,
the resample filter, the channel order and when the colour conversion happens, the
letterbox anchor and fill, a centre crop, the rounding of a side, scale as a division,
OpenCV as the decoder; how each bounds a request, and the configurations it refuses."""

from __future__ import annotations

import io
import sys
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageFile

from plugserve.registry.errors import InvalidInput
from tests.plugins.bundled import context
from tests.plugins.preprocessor.test_image_decode import LATEST, decoder, encoded, images, saved


def decode(blob: bytes, **config: Any) -> tuple[np.ndarray, list[dict[str, Any]] | None]:
    ctx = context()
    out = decoder(LATEST, **config).process(images(blob), ctx)
    return out[config.get("output", "image")], ctx.state.get("image_decode")


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize(
    ("resize", "size", "source", "shape"),
    [
        ("height", 64, (120, 40), (64, 192)),
        ("width", 100, (120, 40), (33, 100)),  # 40 * 100 / 120 = 33.3
        ("shorter", 256, (300, 200), (256, 384)),
        ("shorter", 256, (200, 300), (384, 256)),
        ("longer", 100, (300, 200), (67, 100)),  # 66.7 rounds up
        ("longer", 100, (200, 300), (100, 67)),
    ],
)
def test_one_side_is_given_and_the_other_follows_the_aspect(
    resize: str, size: int, source: tuple[int, int], shape: tuple[int, int]
) -> None:
    out, placed = decode(saved(noise(*source), "PNG"), resize=resize, size=size)
    assert out.shape == (1, 3, *shape)
    assert placed is not None and placed[0]["width"] == source[0]
    assert placed[0]["scale"] == pytest.approx(shape[1] / source[0], rel=0.02)


@pytest.mark.parametrize(
    ("rounding", "width"),
    [("round", 128), ("floor", 128), ("int", 127)],  # 98 * (64 / 49) is 127.99999999999999
)
def test_rounding_makes_a_side_whole_as_the_model_s_library_does(rounding: str, width: int) -> None:
    out, _ = decode(saved(noise(98, 49), "PNG"), resize="height", size=64, rounding=rounding)
    assert out.shape == (1, 3, 64, width)


def test_floor_is_the_whole_number_below_the_exact_side() -> None:
    """(The one torchvision's ``Resize(int)`` takes: ``int(256 * long / short)``.)"""
    out, _ = decode(saved(noise(3, 5), "PNG"), resize="shorter", size=256, rounding="floor")
    assert out.shape == (1, 3, 426, 256)  # 5 * 256 / 3 = 426.67
    out, _ = decode(saved(noise(3, 5), "PNG"), resize="shorter", size=256, rounding="round")
    assert out.shape == (1, 3, 427, 256)


def test_letterbox_top_left_pads_right_and_below_with_fill_per_channel() -> None:
    blob = encoded(40, 20, (200, 10, 10))
    out, placed = decode(
        blob, size=[64, 64], resize="letterbox", anchor="top_left", fill=[1, 2, 3],
        layout="NHWC", datatype="UINT8",
    )  # fmt: skip
    assert out[0, 0, 0].tolist() == [200, 10, 10]
    assert out[0, 31, 63].tolist() == [200, 10, 10]
    assert out[0, 32, 0].tolist() == [1, 2, 3]
    assert placed == [{"width": 40, "height": 20, "scale": 1.6, "pad_x": 0, "pad_y": 0}]
    centred, placed = decode(blob, size=[64, 64], resize="letterbox", layout="NHWC",
                             datatype="UINT8")  # fmt: skip
    assert centred[0, 0, 0].tolist() == [114, 114, 114]
    assert placed is not None and placed[0]["pad_y"] == 16


def test_bgr_reverses_the_colour_channels_and_keeps_alpha_last() -> None:
    blob = encoded(4, 4, (200, 100, 50, 25), mode="RGBA")
    bgr, _ = decode(blob, mode="BGR", size=[], datatype="UINT8", layout="NHWC")
    assert bgr[0, 0, 0].tolist() == [50, 100, 200]
    bgra, _ = decode(blob, mode="BGRA", size=[], datatype="UINT8", layout="NHWC")
    assert bgra[0, 0, 0].tolist() == [50, 100, 200, 25]


def test_grey_after_resizing_is_the_colour_image_resized_then_made_grey() -> None:
    image = noise(37, 23, seed=3)
    blob = saved(image, "PNG")
    config = {"mode": "L", "size": [16, 16], "resample": "lanczos", "datatype": "UINT8"}
    after, _ = decode(blob, convert="after_resize", **config)
    before, _ = decode(blob, **config)
    resized = image.resize((16, 16), Image.Resampling.LANCZOS)
    assert np.array_equal(after[0, 0], np.asarray(resized.convert("L")))
    grey = image.convert("L").resize((16, 16), Image.Resampling.LANCZOS)
    assert np.array_equal(before[0, 0], np.asarray(grey))
    assert not np.array_equal(after, before)


@pytest.mark.parametrize(
    "resample", ["nearest", "box", "bilinear", "hamming", "bicubic", "lanczos"]
)
def test_each_pillow_filter_is_pillow_s_own(resample: str) -> None:
    image = noise(50, 30, seed=1)
    out, _ = decode(saved(image, "PNG"), size=[20, 12], resample=resample, datatype="UINT8",
                    layout="NHWC")  # fmt: skip
    filters = {f.name.lower(): f for f in Image.Resampling}
    assert np.array_equal(out[0], np.asarray(image.resize((20, 12), filters[resample])))


def test_a_centre_crop_cuts_as_torchvision_s_and_pads_what_is_short() -> None:
    """A 7 x 4 image cropped to 4 x 6: 3 columns cut, round(1.5) = 2 of them on the left
    (half to even); 2 rows short, padded with fill, one above."""
    pixels = np.arange(7 * 4, dtype=np.uint8).reshape(4, 7)
    blob = saved(Image.fromarray(pixels, "L"), "PNG")
    out, placed = decode(blob, mode="L", size=[], crop=[4, 6], fill=99, datatype="UINT8")
    expected = np.full((6, 4), 99, np.uint8)
    expected[1:5] = pixels[:, 2:6]
    assert np.array_equal(out[0, 0], expected)
    assert placed == [{"width": 7, "height": 4, "scale": 1.0, "pad_x": -2, "pad_y": 1}]


def test_scale_as_a_fraction_divides_as_the_model_s_library_does() -> None:
    """``x / 255.0`` and ``x * (1 / 255)`` differ in the last bit for about half the
    values: ``"1/255"`` gives the first, a number the second."""
    row = np.arange(256, dtype=np.uint8).reshape(1, 256)
    blob = saved(Image.fromarray(row, "L"), "PNG")
    divided, _ = decode(blob, mode="L", size=[], scale="1/255")
    multiplied, _ = decode(blob, mode="L", size=[], scale=1 / 255)
    assert np.array_equal(divided[0, 0, 0], row[0].astype(np.float32) / 255.0)
    assert np.array_equal(multiplied[0, 0, 0], row[0].astype(np.float32) * np.float32(1 / 255))
    assert not np.array_equal(divided, multiplied)


def test_images_of_different_widths_at_one_height_are_refused_together() -> None:
    with pytest.raises(InvalidInput, match="different sizes"):
        decoder(LATEST, resize="height", size=8).process(
            images(encoded(8, 8, (0, 0, 0)), encoded(16, 8, (0, 0, 0))), context()
        )


def test_what_an_image_becomes_at_one_side_counts_toward_max_pixels_before_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 4000 x 10 PNG at height 64 becomes 25600 x 64 (1.6 MP) from a few hundred bytes;
    a 10 x 4000 one could be the same image turned by its EXIF orientation, and counts
    the same. Both refused from their headers, neither decoded."""

    def load(image: ImageFile.ImageFile) -> Any:
        raise AssertionError("an image was decoded")

    wide, tall = encoded(4000, 10, 0, mode="L"), encoded(10, 4000, 0, mode="L")
    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    component = decoder(LATEST, resize="height", size=64, max_pixels=1_000_000)
    for blob, header in ((wide, "4000x10"), (tall, "10x4000")):
        with pytest.raises(
            InvalidInput, match=rf"\(image 0: {header}, 1 frame\(s\), made 25600x64"
        ):
            component.process(images(blob), context())


def test_a_deep_image_keeps_its_depth_through_the_new_modes() -> None:
    blob = saved(Image.new("I;16", (8, 4), 65535 // 5), "PNG")  # 51 in 8-bit units
    out, _ = decode(blob, mode="BGR", convert="after_resize", resize="height", size=8,
                    scale=1.0)  # fmt: skip
    assert out.shape == (1, 3, 8, 16)
    np.testing.assert_allclose(out, 51.0, rtol=1e-5)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"resize": "fit"}, "resize is one of stretch, letterbox, height"),
        ({"resize": "height", "size": [64, 64]}, "size is one positive integer, the height"),
        ({"resize": "letterbox", "size": 64}, r"size is \[width, height\]"),
        ({"resample": "area"}, 'resample is one of .* with library = "pillow"'),
        ({"library": "opencv", "resample": "hamming"}, 'with library = "opencv"'),
        ({"library": "opencv", "mode": "RGBA"}, "mode is one of BGR, RGB, L"),
        ({"library": "skimage"}, "library is one of pillow, opencv"),
        ({"mode": "XYZ"}, "no Pillow mode"),
        ({"convert": "later"}, "convert is one of before_resize, after_resize"),
        ({"anchor": "bottom"}, "anchor is one of center, top_left"),
        ({"rounding": "ceil"}, "rounding is one of round, floor, int"),
        ({"crop": [224]}, r"crop is \[width, height\]"),
        ({"resize": "letterbox", "crop": [8, 8]}, "crop does not go with"),
        ({"fill": [1, 2]}, "fill has 2 values for 3 channels"),
        ({"scale": "2/255"}, r'scale is a number or "1/N"'),
        ({"mean": [0.5], "std": [0.5]}, "mode RGB has 3 channels"),
    ],
)
def test_a_wrong_option_fails_the_load_naming_it(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decoder(LATEST, **config)


def test_opencv_asked_for_where_it_is_not_installed_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "cv2", None)  # import cv2 raises ImportError
    with pytest.raises(ImportError, match="pip install opencv-python-headless"):
        decoder(LATEST, library="opencv")


class TestOpenCV:
    """``library = "opencv"``: the image as ``cv2.imdecode``, ``cv2.cvtColor`` and
    ``cv2.resize`` make it, with the same bounds as through Pillow."""

    @pytest.fixture(autouse=True)
    def _cv2(self) -> Any:
        return pytest.importorskip("cv2")

    @pytest.mark.parametrize(
        ("mode", "convert", "resample", "code", "flag"),
        [
            ("BGR", "before_resize", "bilinear", None, "INTER_LINEAR"),
            ("RGB", "before_resize", "area", "COLOR_BGR2RGB", "INTER_AREA"),
            ("L", "after_resize", "lanczos", "COLOR_BGR2GRAY", "INTER_LANCZOS4"),
            ("L", "before_resize", "bicubic", "COLOR_BGR2GRAY", "INTER_CUBIC"),
        ],
    )
    def test_the_pixels_are_opencv_s_own(
        self, mode: str, convert: str, resample: str, code: str | None, flag: str
    ) -> None:
        import cv2

        blob = saved(noise(61, 35, seed=2), "PNG")
        out, _ = decode(blob, library="opencv", mode=mode, convert=convert, resize="height",
                        size=24, resample=resample, rounding="int", datatype="UINT8",
                        layout="NHWC")  # fmt: skip
        image = cv2.imdecode(np.frombuffer(blob, np.uint8), cv2.IMREAD_COLOR)
        size = (int(61 * (24 / 35)), 24)
        if code is not None and convert == "before_resize":
            image = cv2.cvtColor(image, getattr(cv2, code))
        image = cv2.resize(image, size, interpolation=getattr(cv2, flag))
        if code is not None and convert == "after_resize":
            image = cv2.cvtColor(image, getattr(cv2, code))
        assert np.array_equal(out[0], image.reshape(out.shape[1:]))

    def test_bilinear_through_opencv_is_not_pillow_s(self) -> None:
        """Pillow widens its filter when it shrinks an image (antialiasing); OpenCV's
        INTER_LINEAR does not: a model trained on one sees other pixels from the other."""
        blob = saved(noise(200, 200), "PNG")
        config = {"size": [50, 50], "datatype": "UINT8"}
        pillow, _ = decode(blob, **config)
        opencv, _ = decode(blob, library="opencv", mode="RGB", **config)
        assert np.abs(pillow.astype(int) - opencv.astype(int)).max() > 30

    def test_exif_orientation_is_applied_and_max_pixels_counts_from_the_header(self) -> None:
        stored = Image.new("RGB", (4, 2), (0, 0, 255))
        stored.paste((255, 0, 0), (0, 0, 2, 2))
        exif = Image.Exif()
        exif[0x0112] = 6
        blob = saved(stored, "JPEG", exif=exif, quality=100)
        out, placed = decode(blob, library="opencv", mode="RGB", size=[], resize="letterbox",
                             datatype="UINT8", layout="NHWC")  # fmt: skip
        assert out.shape == (1, 4, 2, 3) and placed is not None and placed[0]["width"] == 2
        assert out[0, 0, 0, 0] > 200 and out[0, 3, 1, 2] > 200  # red on top, blue below
        with pytest.raises(InvalidInput, match="over max_pixels = 1000 pixels"):
            decoder(LATEST, library="opencv", max_pixels=1000).process(
                images(encoded(40, 30, 0)), context()
            )

    @pytest.mark.parametrize("kind", ["PNG", "JPEG", "WEBP", "GIF", "TIFF", "BMP"])
    def test_a_truncated_file_is_a_400(self, kind: str) -> None:
        data = saved(noise(48, 48, seed=4), kind)
        component = decoder(LATEST, library="opencv", size=[8, 8])
        for cut in range(len(data) // 2, len(data) - 1, max(1, len(data) // 16)):
            with pytest.raises(InvalidInput, match="image 0 cannot be decoded"):
                component.process(images(data[:cut]), context())
        assert component.process(images(data), context())["image"].shape == (1, 3, 8, 8)

    def test_a_format_pillow_knows_by_no_signature_never_reaches_opencv(self) -> None:
        """A TGA file has no magic bytes: OpenCV could take its bytes for another format
        whose size Pillow never read. Refused before OpenCV decodes anything."""
        component = decoder(LATEST, library="opencv", size=[8, 8])
        buffer = io.BytesIO()
        Image.new("RGB", (4, 4), (1, 2, 3)).save(buffer, "TGA")
        with pytest.raises(InvalidInput, match="OpenCV is not given TGA files"):
            component.process(images(buffer.getvalue()), context())

    def test_a_file_only_pillow_reads_is_a_400(self) -> None:
        """Headers are read by Pillow (bounds are counted from them), the pixels by OpenCV:
        a file that OpenCV cannot decode is refused like a corrupt one."""
        component = decoder(LATEST, library="opencv", size=[8, 8])
        image = Image.new("RGB", (4, 4), (1, 2, 3))
        buffer = io.BytesIO()
        image.save(buffer, "ICO", sizes=[(4, 4)])  # Pillow reads it; OpenCV does not
        with pytest.raises(InvalidInput, match="image 0 cannot be decoded"):
            component.process(images(buffer.getvalue()), context())
