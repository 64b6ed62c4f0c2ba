"""One unit vector per text: the mean of ``last_hidden_state`` over the real tokens, L2-normalized.

The real tokens are those of ``ctx.state["attention_mask"]``, which the tokenize
preprocessor leaves there; without it every position counts. Dot products of
the embeddings are then cosine similarities.
"""

import numpy as np
import pluggy

hookimpl = pluggy.HookimplMarker("plugserve")


class Pool:
    def format(self, data, ctx):
        hidden = np.asarray(data["last_hidden_state"], dtype=np.float32)  # [N, L, D]
        mask = ctx.state.get("attention_mask")
        if mask is None:
            mask = np.ones(hidden.shape[:2], dtype=np.float32)
        weights = np.asarray(mask, dtype=np.float32)[:, : hidden.shape[1], np.newaxis]
        summed = (hidden * weights).sum(axis=1)
        mean = summed / np.maximum(weights.sum(axis=1), 1.0)
        norms = np.linalg.norm(mean, axis=1, keepdims=True)
        return {"embeddings": (mean / np.maximum(norms, 1e-12)).astype(np.float32)}

    def metadata(self):
        return {"outputs": [{"name": "embeddings", "datatype": "FP32", "shape": [-1, -1]}]}


@hookimpl
def plugserve_create_component(plugin, config):
    return Pool()
