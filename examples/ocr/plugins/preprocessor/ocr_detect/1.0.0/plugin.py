"""The detector's input from one encoded image, by RapidOCR's own steps.

The image (BYTES ``image``, one element: tritonclient's binary data, base64 in v2 JSON,
or a ``/predict`` body) is decoded, resized within RapidOCR's side limits, letterboxed
when very wide, and normalized as its detector takes it. What the postprocessor needs
to read the detector's answer rides in ``ctx.state["ocr"]``.
"""

import numpy as np
import pluggy
from rapidocr_onnxruntime import RapidOCR

hookimpl = pluggy.HookimplMarker("plugserve")


def library():
    """RapidOCR's pipeline with its own model sessions dropped: its steps only (the
    server's runners run the models)."""
    ocr = RapidOCR()
    ocr.text_det.infer = ocr.text_cls.infer = ocr.text_rec.session = None
    return ocr


class Detect:
    def __init__(self):
        self.ocr = library()

    def process(self, data, ctx):
        if isinstance(data, bytes | bytearray | memoryview):
            blob = bytes(data)
        else:
            images = np.asarray(data.get("image") if isinstance(data, dict) else None, object)
            if images.size != 1:
                raise ctx.InvalidInput("send one encoded image as the BYTES input 'image'")
            blob = images.reshape(-1)[0]
        try:
            img = self.ocr.load_img(bytes(blob))
        except Exception as exc:  # the library's LoadImageError, and whatever Pillow raises
            raise ctx.InvalidInput(f"the image cannot be decoded: {exc}") from None
        raw_h, raw_w = img.shape[:2]
        img, ratio_h, ratio_w = self.ocr.preprocess(img)
        record = {"preprocess": {"ratio_h": ratio_h, "ratio_w": ratio_w}}
        img, record = self.ocr.maybe_add_letterbox(img, record)
        shape = img.shape[0], img.shape[1]
        x = self.ocr.text_det.get_preprocess(max(shape))(img)
        ctx.state["ocr"] = {"img": img, "record": record, "raw": (raw_h, raw_w), "shape": shape}
        return {"x": x}

    def metadata(self):
        return {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1]}]}


@hookimpl
def plugserve_create_component(plugin, config):
    return Detect()
