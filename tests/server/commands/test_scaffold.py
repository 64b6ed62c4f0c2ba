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

from plugserve.registry.manifest import load_manifest
from plugserve.server.commands.scaffold import onnx_runner_files, package_files
from tests.helpers import ServerProcess, accumulator_model, add_model, vad_model
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


def uncommented_hints(text: str) -> str:
    """``text`` with the tables ``new`` suggests uncommented: the comment lines after the
    empty one that follows "uncomment what fits", up to the next line that is no comment."""
    head, found, rest = text.partition("uncomment what fits")
    assert found, text
    prose, _, block = rest.partition("\n#\n")
    lines = block.split("\n")
    end = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    tables = [line.removeprefix("#").removeprefix(" ") for line in lines[:end]]
    return "\n".join([head + found + prose, "#", *tables, *lines[end:]])


def test_a_model_with_a_fixed_first_axis_gets_its_batching_and_state_commented_out(
    tmp_path: Path,
) -> None:
    """A streaming VAD's shapes (``state`` [2, N, 3] and ``stateN``, a scalar ``sr``): no
    batching as written, the declarations that batch it and keep its state below,
    commented out, and uncommented they are a manifest that validate loads."""
    vad_model(tmp_path / "models/vad/1/model.onnx")
    runner = new(tmp_path, "runner", "vad", "--backend", "onnxruntime", "--model", "models:vad")
    text = (runner / "plugin.toml").read_text()
    assert tomllib.loads(text)["runner"]["max_batch_size"] == 0
    assert set(tomllib.loads(text)["runner"]) == {"backend", "model", "max_batch_size",
                                                  "max_queue_delay_ms"}  # fmt: skip
    assert "# max_batch_size: 0 until the rows' axes below are declared" in text
    assert '[runner.batching] ("Declared batching")' in text
    assert '[runner.sequence] ("Sequences"): "state" and "stateN" look like' in text
    for line in ("[runner.batching.inputs]", "state = { axis = 1 }", "sr = { shared = true }",
                 "[runner.batching.outputs]", "stateN = { axis = 1 }", "[runner.sequence]",
                 "[[runner.sequence.state]]", 'input = "state"', 'output = "stateN"',
                 'datatype = "FP32"', "shape = [2, 3]"):  # fmt: skip
        assert f"\n# {line}\n" in text, line
    assert "# input  " not in text.split("uncomment what fits")[1]  # the listing stays above

    manifest = runner / "plugin.toml"
    manifest.write_text(
        uncommented_hints(text).replace("max_batch_size = 0", "max_batch_size = 16")
    )
    checked = load_manifest(runner, check_layout=False)
    assert checked.runner is not None and checked.runner.batching is not None
    assert checked.runner.batching.input("state").axis == 1
    assert checked.runner.batching.input("sr").shared
    assert dict(checked.runner.batching.outputs) == {"stateN": 1}
    assert checked.runner.sequence is not None
    (state,) = checked.runner.sequence.states
    assert (state.input, state.output, state.datatype, state.shape) == (
        "state", "stateN", "FP32", (2, 3))  # fmt: skip
    result = plugserve("validate", str(runner), "--models-dir", str(tmp_path / "models"),
                       "--json", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    metadata = json.loads(result.stdout)["metadata"]
    assert [t["name"] for t in metadata["inputs"]] == ["input", "sr"]  # the state is the server's


def test_a_batching_model_with_a_state_gets_only_the_sequence_commented_out(
    tmp_path: Path,
) -> None:
    model = accumulator_model(tmp_path / "acc" / "model.onnx")
    text = onnx_runner_files("acc", "1.0.0", "model.onnx", model)["plugin.toml"]
    assert "max_batch_size = 8\n" in text and "[runner.batching" not in text
    assert '"state_in" and "state_out" look like a recurrent' in text
    assert '\n# input = "state_in"\n# output = "state_out"\n# datatype = "FP32"\n' in text
    assert "\n# shape = [4]\n" in text
    data = tomllib.loads(uncommented_hints(text))
    assert data["runner"]["sequence"] == {"idle_timeout_s": 60, "state": [
        {"input": "state_in", "output": "state_out", "datatype": "FP32", "shape": [4]}]}  # fmt: skip
    assert data["runner"]["max_batch_size"] == 8 and "batching" not in data["runner"]


def fixed_model(path: Path, x: list[int | str], y: list[int | str], op: str = "Identity") -> Path:
    """An ONNX model of one node from FP32 input ``x`` to output ``y`` of those shapes."""
    node = (helper.make_node(op, ["x"], ["y"], keepdims=0) if op == "ReduceSum"
            else helper.make_node(op, ["x"], ["y"]))  # fmt: skip
    graph = helper.make_graph(
        [node], "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize(
    ("x", "y", "op"),
    [
        ([1, 4], [1, 4], "Identity"),  # nothing free: nothing to batch on
        ([2, "N"], [], "ReduceSum"),  # an answer with no rows to split
        (["N", 4], ["N", 4], "Identity"),  # it batches as it is
    ],
)
def test_a_model_whose_shapes_suggest_nothing_gets_no_hint(
    tmp_path: Path, x: list[int | str], y: list[int | str], op: str
) -> None:
    model = fixed_model(tmp_path / "model.onnx", x, y, op)
    text = onnx_runner_files("plain", "1.0.0", "model.onnx", model)["plugin.toml"]
    assert "uncomment what fits" not in text and "[runner.batching" not in text
    batches = x[0] == "N"
    assert ("max_batch_size = 8\n" if batches else "max_batch_size = 0\n") in text
    if not batches:
        assert "# max_batch_size: 0: a fixed first axis cannot batch.\n" in text
