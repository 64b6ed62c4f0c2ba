"""The ``[config]`` table, checked once when the component is created: a wrong value
fails the load with a ``ValueError`` naming the key and what it takes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from .geometry import ANCHORS, RESIZES, ROUNDINGS, Geometry

DTYPES: dict[str, type[np.generic]] = {"FP32": np.float32, "FP16": np.float16, "UINT8": np.uint8}
LIBRARIES = ("pillow", "opencv")
CONVERTS = ("before_resize", "after_resize")
RESAMPLES = {
    "pillow": ("nearest", "box", "bilinear", "hamming", "bicubic", "lanczos"),
    "opencv": ("nearest", "bilinear", "bicubic", "lanczos", "area"),
}
"""The filters each library has under these names (OpenCV's ``lanczos`` is its
``INTER_LANCZOS4``, ``area`` its ``INTER_AREA``)."""
OPENCV_MODES = ("BGR", "RGB", "L")
ORDERED = {"BGR": "RGB", "BGRA": "RGBA"}
"""Channel orders Pillow has no mode for: converted to the mode on the right, then the
colour channels reversed."""


@dataclass(frozen=True)
class Options:
    input: str
    output: str
    library: str
    mode: str
    convert: str
    resample: str
    geometry: Geometry
    fill: tuple[float, ...]
    scale: float
    divisor: float | None
    mean: np.ndarray
    std: np.ndarray
    layout: str
    datatype: str
    max_pixels: int

    @property
    def channels(self) -> int:
        return channels(self.mode)

    @property
    def pillow_mode(self) -> str:
        """The Pillow mode the image is converted to (before any channel reordering)."""
        return ORDERED.get(self.mode, self.mode)


def channels(mode: str) -> int:
    return Image.getmodebands(ORDERED.get(mode, mode))


def parse(config: Mapping[str, Any]) -> Options:
    name = config.get("input", "image")
    library = _one_of(config, "library", LIBRARIES, "pillow")
    mode = str(config.get("mode", "RGB"))
    if library == "opencv" and mode not in OPENCV_MODES:
        raise ValueError(
            f'image_decode: with library = "opencv", mode is one of {", ".join(OPENCV_MODES)}'
        )
    try:
        bands = channels(mode)
    except (KeyError, ValueError):
        raise ValueError(
            f"image_decode: mode {mode!r} is no Pillow mode, nor BGR or BGRA"
        ) from None
    resize = _one_of(config, "resize", RESIZES, "stretch")
    geometry = Geometry(
        resize=resize,
        size=_size(config.get("size", [224, 224]), resize),
        rounding=_one_of(config, "rounding", ROUNDINGS, "round"),
        anchor=_one_of(config, "anchor", ANCHORS, "center"),
        crop=_crop(config.get("crop", []), resize),
    )
    scale, divisor = _scale(config.get("scale", 1 / 255))
    mean = np.asarray(config.get("mean", []), dtype=np.float32)
    std = np.asarray(config.get("std", []), dtype=np.float32)
    if mean.size != std.size or (std == 0).any():
        raise ValueError("image_decode: mean and std are per channel, as many of each, std not 0")
    if mean.size and mean.size != bands:
        raise ValueError(
            f"image_decode: mean and std have {mean.size} values; mode {mode} has {bands} channels"
        )
    return Options(
        input=name,
        output=config.get("output", name),
        library=library,
        mode=mode,
        convert=_one_of(config, "convert", CONVERTS, "before_resize"),
        resample=_one_of(
            config, "resample", RESAMPLES[library], "bilinear", f' with library = "{library}"'
        ),
        geometry=geometry,
        fill=_fill(config.get("fill", 114), bands),
        scale=scale,
        divisor=divisor,
        mean=mean,
        std=std,
        layout=_one_of(config, "layout", ("NCHW", "NHWC"), "NCHW"),
        datatype=_one_of(config, "datatype", tuple(DTYPES), "FP32"),
        max_pixels=int(config.get("max_pixels", 40_000_000)),
    )


def _one_of(
    config: Mapping[str, Any], key: str, allowed: tuple[str, ...], default: str, where: str = ""
) -> str:
    value = config.get(key, default)
    if value not in allowed:
        raise ValueError(
            f"image_decode: {key} is one of {', '.join(allowed)}{where}; got {value!r}"
        )
    return str(value)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _size(size: Any, resize: str) -> tuple[int, int] | None:
    if resize in ("stretch", "letterbox"):
        if isinstance(size, list) and not size:
            return None
        if isinstance(size, list) and len(size) == 2 and all(_positive(v) for v in size):
            return size[0], size[1]
        raise ValueError(
            f'image_decode: with resize = "{resize}", size is [width, height] of positive '
            "integers, or []"
        )
    if _positive(size):
        return size, size
    raise ValueError(
        f'image_decode: with resize = "{resize}", size is one positive integer, the {_SIDE[resize]}'
    )


_SIDE = {"height": "height", "width": "width", "shorter": "shorter side", "longer": "longer side"}


def _crop(crop: Any, resize: str) -> tuple[int, int] | None:
    if isinstance(crop, list) and not crop:
        return None
    if not (isinstance(crop, list) and len(crop) == 2 and all(_positive(v) for v in crop)):
        raise ValueError("image_decode: crop is [width, height] of positive integers, or []")
    if resize == "letterbox":
        raise ValueError(
            'image_decode: crop does not go with resize = "letterbox" (its canvas is size)'
        )
    return crop[0], crop[1]


def _fill(fill: Any, bands: int) -> tuple[float, ...]:
    values = fill if isinstance(fill, list) else [fill]
    if not values or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in values
    ):
        raise ValueError("image_decode: fill is a number, or one number a channel")
    if len(values) == 1:
        return tuple(float(values[0]) for _ in range(bands))
    if len(values) != bands:
        raise ValueError(f"image_decode: fill has {len(values)} values for {bands} channels")
    return tuple(float(v) for v in values)


def _scale(scale: Any) -> tuple[float, float | None]:
    """``scale``: a number the values are multiplied by, or ``"1/N"``: divided by N (in
    single precision, as ``x / 255.0`` on a float32 array; a product by 1/255 differs from
    it in the last bit for about half the values)."""
    if isinstance(scale, str):
        head, _, divisor = scale.partition("/")
        try:
            value = float(divisor)
        except ValueError:
            value = 0.0
        if head.strip() != "1" or not value > 0:
            raise ValueError(f'image_decode: scale is a number or "1/N" (N > 0); got {scale!r}')
        return 1 / value, value
    if isinstance(scale, int | float) and not isinstance(scale, bool):
        return float(scale), None
    raise ValueError(f'image_decode: scale is a number or "1/N"; got {scale!r}')
