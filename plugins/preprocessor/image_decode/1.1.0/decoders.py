"""Decoding, colour conversion and resizing, by Pillow or by OpenCV, as a model's own
library does them: each returns an image's pixels as ``[H, W, C]`` (``uint8``, or
``float32`` in 8-bit units for a deep image), resized by its :class:`~.geometry.Plan` but
not yet laid on a canvas.

``load`` reads the whole file, and is where anything wrong with it is raised (the caller
turns that into a 400); ``pixels`` works on what ``load`` read."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from .geometry import Plan
from .options import ORDERED, Options


@dataclass(frozen=True)
class Loaded:
    """A file read whole: the library's own image (a Pillow image, or OpenCV's array)
    and its size, its EXIF orientation applied."""

    image: Any
    width: int
    height: int


PILLOW_FILTERS = {
    "nearest": Image.Resampling.NEAREST,
    "box": Image.Resampling.BOX,
    "bilinear": Image.Resampling.BILINEAR,
    "hamming": Image.Resampling.HAMMING,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
DEEP = {
    "I": 255 / 65535, "I;16": 255 / 65535, "I;16B": 255 / 65535, "I;16L": 255 / 65535,
    "I;16N": 255 / 65535, "F": 255.0,
}  # fmt: skip
"""Pillow's modes of more than 8 bits a channel, and what turns their values into 8-bit
units (Pillow reads 16-bit PNG and TIFF grey as ``I;16`` or ``I``)."""
DEEP_MODES = {"L": 1, "LA": 1, "RGB": 3, "RGBA": 3, "BGR": 3, "BGRA": 3}
"""The target modes a deep image is converted to without losing its depth: its grey
repeated, alpha opaque."""


class PillowDecoder:
    """``Image.open``, its EXIF orientation applied, ``convert`` and ``resize`` as a
    library on Pillow calls them. A palette or bilevel image is resized by Pillow with
    the nearest neighbour whatever ``resample`` says, as it is in that library."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.filter = PILLOW_FILTERS[options.resample]

    def load(self, image: Image.Image, blob: bytes) -> Loaded:
        ImageOps.exif_transpose(image, in_place=True)
        image.load()
        return Loaded(image, image.width, image.height)

    def pixels(self, loaded: Loaded) -> tuple[np.ndarray, Plan]:
        image: Image.Image = loaded.image
        plan = self.options.geometry.plan(image.width, image.height)
        if image.mode in DEEP and self.options.mode in DEEP_MODES:
            return self._deep(image, plan), plan
        mode, after = self.options.pillow_mode, self.options.convert == "after_resize"
        if not after:
            image = image.convert(mode)
        if plan.resized is not None:
            image = image.resize(plan.resized, self.filter)
        if after:
            image = image.convert(mode)
        pixels = np.asarray(image)
        if self.options.mode in ORDERED:
            pixels = np.concatenate([pixels[:, :, 2::-1], pixels[:, :, 3:]], axis=2)
        return _hwc(pixels), plan

    def _deep(self, image: Image.Image, plan: Plan) -> np.ndarray:
        """A deep image as one ``F`` grey in 8-bit units, resized once, then repeated to
        the mode's channels (an opaque alpha added)."""
        units = np.asarray(image, dtype=np.float32) * np.float32(DEEP[image.mode])
        grey = Image.fromarray(np.ascontiguousarray(units), "F")
        if plan.resized is not None:
            grey = grey.resize(plan.resized, self.filter)
        values = np.asarray(grey, dtype=np.float32)
        bands = [values] * DEEP_MODES[self.options.mode]
        if self.options.mode.endswith("A"):
            bands.append(np.full_like(values, 255.0))
        return np.stack(bands, axis=-1)


