"""A CRNN's per-column scores read as text: the best class of each column, repeats
merged, blanks (class 0) dropped, each class its character in the model's list.

The scores (``config["scores"]``) are ``[T, 1, classes]`` (time first, as ddddocr's
models answer) or ``[1, T, classes]``; the answer is ``text``, BYTES ``[1]``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import pluggy

hookimpl = pluggy.HookimplMarker("plugserve")


class CTCText:
    def __init__(self, charset: list[str], scores: str) -> None:
        self.charset = charset
        self.scores = scores

    def format(self, data: Mapping[str, np.ndarray], ctx: Any) -> dict[str, np.ndarray]:
        scores = np.asarray(data[self.scores])
        if scores.ndim != 3 or 1 not in scores.shape[:2]:
            raise ValueError(
                f"expects scores [T, 1, classes] or [1, T, classes]; got {scores.shape}"
            )
        columns = scores[:, 0, :] if scores.shape[1] == 1 else scores[0]
        return {"text": np.array([self.text(columns.argmax(axis=-1))], dtype=object)}

    def text(self, best: np.ndarray) -> str:
        """Greedy CTC decoding of each column's best class."""
        keep = np.ones(best.shape, dtype=bool)
        keep[1:] = best[1:] != best[:-1]
        keep &= best != 0
        return "".join(self.charset[i] for i in best[keep].tolist() if i < len(self.charset))

    def metadata(self) -> dict[str, Any]:
        return {"outputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}]}


@hookimpl
def plugserve_create_component(plugin: Any, config: Mapping[str, Any]) -> CTCText:
    path = plugin.resolve(config.get("charset", "charset.json"))
    charset = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(charset, list) or not all(isinstance(c, str) for c in charset):
        raise ValueError(f"{path} is not a JSON list of characters")
    plugin.logger.info("charset_loaded", path=str(path), characters=len(charset))
    return CTCText(charset, config.get("scores", "387"))
