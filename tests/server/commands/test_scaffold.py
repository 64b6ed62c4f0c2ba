"""``plugserve new``: packages that validate, whose own tests pass, and that a server serves."""

import json
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from plugserve.server.commands.scaffold import package_files
from tests.helpers import ServerProcess, add_model
from tests.server.test_cli import plugserve

pytestmark = pytest.mark.slow


def new(tmp_path: Path, *args: str) -> Path:
    result = plugserve("new", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.split()[1])


def test_new_packages_validate_pass_their_tests_and_serve_a_chain(
    tmp_path: Path, server: Callable[..., ServerProcess]
) -> None:
    runner = new(tmp_path, "runner", "demo")
    assert runner == tmp_path / "plugins/runner/demo/1.0.0"
    pre = new(tmp_path, "preprocessor", "prep", "--version", "0.1.0")
    post = new(tmp_path, "postprocessor", "post", "--dir", "plugins")
    assert sorted(p.name for p in runner.iterdir()) == [
        "plugin.py",
        "plugin.toml",
        "test_plugin.py",
    ]
    manifest = runner / "plugin.toml"
    text = manifest.read_text().replace('# preprocess = ["scale"]', 'preprocess = ["prep@0.1.0"]')
    manifest.write_text(text.replace('# postprocess = ["label"]', 'postprocess = ["post"]'))
    for folder in (runner, pre, post):
        result = plugserve("validate", str(folder), "--json", cwd=tmp_path)
        assert result.returncode == 0, result.stdout
        report = json.loads(result.stdout)
        assert report["outcome"] == "valid"
        tests = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_plugin.py"],
            cwd=folder, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert tests.returncode == 0, tests.stdout + tests.stderr
    runner_report = json.loads(plugserve("validate", str(runner), "--json", cwd=tmp_path).stdout)
    assert [s["resolved"] for s in runner_report["chain"]] == ["0.1.0", "1.0.0"]

    srv = server("--plugins-dir", str(tmp_path / "plugins"), "--models-dir", str(tmp_path))
    status, _, body = srv.request("POST", "/predict/demo", {"input": [[1.0, 2.5]]})
    assert status == 200, body
    assert json.loads(body) == {"output": [[2.0, 5.0]]}
    v2 = {"inputs": [{"name": "input", "shape": [1, 2], "datatype": "FP32", "data": [3, 4]}]}
    status, _, body = srv.request("POST", "/v2/models/demo/infer", v2)
    assert status == 200, body
    assert json.loads(body)["outputs"][0]["data"] == [6.0, 8.0]
    status, _, body = srv.request("POST", "/predict/demo", {"input": [["x"]]})
    assert status == 400, body  # not the FP32 rows its metadata() declares


def test_new_never_overwrites_and_refuses_bad_names(tmp_path: Path) -> None:
    folder = new(tmp_path, "preprocessor", "taken")
    (folder / "plugin.py").write_text("# mine\n")
    result = plugserve("new", "preprocessor", "taken", cwd=tmp_path)
    assert result.returncode == 1 and "not overwritten" in result.stderr
    assert (folder / "plugin.py").read_text() == "# mine\n"
    assert sorted(p.name for p in folder.parent.iterdir()) == ["1.0.0"]
    result = plugserve("new", "runner", "Bad Name", cwd=tmp_path)
    assert result.returncode == 2 and "must match" in result.stderr
    result = plugserve("new", "runner", "ok", "--version", "1.0", cwd=tmp_path)
    assert result.returncode == 2 and "semantic version" in result.stderr
    # Attack round after issue 17: --dir a file was a traceback.
    (tmp_path / "afile").write_text("")
    result = plugserve("new", "runner", "ok", "--dir", "afile", cwd=tmp_path)
    assert result.returncode == 2 and "cannot write the package" in result.stderr
    assert "Traceback" not in result.stderr