class OpenCVDecoder:
    """``cv2.imdecode(buffer, cv2.IMREAD_COLOR)`` (BGR, 8 bits: a 16-bit image's values
    shifted right by 8, alpha dropped, EXIF orientation applied), ``cv2.cvtColor`` to
    ``mode`` and ``cv2.resize``, as a library on OpenCV calls them."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.cv2 = opencv()
        self.filter = {
            "nearest": self.cv2.INTER_NEAREST,
            "bilinear": self.cv2.INTER_LINEAR,
            "bicubic": self.cv2.INTER_CUBIC,
            "lanczos": self.cv2.INTER_LANCZOS4,
            "area": self.cv2.INTER_AREA,
        }[options.resample]
        self.conversion = {
            "BGR": None,
            "RGB": self.cv2.COLOR_BGR2RGB,
            "L": self.cv2.COLOR_BGR2GRAY,
        }[options.mode]

    def load(self, image: Image.Image, blob: bytes) -> Loaded:
        """The file decoded by OpenCV. Its header was read by Pillow (``max_pixels`` is
        counted from it): a decoded size other than the header's, turned or not, is an
        error, and so is a JPEG cut short, which some OpenCV versions decode with its
        missing part grey (Pillow reads it through at an eighth of its size to see)."""
        header = image.width, image.height
        signatures = OPENCV_SIGNATURES.get(image.format or "", ())
        webp = image.format != "WEBP" or blob[8:12] == b"WEBP"
        if not webp or not any(blob.startswith(signature) for signature in signatures):
            # OpenCV picks its decoder by the file's first bytes too: only a file both read
            # as one format has pixels max_pixels (counted from Pillow's header) bounds.
            raise ValueError(f"OpenCV is not given {image.format or 'this format'} files here")
        if image.format == "JPEG":
            image.draft(None, (1, 1))  # decodes at 1/8 scale, reading every byte
            image.load()
        decoded = self.cv2.imdecode(np.frombuffer(blob, np.uint8), self.cv2.IMREAD_COLOR)
        if decoded is None:
            raise ValueError("OpenCV cannot decode it")
        height, width = decoded.shape[:2]
        if (width, height) not in (header, header[::-1]):
            raise ValueError(
                f"OpenCV decodes it to {width}x{height}, its header says {header[0]}x{header[1]}"
            )
        return Loaded(np.asarray(decoded), width, height)

    def pixels(self, loaded: Loaded) -> tuple[np.ndarray, Plan]:
        image: np.ndarray = loaded.image
        plan = self.options.geometry.plan(loaded.width, loaded.height)
        after = self.options.convert == "after_resize"
        if not after:
            image = self._converted(image)
        if plan.resized is not None:
            image = self.cv2.resize(image, plan.resized, interpolation=self.filter)
        if after:
            image = self._converted(image)
        return _hwc(image), plan

    def _converted(self, image: np.ndarray) -> np.ndarray:
        if self.conversion is None:
            return image
        return np.asarray(self.cv2.cvtColor(image, self.conversion))


OPENCV_SIGNATURES: dict[str, tuple[bytes, ...]] = {
    "PNG": (b"\x89PNG\r\n\x1a\n",),
    "JPEG": (b"\xff\xd8\xff",),
    "GIF": (b"GIF87a", b"GIF89a"),
    "BMP": (b"BM",),
    "TIFF": (b"II*\x00", b"MM\x00*"),
    "WEBP": (b"RIFF",),
}
"""The formats decoded through OpenCV, by Pillow's name, and the first bytes by which both
libraries know them (a WebP file's ``WEBP`` tag follows at byte 8)."""


def opencv() -> ModuleType:
    """The ``cv2`` module, or an ``ImportError`` that says how to install it."""
    try:
        import cv2
    except ImportError as exc:
        raise ImportError(
            'image_decode: library = "opencv" needs OpenCV, which is not installed here: '
            'pip install opencv-python-headless (or use library = "pillow")'
        ) from exc
    return cv2


def decoder(options: Options) -> PillowDecoder | OpenCVDecoder:
    return OpenCVDecoder(options) if options.library == "opencv" else PillowDecoder(options)


def _hwc(pixels: Any) -> np.ndarray:
    array = np.asarray(pixels)
    return array[:, :, np.newaxis] if array.ndim == 2 else array
