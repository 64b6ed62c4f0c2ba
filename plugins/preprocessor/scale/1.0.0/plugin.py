"""Standardize features with a fixed mean and scale. Needs only pluggy and numpy."""

import numpy as np
import pluggy

hookimpl = pluggy.HookimplMarker("plugserve")


class Scale:
    def __init__(self, name, mean, scale):
        self.name = name
        self.mean = np.asarray(mean, dtype=np.float32)
        self.scale = np.asarray(scale, dtype=np.float32)

    def process(self, data, ctx):
        # v2 sends {"input": array}; /predict may send {"input": [[...]]} or a bare [[...]].
        rows = data[self.name] if isinstance(data, dict) else data
        x = np.asarray(rows, dtype=np.float32)
        if x.ndim == 1:
            x = x[np.newaxis, :]
        if x.shape[-1] != self.mean.shape[0]:
            raise ValueError(f"expected {self.mean.shape[0]} features per row, got {x.shape[-1]}")
        return {self.name: (x - self.mean) / self.scale}

    def metadata(self):
        n = int(self.mean.shape[0])
        return {"inputs": [{"name": self.name, "datatype": "FP32", "shape": [-1, n]}]}


@hookimpl
def plugserve_create_component(plugin, config):
    return Scale(config.get("input", "input"), config["mean"], config["scale"])
