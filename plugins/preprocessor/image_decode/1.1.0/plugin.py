"""Decode encoded images into one batched image tensor, as vision models take them.

The input holds one encoded image per element (BYTES: tritonclient's binary data, v2 JSON
with ``"parameters": {"content_type": "base64"}``, or a ``/predict`` body of one image).
Each is decoded by Pillow or by OpenCV (``library``), as a person sees it (its EXIF
orientation applied), converted to ``mode`` before or after it is resized (``convert``),
resized by ``resize`` (stretched to ``size``; letterboxed into it, centred or top-left;
or one side given, the other following the aspect) with the ``resample`` filter,
centre-cropped (``crop``), scaled, normalized per channel and laid out as ``layout``:
images of any size leave as one ``[N, C, H, W]`` (or ``[N, H, W, C]``) tensor, so they
batch together in the runner. Other inputs pass through.

Pixel values are in 8-bit units (0..255) before ``scale``, whatever the file's depth:
through Pillow, a 16-bit image's values times 255/65535, a floating-point one's (1.0: full
scale) times 255, kept as floats until ``datatype`` says otherwise; through OpenCV, as
``cv2.IMREAD_COLOR`` makes them (16-bit values shifted right by 8).

``max_pixels`` bounds a request: each of its images counts the larger of the pixels it
decodes to (every frame of an animated one) and the most it becomes on the way (resized,
or on its canvas; a 1x1 image stretched to ``size`` counts all of ``size``), read from
their headers (by Pillow, for either library) before any is decoded. So the output tensor
holds at most ``max_pixels`` times the channels of ``mode`` values. Whatever the library
raises for a file it cannot read (truncated, corrupt, a decompression bomb) is a 400
naming the image. Unless images are stretched to ``size``, ``ctx.state["image_decode"]``
holds one ``{"width", "height", "scale", "pad_x", "pad_y"}`` per image (its size before,
and where it went: a point of the model's input maps back as ``(x - pad_x) / scale``).

The modules beside this one: ``options`` (the ``[config]`` table, checked at load),
``geometry`` (sizes and placement, library-free) and ``decoders`` (Pillow's and OpenCV's
decoding, conversion and resizing).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Literal, Protocol

import numpy as np
import pluggy
from PIL import Image

from .decoders import decoder
from .geometry import Plan
from .options import DTYPES, parse

hookimpl = pluggy.HookimplMarker("plugserve")


class Context(Protocol):
    """What ``process`` uses of the request's ``ctx``."""

    InvalidInput: type[Exception]
    state: dict[str, Any]


