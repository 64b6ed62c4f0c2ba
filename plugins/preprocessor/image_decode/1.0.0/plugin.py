"""Decode encoded images into one batched image tensor, as vision models take them.

The input holds one encoded image per element (BYTES: tritonclient's binary data, v2 JSON
with ``"parameters": {"content_type": "base64"}``, or a ``/predict`` body of one image).
Each is decoded by Pillow, converted to ``mode``, resized to ``size`` (stretched, or
letterboxed: scaled to fit with its aspect kept, centred, the rest ``fill``), scaled,
normalized per channel and laid out as ``layout``: images of any size leave as one
``[N, C, H, W]`` (or ``[N, H, W, C]``) tensor, so they batch together in the runner.
Other inputs pass through. For a letterboxed image, ``ctx.state["image_decode"]`` holds
one ``{"width", "height", "scale", "pad_x", "pad_y"}`` per image (its size before, and how
it was placed), for a postprocessor to map boxes back.
"""

import io
import warnings

import numpy as np
import pluggy
from PIL import Image, UnidentifiedImageError

hookimpl = pluggy.HookimplMarker("plugserve")

DTYPES = {"FP32": np.float32, "FP16": np.float16, "UINT8": np.uint8}


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
        placed, images = [], []
        for i, blob in enumerate(encoded):
            image, where = self._decode(blob, i, ctx)
            images.append(image)
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

    def _decode(self, blob, index, ctx):
        if isinstance(blob, str):
            blob = blob.encode("latin-1")
        if not isinstance(blob, bytes | bytearray | memoryview):
            raise ctx.InvalidInput(f"image {index} is {type(blob).__name__}, not encoded bytes")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(bytes(blob)))
                if image.width * image.height > self.max_pixels:
                    raise ctx.InvalidInput(
                        f"image {index} is {image.width}x{image.height}: over "
                        f"{self.max_pixels} pixels"
                    )
                image = image.convert(self.mode)
        except (UnidentifiedImageError, OSError, Image.DecompressionBombWarning,
                Image.DecompressionBombError, ValueError) as exc:
            raise ctx.InvalidInput(f"image {index} cannot be decoded: {exc}") from None
        width, height = image.size
        where = {"width": width, "height": height, "scale": 1.0, "pad_x": 0, "pad_y": 0}
        if self.size is not None:
            image, where = self._resized(image, where)
        pixels = np.asarray(image)
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
        canvas = Image.new(image.mode, (target_w, target_h), _fill(image.mode, self.fill))
        pad_x, pad_y = (target_w - width) // 2, (target_h - height) // 2
        canvas.paste(image.resize((width, height), Image.BILINEAR), (pad_x, pad_y))
        return canvas, {**where, "scale": scale, "pad_x": pad_x, "pad_y": pad_y}

    def _values(self, pixels):
        if self.datatype == "UINT8":
            return pixels.astype(np.uint8)
        values = pixels.astype(np.float32) * np.float32(self.scale)
        if self.mean.size:
            if self.mean.size != values.shape[-1]:
                raise ValueError(f"mean has {self.mean.size} values for {values.shape[-1]} channels")
            values = (values - self.mean) / self.std
        return values.astype(DTYPES[self.datatype])

    def metadata(self):
        return {"inputs": [{"name": self.input, "datatype": "BYTES", "shape": [-1]}]}


def _fill(mode, value):
    bands = len(mode) if mode not in ("L", "P", "1", "I", "F") else 1
    return tuple([value] * bands) if bands > 1 else value


@hookimpl
def plugserve_create_component(plugin, config):
    return ImageDecode(config, plugin.InvalidInput)
