"""Decode encoded images into one batched image tensor, as vision models take them.

The input holds one encoded image per element (BYTES: tritonclient's binary data, v2 JSON
with ``"parameters": {"content_type": "base64"}``, or a ``/predict`` body of one image).
Each is decoded by Pillow as a person sees it (its EXIF orientation applied), converted
to ``mode``, resized to ``size`` (stretched, or letterboxed: scaled to fit with its aspect
kept, centred, the rest ``fill``), scaled, normalized per channel and laid out as
``layout``: images of any size leave as one ``[N, C, H, W]`` (or ``[N, H, W, C]``) tensor,
so they batch together in the runner. Other inputs pass through.

Pixel values are in 8-bit units (0..255) before ``scale``, whatever the file's depth: a
16-bit image's values times 255/65535, a floating-point one's (1.0: full scale) times 255,
kept as floats until ``datatype`` says otherwise.

``max_pixels`` bounds a request: each of its images counts the larger of the pixels it
decodes to (every frame of an animated one) and those it becomes once resized to ``size``
(a 1x1 image counts all of ``size``), read from their headers before any is decoded. So
the output tensor holds at most ``max_pixels`` times the channels of ``mode`` values. Whatever Pillow raises for a
file it cannot read (truncated, corrupt, a decompression bomb) is a 400 naming the image.
For a letterboxed image, ``ctx.state["image_decode"]`` holds one ``{"width", "height",
"scale", "pad_x", "pad_y"}`` per image (its size before, and how it was placed), for a
postprocessor to map boxes back.
"""

import io
import warnings

import numpy as np
import pluggy
from PIL import Image, ImageOps

hookimpl = pluggy.HookimplMarker("plugserve")

DTYPES = {"FP32": np.float32, "FP16": np.float16, "UINT8": np.uint8}
DEEP = {"I": 255 / 65535, "I;16": 255 / 65535, "I;16B": 255 / 65535, "I;16L": 255 / 65535,
        "I;16N": 255 / 65535, "F": 255.0}
"""Pillow's modes of more than 8 bits a channel, and what turns their values into 8-bit
units (Pillow reads 16-bit PNG and TIFF grey as ``I;16`` or ``I``)."""
DEEP_MODES = {"L": 1, "LA": 1, "RGB": 3, "RGBA": 3}
"""The target modes a deep image is converted to without losing its depth: its grey
repeated, alpha opaque."""


