"""A YOLOX detector's predictions read as boxes in the image's pixels, by the steps of
ddddocr's detection: each anchor's centre and size decoded on its grid, scores
(objectness times class), class-agnostic NMS, the boxes divided by the letterbox's scale
(``ctx.state["image_decode"]``, set by image_decode) and clipped to the image.

The predictions (``config["predictions"]``) are ``[1, anchors, 4 + 1 + classes]``; the
answer is ``boxes``, INT64 ``[n, 4]``: ``x_min, y_min, x_max, y_max`` of each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pluggy

hookimpl = pluggy.HookimplMarker("plugserve")


class YOLOXBoxes:
    def __init__(self, config: Mapping[str, Any]) -> None:
        self.predictions = config.get("predictions", "output")
        height, width = config.get("input_size", [416, 416])
        self.nms_threshold = float(config.get("nms_threshold", 0.45))
        self.score_threshold = float(config.get("score_threshold", 0.1))
        grids, strides = [], []
        for stride in config.get("strides", [8, 16, 32]):
            xv, yv = np.meshgrid(np.arange(width // stride), np.arange(height // stride))
            grid = np.stack((xv, yv), 2).reshape(1, -1, 2)
            grids.append(grid)
            strides.append(np.full((*grid.shape[:2], 1), stride))
        self.grids = np.concatenate(grids, 1)
        self.strides = np.concatenate(strides, 1)

    def format(self, data: Mapping[str, np.ndarray], ctx: Any) -> dict[str, np.ndarray]:
        placed = ctx.state.get("image_decode")
        if not placed or len(placed) != 1:
            raise ValueError("expects one letterboxed image (image_decode before the runner)")
        image = placed[0]
        outputs = np.array(data[self.predictions], dtype=np.float32)
        if outputs.ndim != 3 or outputs.shape[1] != self.grids.shape[1]:
            raise ValueError(f"expects predictions [1, {self.grids.shape[1]}, 5 + classes]")
        outputs[..., :2] = (outputs[..., :2] + self.grids) * self.strides
        outputs[..., 2:4] = np.exp(outputs[..., 2:4]) * self.strides
        predictions = outputs[0]
        boxes = predictions[:, :4]
        corners = np.ones_like(boxes)
        corners[:, 0] = boxes[:, 0] - boxes[:, 2] / 2.0
        corners[:, 1] = boxes[:, 1] - boxes[:, 3] / 2.0
        corners[:, 2] = boxes[:, 0] + boxes[:, 2] / 2.0
        corners[:, 3] = boxes[:, 1] + boxes[:, 3] / 2.0
        corners /= image["scale"]
        kept = self._nms(corners, predictions[:, 4:5] * predictions[:, 5:])
        found = [_clipped(box, image["width"], image["height"]) for box in kept.tolist()]
        return {"boxes": np.array(found, dtype=np.int64).reshape(-1, 4)}

    def _nms(self, boxes: np.ndarray, scores: np.ndarray) -> np.ndarray:
        """The boxes kept by class-agnostic NMS, best first."""
        classes = scores.argmax(1)
        best = scores[np.arange(len(classes)), classes]
        valid = best > self.score_threshold
        boxes, best = boxes[valid], best[valid]
        x1, y1, x2, y2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
        areas = (x2 - x1 + 1) * (y2 - y1 + 1)
        order = best.argsort()[::-1]
        keep = []
        while order.size > 0:
            i = order[0]
            keep.append(i)
            w = np.maximum(
                0.0, np.minimum(x2[i], x2[order[1:]]) - np.maximum(x1[i], x1[order[1:]]) + 1
            )
            h = np.maximum(
                0.0, np.minimum(y2[i], y2[order[1:]]) - np.maximum(y1[i], y1[order[1:]]) + 1
            )
            overlap = w * h / (areas[i] + areas[order[1:]] - w * h)
            order = order[np.where(overlap <= self.nms_threshold)[0] + 1]
        return boxes[keep]

    def metadata(self) -> dict[str, Any]:
        return {"outputs": [{"name": "boxes", "datatype": "INT64", "shape": [-1, 4]}]}


def _clipped(box: list[float], width: int, height: int) -> list[int]:
    """A box in whole pixels within the image, as ddddocr rounds it (toward zero)."""
    x_min, y_min, x_max, y_max = box
    return [
        0 if x_min < 0 else int(x_min),
        0 if y_min < 0 else int(y_min),
        width if x_max > width else int(x_max),
        height if y_max > height else int(y_max),
    ]


@hookimpl
def plugserve_create_component(plugin: Any, config: Mapping[str, Any]) -> YOLOXBoxes:
    return YOLOXBoxes(config)