class ImageDecode:
    def __init__(self, config: Mapping[str, Any]) -> None:
        self.options = parse(config)
        self.decoder = decoder(self.options)

    def process(self, data: Any, ctx: Context) -> dict[str, Any]:
        options = self.options
        if isinstance(data, bytes | bytearray | memoryview):  # /predict: the body is one image
            data = {options.input: np.array([bytes(data)], dtype=object)}
        if not isinstance(data, dict) or options.input not in data:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ctx.InvalidInput(f"expects input {options.input!r} (encoded images); got {got}")
        encoded = np.asarray(data[options.input], dtype=object).reshape(-1)
        if encoded.size == 0:
            raise ctx.InvalidInput(f"input {options.input!r} holds no image")
        opened = self._opened(encoded, ctx)
        images, placed = [], []
        for i, (image, blob) in enumerate(opened):
            with _errors(i, ctx):
                loaded = self.decoder.load(image, blob)
            pixels, plan = self.decoder.pixels(loaded)
            images.append(self._values(_placed(pixels, plan, options.fill)))
            placed.append(_where(loaded.width, loaded.height, plan))
        shapes = {image.shape for image in images}
        if len(shapes) > 1:
            raise ctx.InvalidInput(
                f"images of different sizes {sorted(shapes)} in one request: set a size "
                "that fixes both sides (or a crop), or send them in separate requests"
            )
        batch = np.stack(images)
        if options.layout == "NCHW":
            batch = batch.transpose(0, 3, 1, 2)
        if options.geometry.resize != "stretch" or options.geometry.size is None:
            ctx.state["image_decode"] = placed  # one scale for both axes: boxes map back
        out = dict(data)
        out.pop(options.input)
        out[options.output] = np.ascontiguousarray(batch)
        return out

    def _opened(self, encoded: np.ndarray, ctx: Context) -> list[tuple[Image.Image, bytes]]:
        """Each image's header read, nothing decoded, the request's pixels bounded."""
        opened: list[tuple[Image.Image, bytes]] = []
        pixels, geometry = 0, self.options.geometry
        for i, blob in enumerate(encoded):
            if isinstance(blob, str):
                blob = blob.encode("latin-1")
            if not isinstance(blob, bytes | bytearray | memoryview):
                raise ctx.InvalidInput(f"image {i} is {type(blob).__name__}, not encoded bytes")
            blob = bytes(blob)
            with _errors(i, ctx):
                image = Image.open(io.BytesIO(blob))
                frames = getattr(image, "n_frames", 1)
            most, made = geometry.most_pixels(image.width, image.height)
            pixels += max(image.width * image.height * frames, most)
            if pixels > self.options.max_pixels:
                resized = geometry.size is not None or geometry.crop is not None
                becomes = f", made {made[0]}x{made[1]}" if resized else ""
                raise ctx.InvalidInput(
                    f"the images are over max_pixels = {self.options.max_pixels} pixels "
                    f"(image {i}: {image.width}x{image.height}, {frames} frame(s){becomes}; "
                    f"{pixels} with those before it)"
                )
            opened.append((image, blob))
        return opened

    def _values(self, pixels: np.ndarray) -> np.ndarray:
        options = self.options
        if options.datatype == "UINT8":
            if pixels.dtype.kind == "f":  # a deep image's 8-bit units
                pixels = np.clip(np.rint(pixels), 0, 255)
            return np.asarray(pixels, dtype=np.uint8)
        values = pixels.astype(np.float32)
        if options.divisor is not None:
            values = values / np.float32(options.divisor)
        else:
            values = values * np.float32(options.scale)
        if options.mean.size:
            values = (values - options.mean) / options.std
        return values.astype(DTYPES[options.datatype])

    def metadata(self) -> dict[str, Any]:
        return {"inputs": [{"name": self.options.input, "datatype": "BYTES", "shape": [-1]}]}


def _placed(pixels: np.ndarray, plan: Plan, fill: tuple[float, ...]) -> np.ndarray:
    """``pixels`` laid on the plan's canvas (letterboxed or centre-cropped)."""
    if plan.canvas is None:
        return pixels
    width, height = plan.canvas
    canvas = np.empty((height, width, pixels.shape[2]), dtype=pixels.dtype)
    values = np.asarray(fill, dtype=np.float64)
    if pixels.dtype == np.uint8:
        values = np.clip(np.rint(values), 0, 255)
    canvas[...] = values.astype(pixels.dtype)
    x, y = plan.offset
    left, top = max(x, 0), max(y, 0)
    right, bottom = min(x + pixels.shape[1], width), min(y + pixels.shape[0], height)
    canvas[top:bottom, left:right] = pixels[top - y : bottom - y, left - x : right - x]
    return canvas


def _where(width: int, height: int, plan: Plan) -> dict[str, Any]:
    return {
        "width": width,
        "height": height,
        "scale": plan.scale,
        "pad_x": plan.offset[0],
        "pad_y": plan.offset[1],
    }


class _errors:
    """Whatever the library raises for a file (Pillow's plugins raise ``SyntaxError``,
    ``OSError``, ``ValueError``, ``EOFError``, ``struct.error``, ... for truncated or
    corrupt data; a decompression bomb its own error or warning) as a 400 naming the
    image."""

    def __init__(self, index: int, ctx: Context) -> None:
        self.index = index
        self.ctx = ctx
        self.warnings = warnings.catch_warnings()

    def __enter__(self) -> None:
        self.warnings.__enter__()
        warnings.simplefilter("error", Image.DecompressionBombWarning)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        self.warnings.__exit__(kind, exc, tb)
        if exc is None or not isinstance(exc, Exception):
            return False
        raise self.ctx.InvalidInput(f"image {self.index} cannot be decoded: {exc}") from None


@hookimpl
def plugserve_create_component(plugin: Any, config: Mapping[str, Any]) -> ImageDecode:
    component = ImageDecode(config)
    options = component.options
    plugin.logger.info(
        "image_decode_configured",
        library=options.library,
        mode=options.mode,
        convert=options.convert,
        resize=options.geometry.resize,
        size=options.geometry.size,
        resample=options.resample,
    )
    return component
