"""Text lines from the detector's probability map, by RapidOCR's own steps.

Boxes come from the map (DB post-processing), sorted in reading order; each box is cut
out of the image and its direction and text are found by the routes ``ocr-cls`` and
``ocr-rec``, which RapidOCR's classifier and recognizer call through ``ctx.infer``:
in this process, batched with every other request's crops, within this request's
deadline. The library's code runs on a thread (it calls its models synchronously);
each model call hops back to the event loop.

Answers ``text`` (BYTES [n]), ``score`` (FP32 [n]) and ``box`` (FP32 [n, 4, 2], corner
points in the original image's pixels), as ``RapidOCR()(image)`` returns them.
"""

import asyncio
import threading

import numpy as np
import pluggy
from rapidocr_onnxruntime import RapidOCR

hookimpl = pluggy.HookimplMarker("plugserve")

_request = threading.local()
"""The request (its ctx and event loop) a library thread works for."""


class Route:
    """Stands in for one of RapidOCR's model sessions: a call runs a server route."""

    def __init__(self, route):
        self.route = route

    def __call__(self, x):
        ctx, loop = _request.ctx, _request.loop
        future = asyncio.run_coroutine_threadsafe(ctx.infer(self.route, {"x": x}), loop)
        answer = future.result()
        return [next(iter(answer.values()))]


class Read:
    def __init__(self, direction, recognize):
        self.ocr = RapidOCR()  # its character list comes from the recognizer's metadata
        self.ocr.text_det.infer = None
        self.ocr.text_cls.infer = Route(direction)
        self.ocr.text_rec.session = Route(recognize)

    async def format(self, data, ctx):
        seen = ctx.state["ocr"]
        (preds,) = data.values()
        loop = asyncio.get_running_loop()
        lines = await loop.run_in_executor(None, self._read, preds, seen, ctx, loop)
        return {
            "text": np.array([text.encode() for _, text, _ in lines], dtype=object),
            "score": np.array([score for _, _, score in lines], dtype=np.float32),
            "box": np.array([box for box, _, _ in lines], dtype=np.float32).reshape(-1, 4, 2),
        }

    def _read(self, preds, seen, ctx, loop):
        _request.ctx, _request.loop = ctx, loop
        try:
            ocr = self.ocr
            boxes, _ = ocr.text_det.postprocess_op(preds, seen["shape"])
            boxes = ocr.text_det.filter_tag_det_res(boxes, seen["shape"])
            if boxes is None or len(boxes) < 1:
                return []
            boxes = ocr.sorted_boxes(boxes)
            crops = ocr.get_crop_img_list(seen["img"], boxes)
            crops, directions, _ = ocr.text_cls(crops)
            texts, _ = ocr.text_rec(crops, False)
            raw_h, raw_w = seen["raw"]
            boxes = ocr._get_origin_points(boxes, seen["record"], raw_h, raw_w)
            result, _ = ocr.get_final_res(boxes, directions, texts, 0.0, 0.0, 0.0)
            return result or []
        finally:
            _request.ctx = _request.loop = None

    def metadata(self):
        return {
            "outputs": [
                {"name": "text", "datatype": "BYTES", "shape": [-1]},
                {"name": "score", "datatype": "FP32", "shape": [-1]},
                {"name": "box", "datatype": "FP32", "shape": [-1, 4, 2]},
            ]
        }


@hookimpl
def plugserve_create_component(plugin, config):
    return Read(config.get("direction", "ocr-cls"), config.get("recognize", "ocr-rec"))
