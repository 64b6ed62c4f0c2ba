"""``plugserve validate --batching``: the same sample requests alone and batched, answers
compared within ``--rtol``/``--atol``, the outputs batching changes named (exit 1); and
the one-request probe that flags an output shape the model contradicts (a warning)."""

import json
from pathlib import Path

import numpy as np
import pytest

from tests.batching_models import (
    dense_model,
    pair_model,
    quantized_model,
    ragged_model,
    write_model_runner,
)
from tests.server.test_cli import plugserve

pytestmark = pytest.mark.slow

PADDED = 'max_batch_size = 8\n[runner.batching.inputs]\nx = { ragged = "pad", ragged_axes = [1] }\n'


def test_a_dynamically_quantized_model_fails_the_check_naming_its_output(
    plugins_dir: Path,
) -> None:
    folder = write_model_runner(plugins_dir, "scores", quantized_model)
    result = plugserve("validate", str(folder), "--batching")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "runner/scores@1.0.0: INVALID" in result.stdout
    assert "problem: batching changes output 'y' in " in result.stdout
    assert "largest difference" in result.stdout and "dynamic quantization" in result.stdout
    report = json.loads(plugserve("validate", str(folder), "--batching", "--json").stdout)
    (difference,) = report["batching"]["differences"]
    assert difference["output"] == "y" and difference["largest"] > 1e-3
    assert report["batching"]["exact"] is False and report["batching"]["requests"] == 8
    # A tolerance above the largest difference accepts the same answers.
    wide = str(difference["largest"] * 2)
    result = plugserve("validate", str(folder), "--batching", "--atol", wide, "--json")
    assert result.returncode == 0, result.stdout
    assert json.loads(result.stdout)["batching"]["exact"] is True
    # Without --batching the check does not run, and the package is valid.
    result = plugserve("validate", str(folder), "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["batching"] is None


def test_an_exact_model_passes_and_padding_passes_only_where_masked(plugins_dir: Path) -> None:
    exact = write_model_runner(plugins_dir, "dense", dense_model)
    summed = write_model_runner(plugins_dir, "sums", lambda p: ragged_model(p, "ReduceSum"), PADDED)
    result = plugserve("validate", str(exact), str(summed), "--batching", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    for report in json.loads(result.stdout)["packages"]:
        assert report["batching"]["exact"] is True, report
        assert any(n.startswith("batching: exact: 8 requests") for n in report["notes"])
    averaged = write_model_runner(
        plugins_dir, "means", lambda p: ragged_model(p, "ReduceMean"), PADDED
    )
    result = plugserve("validate", str(averaged), "--batching", "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["batching"]["padded"] is True
    assert [d["output"] for d in report["batching"]["differences"]] == ["y"]


def test_a_batch_the_runner_refuses_fails_the_check(tmp_path: Path, plugins_dir: Path) -> None:
    folder = write_model_runner(plugins_dir, "pair", pair_model)
    rng = np.random.default_rng(2)
    requests = {f"{i}/{name}": rng.standard_normal(shape).astype(np.float32)
                for i in range(4) for name, shape in (("a", (1, 1)), ("b", (1, 4)))}  # fmt: skip
    np.savez(tmp_path / "pairs.npz", **requests)
    result = plugserve(
        "validate", str(folder), "--batching", "--sample", str(tmp_path / "pairs.npz")
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "problem: a batch of 4 sample requests failed where each alone ran" in result.stdout
    assert "MatMul" in result.stdout
    # Random requests of its declared shapes cannot run alone: the check says so.
    result = plugserve("validate", str(folder), "--batching")
    assert result.returncode == 1
    assert "the batching check could not run: a sample request failed alone" in result.stdout


def test_a_fixed_batch_axis_is_refused_with_the_fix(plugins_dir: Path) -> None:
    folder = write_model_runner(plugins_dir, "fixed", lambda p: dense_model(p, batch=1))
    result = plugserve("validate", str(folder), "--json")
    assert result.returncode == 1
    (problem,) = json.loads(result.stdout)["problems"]
    assert "max_batch_size = 8, but the model fixes input 'x' to 1 on its batch axis 0" in problem
    assert "set max_batch_size = 0" in problem


def test_an_output_shape_the_model_contradicts_is_a_warning(plugins_dir: Path) -> None:
    folder = write_model_runner(plugins_dir, "declared", lambda p: dense_model(p, out_batch=1))
    result = plugserve("validate", str(folder))
    assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "  warning: output 'y' is declared [1, 8] (-1: any) and the model returned [2, 8] "
        "for an input of 2 row(s)"
    ) in result.stdout
    exact = write_model_runner(plugins_dir, "dense", dense_model)
    assert json.loads(plugserve("validate", str(exact), "--json").stdout)["warnings"] == []


def test_bad_batching_options_are_usage_errors(plugins_dir: Path) -> None:
    folder = write_model_runner(plugins_dir, "dense", dense_model)
    result = plugserve("validate", str(folder), "--batching", "--rtol", "-1")
    assert result.returncode == 2 and "--rtol and --atol are at least 0" in result.stderr
    result = plugserve("validate", str(folder), "--batching", "--sample", "nowhere.npz")
    assert result.returncode == 2 and "--sample nowhere.npz: no such file" in result.stderr
