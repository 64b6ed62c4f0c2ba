"""Train the bundled iris classifier and write it as models/iris/<version>/model.onnx.

    pip install scikit-learn skl2onnx    # or: pip install -e '.[dev]'
    python models/iris/train.py [VERSION]

Feature scaling is not in the model: the ``scale`` preprocessor does it, with the
mean and scale this script prints (copy them into
plugins/preprocessor/scale/<version>/plugin.toml when you retrain).
"""

import sys
from pathlib import Path

import numpy as np
from skl2onnx import to_onnx
from sklearn.datasets import load_iris
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

version = sys.argv[1] if len(sys.argv) > 1 else "1"
x, y = load_iris(return_X_y=True)
x = x.astype(np.float32)
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)
scaler = StandardScaler().fit(x_train)
model = LogisticRegression(max_iter=1000).fit(scaler.transform(x_train), y_train)
print("test accuracy:", round(model.score(scaler.transform(x_test), y_test), 3))
print("mean =", [round(float(v), 6) for v in scaler.mean_])
print("scale =", [round(float(v), 6) for v in scaler.scale_])

onnx_model = to_onnx(
    model,
    x_train[:1],
    options={id(model): {"zipmap": False}},
    initial_types=None,
    target_opset=17,
)
# Name the graph's tensors for the HTTP API: input, label, probabilities.
graph = onnx_model.graph
renames = {graph.input[0].name: "input"}
for node in graph.node:
    node.input[:] = [renames.get(n, n) for n in node.input]
graph.input[0].name = "input"
out = Path(__file__).parent / version / "model.onnx"
out.parent.mkdir(exist_ok=True)
out.write_bytes(onnx_model.SerializeToString())
print("wrote", out, [o.name for o in graph.output])