def test_new_onnx_runner_is_a_manifest_with_the_models_tensors_that_serves(
    tmp_path: Path, server: Callable[..., ServerProcess]
) -> None:
    add_model(tmp_path / "models/adder/2/model.onnx", amount=1.0)
    runner = new(tmp_path, "runner", "adder", "--backend", "onnxruntime", "--model", "models:adder")
    assert sorted(p.name for p in runner.iterdir()) == ["plugin.toml"]  # no module
    text = (runner / "plugin.toml").read_text()
    assert 'backend = "onnxruntime"' in text and 'model = "models:adder"' in text
    assert '#   input  "x" FP32 [-1, 4]' in text and '#   output "y" FP32 [-1, 4]' in text
    assert "max_batch_size = 8" in text  # the first axis is dynamic: it batches
    result = plugserve("validate", str(runner), "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    srv = server("--plugins-dir", str(tmp_path / "plugins"), "--models-dir",
                 str(tmp_path / "models"))  # fmt: skip
    v2 = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    status, _, body = srv.request("POST", "/v2/models/adder/infer", v2)
    assert status == 200, body
    assert json.loads(body)["outputs"][0]["data"] == [2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--backend", "onnxruntime"), "needs --model"),
        (("--backend", "onnxruntime", "--model", "models:nope"), "no versions of model 'nope'"),
        (("--backend", "onnxruntime", "--model", "model.onnx"), "name a model in the models"),
        (("--model", "models:adder"), "--model takes --backend onnxruntime"),
        (("--backend", "onnxruntime", "--model", "models:broken"), "ONNX Runtime cannot load it"),
    ],
)
def test_new_onnx_runner_refuses_what_it_cannot_read(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    add_model(tmp_path / "models/adder/1/model.onnx")
    (tmp_path / "models/broken/1").mkdir(parents=True)
    (tmp_path / "models/broken/1/model.onnx").write_bytes(b"not a model")
    result = plugserve("new", "runner", "r", *args, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "plugins").exists()


def odd_names_model(path: Path, x: str, y: str) -> Path:
    """An ONNX model passing FP32 ``[N, 2]`` input ``x`` through to output ``y``."""
    graph = helper.make_graph(
        [helper.make_node("Identity", [x], [y])], "odd",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["N", 2])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def test_new_writes_what_a_model_names_as_data_never_as_keys(tmp_path: Path) -> None:
    """A tensor name holding a newline and TOML is written as data: it adds no key such as
    ``instances = 1024`` to the manifest, and validate reads back what was meant."""
    x, y = 'x"\\\ninstances = 1024\n#', "y\r\n[route]\nname = 'other'"
    odd_names_model(tmp_path / "models/odd/1/model.onnx", x, y)
    runner = new(tmp_path, "runner", "odd", "--backend", "onnxruntime", "--model", "models:odd")
    text = (runner / "plugin.toml").read_text()
    assert tomllib.loads(text) == {
        "plugin": {"name": "odd", "version": "1.0.0", "type": "runner",
                   "description": "TODO: say what odd computes"},
        "runner": {"backend": "onnxruntime", "model": "models:odd", "max_batch_size": 8,
                   "max_queue_delay_ms": 1.0},
        "route": {"name": "odd"},
    }  # fmt: skip
    # Shown in a comment, each name a TOML string (its escapes are JSON's here).
    assert f"#   input  {json.dumps(x)} FP32 [-1, 2]\n" in text
    assert f"#   output {json.dumps(y)} FP32 [-1, 2]\n" in text
    result = plugserve("validate", str(runner), "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    metadata = json.loads(result.stdout)["metadata"]
    assert [t["name"] for t in metadata["inputs"] + metadata["outputs"]] == [x, y]


@pytest.mark.parametrize("name", ["none", "true", "1st", "a--b_c", "class", "lambda"])
@pytest.mark.parametrize("kind", ["runner", "preprocessor", "postprocessor"])
def test_every_file_new_writes_reads_back_whatever_the_name(kind: str, name: str) -> None:
    """A valid plugin name that is a keyword once capitalized (``none``: ``None``) or starts
    with a digit made ``class None:``, a module that did not compile."""
    files = package_files(kind, name, "1.0.0")
    manifest = tomllib.loads(files["plugin.toml"])
    assert manifest["plugin"]["name"] == name and manifest["plugin"]["type"] == kind
    for module in ("plugin.py", "test_plugin.py"):
        compile(files[module], module, "exec")


def test_a_processor_named_none_validates_and_passes_its_tests(tmp_path: Path) -> None:
    folder = new(tmp_path, "preprocessor", "none")
    result = plugserve("validate", str(folder), "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_plugin.py"],
        cwd=folder, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout + tests.stderr
