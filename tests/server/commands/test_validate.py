"""``plugserve validate``: a package anywhere, the models dir of the current directory, the
chain against a plugins folder, exit codes per outcome, and the symlink rule kept."""

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import ROOT, write_add_runner, write_plugin
from tests.server.test_cli import plugserve

pytestmark = pytest.mark.slow


def staged_iris(tmp_path: Path) -> Path:
    """The bundled iris runner copied to ``build/iris-2.0.0``, as the docs stage a release."""
    folder = tmp_path / "build" / "iris-2.0.0"
    shutil.copytree(ROOT / "plugins/runner/iris/1.0.0", folder)
    manifest = folder / "plugin.toml"
    manifest.write_text(manifest.read_text().replace('version = "1.0.0"', 'version = "2.0.0"'))
    return folder


def test_a_staged_package_validates_with_its_chain_checked(tmp_path: Path) -> None:
    """issue 17: `plugserve validate build/iris-2.0.0` failed on the folder names."""
    folder = staged_iris(tmp_path)
    result = plugserve(
        "validate", "build/iris-2.0.0", "--models-dir", str(ROOT / "models"),
        "--plugins-dir", str(ROOT / "plugins"), "--json", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["outcome"] == "valid" and report["problems"] == []
    assert (report["plugin"], report["type"], report["version"]) == (
        "runner/iris@2.0.0",
        "runner",
        "2.0.0",
    )
    assert report["path"] == str(folder) and report["layout_checked"] is False
    assert report["models_dir"] == str(ROOT / "models")
    assert [(s["ref"], s["resolved"]) for s in report["chain"]] == [
        ("scale", "1.0.0"),
        ("label", "1.0.0"),
    ]
    assert report["metadata"]["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]


def test_the_models_dir_defaults_to_the_current_directory_and_is_printed(tmp_path: Path) -> None:
    """issue 17: without --models-dir, validate used the clone's bundled models."""
    staged_iris(tmp_path)
    result = plugserve("validate", "build/iris-2.0.0", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"models dir:  {tmp_path / 'models'}" in result.stdout
    assert "runner/iris@2.0.0: INVALID" in result.stdout
    assert "models:iris" in result.stdout  # the model it could not find there
    (tmp_path / "models").symlink_to(ROOT / "models")
    result = plugserve("validate", "build/iris-2.0.0", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    report = json.loads(result.stdout)
    assert report["models_dir"] == str(tmp_path / "models")
    assert report["notes"] == ["the chain was not checked: give --plugins-dir"]


def test_a_chain_stage_that_does_not_exist_is_an_error(plugins_dir: Path) -> None:
    """issue 17: a chain naming a missing plugin passed, and the route answered 503."""
    route = '[route]\npreprocess = ["there", "missing"]\npostprocess = ["there@2.0.0"]\n'
    write_plugin(plugins_dir, "preprocessor", "there", "1.0.0", files={"plugin.py": ""})
    write_plugin(plugins_dir, "postprocessor", "there", "1.0.0", files={"plugin.py": ""})
    folder = write_add_runner(plugins_dir, "chained", "1.0.0", route=route)
    result = plugserve("validate", str(folder), "--json")  # its plugins folder: where it lies
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["outcome"] == "invalid" and report["layout_checked"] is True
    assert report["plugins_dir"] == str(plugins_dir)
    assert [(s["stage"], s["ref"], s["resolved"]) for s in report["chain"]] == [
        ("preprocess", "there", "1.0.0"),
        ("preprocess", "missing", None),
        ("postprocess", "there@2.0.0", None),
    ]
    assert len(report["problems"]) == 2
    assert "preprocessor missing has no version" in report["problems"][0]
    assert "postprocessor there@2.0.0 has no version 2.0.0" in report["problems"][1]
    assert report["metadata"] is not None  # the package itself loaded


def test_the_folder_layout_is_checked_inside_a_plugins_folder(plugins_dir: Path) -> None:
    folder = write_add_runner(plugins_dir, "newcomer", "1.0.0")
    moved = plugins_dir / "runner" / "renamed" / "1.0.0"
    moved.parent.mkdir()
    folder.rename(moved)
    result = plugserve("validate", str(moved), "--json")
    assert result.returncode == 1
    assert "'newcomer' differs from folder 'renamed'" in json.loads(result.stdout)["problems"][0]


@pytest.mark.parametrize("backend", [True, False])
def test_an_unknown_runner_key_is_an_error(plugins_dir: Path, backend: bool) -> None:
    """issue 17: a typo in [runner] must not pass, with a backend or a module."""
    if backend:
        folder = write_add_runner(plugins_dir, "typo", "1.0.0", runner="max_batch_sise = 8")
    else:
        source = "import pluggy\nhookimpl = pluggy.HookimplMarker('plugserve')\n"
        folder = write_plugin(
            plugins_dir, "runner", "typo", "1.0.0", "[runner]\nmax_batch_sise = 8\n",
            files={"plugin.py": source},
        )  # fmt: skip
    result = plugserve("validate", str(folder), "--json")
    assert result.returncode == 1
    assert "unknown key(s) ['max_batch_sise']" in json.loads(result.stdout)["problems"][0]


def test_a_staged_package_keeps_the_symlink_rule(tmp_path: Path) -> None:
    """Staged anywhere, a package may read only its own folder and the models dir."""
    outside = tmp_path / "outside.py"
    outside.write_text("X = 1\n")
    folder = tmp_path / "build" / "linked"
    write_plugin(tmp_path / "src", "preprocessor", "linked", "1.0.0", files={"plugin.py": ""})
    shutil.copytree(tmp_path / "src/preprocessor/linked/1.0.0", folder)
    os.symlink(outside, folder / "helper.py")
    result = plugserve("validate", str(folder), "--models-dir", str(tmp_path / "src"), "--json")
    assert result.returncode == 1
    assert "leads outside the plugins dir" in json.loads(result.stdout)["problems"][0]


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    result = plugserve("validate", str(tmp_path / "nope"), "--json")
    assert result.returncode == 2
    report = json.loads(result.stdout)
    assert report["outcome"] == "error" and "no such folder" in report["problems"][0]
    result = plugserve("validate", str(tmp_path))
    assert result.returncode == 2 and "no plugin.toml here" in result.stderr
    folder = staged_iris(tmp_path)
    result = plugserve("validate", str(folder), "--plugins-dir", str(tmp_path / "nope"))
    assert result.returncode == 2 and "--plugins-dir" in result.stderr
    result = plugserve("validate", str(folder), "--models-dir", str(tmp_path / "nope"))
    assert result.returncode == 2 and "--models-dir" in result.stderr


def test_what_a_package_prints_leaves_the_json_report_whole(tmp_path: Path) -> None:
    """Attack round after issue 17: a module printing at import broke `validate --json`."""
    folder = staged_iris(tmp_path)
    (folder / "noisy.py").write_text('import sys\nprint("HELLO")\nsys.stdout.write("{bad")\n')
    manifest = folder / "plugin.toml"  # the module is imported beside the backend
    manifest.write_text(
        manifest.read_text().replace("[runner]", 'module = "noisy.py"\n\n[runner]', 1)
    )
    result = plugserve(
        "validate", str(folder), "--models-dir", str(ROOT / "models"), "--json", cwd=tmp_path
    )
    report = json.loads(result.stdout)  # one object, whatever the package printed
    assert report["outcome"] == "valid", report
    assert "HELLO" in result.stderr


def test_requirements_the_environment_lacks_are_listed_with_their_pip_command(
    tmp_path: Path,
) -> None:
    """``[plugin] requires``: what is not installed, or not in the version asked for, is
    named at load (and so by validate and the server's last_error), with the command."""
    folder = staged_iris(tmp_path)
    manifest = folder / "plugin.toml"
    requires = ('requires = ["numpy>=1", "numpy<1", "plugserve-no-such-package>=2", '
                "\"pywin32; sys_platform == 'win32'\"]\n")  # fmt: skip
    manifest.write_text(manifest.read_text().replace("[runner]", requires + "\n[runner]", 1))
    result = plugserve("validate", "build/iris-2.0.0", "--models-dir", str(ROOT / "models"),
                       "--json", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    (problem,) = json.loads(result.stdout)["problems"]
    assert "numpy<1 (" in problem and "installed)" in problem
    assert "plugserve-no-such-package>=2 (not installed)" in problem
    assert "pywin32" not in problem and "numpy>=1" not in problem  # met, or not for here
    assert "pip install 'numpy<1' 'plugserve-no-such-package>=2'" in problem
    manifest.write_text(manifest.read_text().replace('"numpy<1", ', "").replace(
        '"plugserve-no-such-package>=2", ', ""))  # fmt: skip
    result = plugserve("validate", "build/iris-2.0.0", "--models-dir", str(ROOT / "models"),
                       "--json", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout
    manifest.write_text(manifest.read_text().replace('"numpy>=1"', '"numpy >>> 1"'))
    result = plugserve("validate", "build/iris-2.0.0", "--json", cwd=tmp_path)
    assert result.returncode == 1 and "is not a requirement" in result.stdout, result.stdout


def test_every_problem_of_a_manifest_is_listed(tmp_path: Path) -> None:
    """Not only the first: each problem names its field, and the rest are still checked."""
    folder = tmp_path / "build" / "many"
    source = "import pluggy\nhookimpl = pluggy.HookimplMarker('plugserve')\n"
    write_plugin(
        tmp_path / "src", "runner", "many", "1.0.0",
        "[runner]\nmax_batch_sise = 8\nmax_batch_size = -1\ninstances = \"two\"\n"
        "[runner.batching.inputs]\nx = { axis = 99 }\n[route]\npreprocess = 5\n",
        files={"plugin.py": source},
    )  # fmt: skip
    shutil.copytree(tmp_path / "src/runner/many/1.0.0", folder)
    result = plugserve("validate", str(folder), "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    problems = json.loads(result.stdout)["problems"]
    for field in ("runner: unknown key(s) ['max_batch_sise']", "runner.max_batch_size:",
                  "runner.instances:", "runner.batching.inputs.x.axis:", "route.preprocess:"):  # fmt: skip
        assert sum(field in p for p in problems) == 1, (field, problems)
    assert len(problems) == 5, problems


def test_staged_packages_that_name_each_other_validate_together(tmp_path: Path) -> None:
    """A release of a runner and the preprocessor version it pins, staged side by side:
    alone the runner's chain misses the preprocessor; together it resolves."""
    runner = staged_iris(tmp_path)
    manifest = runner / "plugin.toml"
    manifest.write_text(manifest.read_text().replace('"scale"', '"scale@2.0.0"'))
    scale = tmp_path / "build" / "scale-2.0.0"
    shutil.copytree(ROOT / "plugins/preprocessor/scale/1.0.0", scale)
    text = (scale / "plugin.toml").read_text()
    (scale / "plugin.toml").write_text(text.replace('version = "1.0.0"', 'version = "2.0.0"'))
    common = ("--models-dir", str(ROOT / "models"), "--plugins-dir", str(ROOT / "plugins"))
    alone = plugserve("validate", str(runner), *common, "--json", cwd=tmp_path)
    assert alone.returncode == 1
    assert (
        "preprocessor scale@2.0.0 has no version 2.0.0" in json.loads(alone.stdout)["problems"][0]
    )
    both = plugserve("validate", str(runner), str(scale), *common, "--json", cwd=tmp_path)
    assert both.returncode == 0, both.stdout + both.stderr
    report = json.loads(both.stdout)
    assert report["outcome"] == "valid"
    assert [p["plugin"] for p in report["packages"]] == [
        "runner/iris@2.0.0", "preprocessor/scale@2.0.0",
    ]  # fmt: skip
    assert report["packages"][0]["chain"][0] == {
        "stage": "preprocess", "ref": "scale@2.0.0", "resolved": "2.0.0",
    }  # fmt: skip
    text_report = plugserve("validate", str(runner), str(scale), *common, cwd=tmp_path)
    assert text_report.returncode == 0
    assert "runner/iris@2.0.0: valid" in text_report.stdout
    assert "preprocessor/scale@2.0.0: valid" in text_report.stdout


def test_a_requirement_whose_marker_cannot_be_evaluated_is_a_manifest_problem(
    tmp_path: Path,
) -> None:
    """A marker that parses but cannot be evaluated (``python_version ~= 'abc'``) is a
    manifest problem: `validate --json` reports it as JSON, never a traceback."""
    folder = staged_iris(tmp_path)
    manifest = folder / "plugin.toml"
    requires = "requires = [\"numpy; python_version ~= 'abc'\"]\n"
    manifest.write_text(manifest.read_text().replace("[runner]", requires + "\n[runner]", 1))
    result = plugserve("validate", str(folder), "--models-dir", str(ROOT / "models"), "--json")
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    (problem,) = report["problems"]
    assert "plugin.requires[0]" in problem and "cannot be evaluated" in problem, problem


def test_a_check_that_fails_unexpectedly_is_reported_never_a_traceback(tmp_path: Path) -> None:
    """Whatever goes wrong inside the check (here the file system's own error: a model that
    is a symlink to itself) is that package's problem, outcome error and exit 2, in the
    JSON report; the other packages are still checked."""
    loop = tmp_path / "build" / "loop"
    loop.mkdir(parents=True)
    (loop / "plugin.toml").write_text(
        '[plugin]\nname = "loop"\nversion = "1.0.0"\ntype = "runner"\n'
        '[runner]\nbackend = "onnxruntime"\nmodel = "m.onnx"\n'
    )
    (loop / "m.onnx").symlink_to("m.onnx")
    iris = staged_iris(tmp_path)
    common = ("--models-dir", str(ROOT / "models"), "--json")
    result = plugserve("validate", str(loop), *common)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["outcome"] == "error" and report["path"] == str(loop)
    (problem,) = report["problems"]
    assert "the check itself failed: OSError" in problem, problem
    both = plugserve(
        "validate", str(loop), str(iris), *common, "--plugins-dir", str(ROOT / "plugins")
    )
    assert both.returncode == 2 and "Traceback" not in both.stderr, both.stderr
    outcomes = [p["outcome"] for p in json.loads(both.stdout)["packages"]]
    assert outcomes == ["error", "valid"]
    text = plugserve("validate", str(loop), "--models-dir", str(ROOT / "models"))
    assert text.returncode == 2 and "not checked" in text.stdout and "Traceback" not in text.stderr
