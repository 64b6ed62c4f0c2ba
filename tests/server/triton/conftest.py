"""Routes Triton's clients meet: an ONNX classifier with labels, a Python runner without batching."""

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from tests.helpers import ServerProcess, add_model, write_plugin

LABELS = ["setosa", "versicolor", "virginica", "daisy", "rose"]

SCORES_RUNNER = """
[runner]
backend = "onnxruntime"
model = "model.onnx"
max_batch_size = 8
max_queue_delay_ms = 0.5
preferred_batch_sizes = [4, 8]
instances = 2
formats = { x = "FORMAT_NCHW" }
labels = { y = "labels.txt" }
"""

PYTHON_RUNNER = """
    import numpy as np
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Double:
        def infer(self, inputs):
            return {"out": np.asarray(inputs["in"]) * 2, "raw": np.asarray(inputs["in"])}
        def metadata(self):
            return {"inputs": [{"name": "in", "datatype": "INT32", "shape": [2, 3]}],
                    "outputs": [{"name": "out", "datatype": "INT32", "shape": [2, 3]},
                                {"name": "raw", "datatype": "INT32", "shape": [2, 3]}]}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Double()
"""


def write_scores(plugins_dir: Path, version: str = "1.0.0", amount: float = 0.0) -> Path:
    """``scores``: ``y = x + amount`` over 5 classes, with labels and Triton's settings."""
    folder = write_plugin(
        plugins_dir, "runner", "scores", version, SCORES_RUNNER,
        {"labels.txt": "\n".join(LABELS) + "\n"}, module=None,
    )  # fmt: skip
    add_model(folder / "model.onnx", amount, features=len(LABELS))
    return folder


def write_python(plugins_dir: Path) -> Path:
    """``double``: a runner of its own module, without batching (max_batch_size 0)."""
    return write_plugin(
        plugins_dir, "runner", "double", "1.0.0", files={"plugin.py": PYTHON_RUNNER}
    )


@pytest.fixture
def triton_server(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> ServerProcess:
    write_scores(plugins_dir, "1.0.0")
    write_scores(plugins_dir, "2.0.0", amount=1.0)
    write_python(plugins_dir)
    return server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))


@pytest.fixture
def triton(triton_server: ServerProcess) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{triton_server.port}")
    yield client
    client.close()
