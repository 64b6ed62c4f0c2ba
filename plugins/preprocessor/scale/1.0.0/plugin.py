"""Standardize features with a fixed mean and scale. Needs only pluggy and numpy.

What a client gets wrong is refused with ``ctx.InvalidInput``: a 400 naming this
plugin, never a 500 and never a mark against the runner's circuit breaker.
"""

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
        if isinstance(data, bytes | bytearray | memoryview):
            raise ctx.InvalidInput("expects a JSON body: send Content-Type: application/json")
        if isinstance(data, dict):
            if self.name not in data:
                raise ctx.InvalidInput(f"missing input {self.name!r}; got {sorted(data)}")
            data = data[self.name]
        try:
            with np.errstate(over="ignore"):
                x = np.asarray(data, dtype=np.float32)
        except (TypeError, ValueError):
            raise ctx.InvalidInput("expects rows of numbers") from None
        if x.ndim == 1:
            x = x[np.newaxis, :]
        n = self.mean.shape[0]
        if x.ndim != 2 or x.shape[-1] != n:
            shape = list(x.shape)
            raise ctx.InvalidInput(f"expects rows of {n} features, shape [rows, {n}]; got {shape}")
        if not np.isfinite(x).all():
            raise ctx.InvalidInput("features must be finite numbers within FP32's range")
        return {self.name: (x - self.mean) / self.scale}

    def metadata(self):
        n = int(self.mean.shape[0])
        return {"inputs": [{"name": self.name, "datatype": "FP32", "shape": [-1, n]}]}


@hookimpl
def plugserve_create_component(plugin, config):
    return Scale(config.get("input", "input"), config["mean"], config["scale"])