class ImageDecode:
    def __init__(self, config, invalid):
        self.input = config.get("input", "image")
        self.output = config.get("output", self.input)
        self.mode = config.get("mode", "RGB")
        size = config.get("size", [224, 224])
        if size and (len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size)):
            raise invalid("image_decode: size is [width, height] of positive integers, or []")
        self.size = tuple(size) if size else None
        self.resize = config.get("resize", "stretch")
        if self.resize not in ("stretch", "letterbox"):
            raise invalid("image_decode: resize is 'stretch' or 'letterbox'")
        self.fill = int(config.get("fill", 114))
        self.layout = config.get("layout", "NCHW")
        if self.layout not in ("NCHW", "NHWC"):
            raise invalid("image_decode: layout is 'NCHW' or 'NHWC'")
        self.datatype = config.get("datatype", "FP32")
        if self.datatype not in DTYPES:
            raise invalid(f"image_decode: datatype is one of {', '.join(DTYPES)}")
        self.scale = float(config.get("scale", 1 / 255))
        self.mean = np.asarray(config.get("mean", []), dtype=np.float32)
        self.std = np.asarray(config.get("std", []), dtype=np.float32)
        if self.mean.size != self.std.size or (self.std == 0).any():
            raise invalid("image_decode: mean and std are per channel, as many of each, std not 0")
        self.max_pixels = int(config.get("max_pixels", 40_000_000))

    def process(self, data, ctx):
        if isinstance(data, bytes | bytearray | memoryview):  # /predict: the body is one image
            data = {self.input: np.array([bytes(data)], dtype=object)}
        if not isinstance(data, dict) or self.input not in data:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ctx.InvalidInput(f"expects input {self.input!r} (encoded images); got {got}")
        encoded = np.asarray(data[self.input], dtype=object).reshape(-1)
        if encoded.size == 0:
            raise ctx.InvalidInput(f"input {self.input!r} holds no image")
        opened, pixels = [], 0
        for i, blob in enumerate(encoded):
            image, frames = self._open(blob, i, ctx)
            pixels += self._pixels(image, frames)
            if pixels > self.max_pixels:
                made = f", made {self.size[0]}x{self.size[1]}" if self.size else ""
                raise ctx.InvalidInput(
                    f"the images are over max_pixels = {self.max_pixels} pixels (image {i}: "
                    f"{image.width}x{image.height}, {frames} frame(s){made}; {pixels} with "
                    "those before it)"
                )
            opened.append(image)
        placed, images = [], []
        for i, image in enumerate(opened):
            decoded, where = self._decode(image, i, ctx)
            images.append(decoded)
            placed.append(where)
        shapes = {image.shape for image in images}
        if len(shapes) > 1:
            raise ctx.InvalidInput(
                f"images of different sizes {sorted(shapes)} in one request: set a size"
            )
        batch = np.stack(images)
        if self.layout == "NCHW":
            batch = batch.transpose(0, 3, 1, 2)
        if self.resize == "letterbox":
            ctx.state["image_decode"] = placed
        out = dict(data)
        out.pop(self.input)
        out[self.output] = np.ascontiguousarray(batch)
        return out

    def _open(self, blob, index, ctx):
        """The image, its header read and nothing decoded, and its frames."""
        if isinstance(blob, str):
            blob = blob.encode("latin-1")
        if not isinstance(blob, bytes | bytearray | memoryview):
            raise ctx.InvalidInput(f"image {index} is {type(blob).__name__}, not encoded bytes")
        with _pillow_errors(index, ctx):
            image = Image.open(io.BytesIO(bytes(blob)))
            return image, getattr(image, "n_frames", 1)

    def _pixels(self, image, frames):
        """What an image costs, in pixels: those decoded (every frame) or those it becomes
        (``size``), the larger."""
        decoded = image.width * image.height * frames
        return decoded if self.size is None else max(decoded, self.size[0] * self.size[1])

    def _decode(self, image, index, ctx):
        with _pillow_errors(index, ctx):
            ImageOps.exif_transpose(image, in_place=True)
            if image.mode in DEEP and self.mode in DEEP_MODES:
                bands = _deep_bands(image, self.mode)
            else:
                bands = [image.convert(self.mode)]
        width, height = bands[0].size
        where = {"width": width, "height": height, "scale": 1.0, "pad_x": 0, "pad_y": 0}
        if self.size is not None:  # a deep grey image's bands are one image: resized once
            resized = {id(band): self._resized(band, where) for band in bands}
            bands, where = [resized[id(band)][0] for band in bands], resized[id(bands[0])][1]
        if len(bands) == 1:
            pixels = np.asarray(bands[0])
        else:
            pixels = np.stack([np.asarray(band) for band in bands], axis=-1)
        if pixels.ndim == 2:
            pixels = pixels[:, :, np.newaxis]
        return self._values(pixels), where

    def _resized(self, image, where):
        target_w, target_h = self.size
        if self.resize == "stretch":
            return image.resize((target_w, target_h), Image.BILINEAR), where
        scale = min(target_w / image.width, target_h / image.height)
        width = max(1, round(image.width * scale))
        height = max(1, round(image.height * scale))
        fill = float(self.fill) if image.mode == "F" else _fill(image.mode, self.fill)
        canvas = Image.new(image.mode, (target_w, target_h), fill)
        pad_x, pad_y = (target_w - width) // 2, (target_h - height) // 2
        canvas.paste(image.resize((width, height), Image.BILINEAR), (pad_x, pad_y))
        return canvas, {**where, "scale": scale, "pad_x": pad_x, "pad_y": pad_y}

    def _values(self, pixels):
        if self.datatype == "UINT8":
            if pixels.dtype.kind == "f":  # a deep image's 8-bit units
                return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)
            return pixels.astype(np.uint8)
        values = pixels.astype(np.float32) * np.float32(self.scale)
        if self.mean.size:
            if self.mean.size != values.shape[-1]:
                raise ValueError(f"mean has {self.mean.size} values for {values.shape[-1]} channels")
            values = (values - self.mean) / self.std
        return values.astype(DTYPES[self.datatype])

    def metadata(self):
        return {"inputs": [{"name": self.input, "datatype": "BYTES", "shape": [-1]}]}


class _pillow_errors:
    """Whatever Pillow raises for a file (its plugins raise ``SyntaxError``, ``OSError``,
    ``ValueError``, ``EOFError``, ``struct.error``, ... for truncated or corrupt data; a
    decompression bomb its own error or warning) as a 400 naming the image."""

    def __init__(self, index, ctx):
        self.index = index
        self.ctx = ctx
        self.warnings = warnings.catch_warnings()

    def __enter__(self):
        self.warnings.__enter__()
        warnings.simplefilter("error", Image.DecompressionBombWarning)

    def __exit__(self, kind, exc, tb):
        self.warnings.__exit__(kind, exc, tb)
        if exc is None or not isinstance(exc, Exception):
            return False
        raise self.ctx.InvalidInput(f"image {self.index} cannot be decoded: {exc}") from None


def _deep_bands(image, mode):
    """A deep image (``DEEP``) in ``mode`` as one ``F`` image a channel, in 8-bit units."""
    image.load()
    units = np.asarray(image, dtype=np.float32) * np.float32(DEEP[image.mode])
    grey = Image.fromarray(np.ascontiguousarray(units), "F")
    bands = [grey] * DEEP_MODES[mode]
    if mode.endswith("A"):
        bands.append(Image.new("F", grey.size, 255.0))
    return bands


def _fill(mode, value):
    bands = len(mode) if mode not in ("L", "P", "1", "I", "F") else 1
    return tuple([value] * bands) if bands > 1 else value


@hookimpl
def plugserve_create_component(plugin, config):
    return ImageDecode(config, plugin.InvalidInput)
