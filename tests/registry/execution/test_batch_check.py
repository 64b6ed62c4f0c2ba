"""The batching check on real ONNX Runtime sessions (exact, dynamically quantized, padded
with and without masking, refusing batches), its sample requests, the one-request probe
of declared output shapes, the ``[runner.batching] check`` manifest key, and a failed
batch run again one by one: counted, and said once."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from plugserve.registry.errors import ManifestError, PluginError
from plugserve.registry.execution.batch_check import (
    Execute,
    check_batching,
    probe_outputs,
    sample_requests,
)
from plugserve.registry.execution.batching import BatchPolicy, Scheduler
from plugserve.registry.execution.layout import BatchLayout
from plugserve.registry.execution.scheduling import batch_execution
from plugserve.registry.execution.stats import RunnerStats
from plugserve.registry.manifest import (
    BatchCheckSpec,
    BatchingSection,
    InputBatching,
    Manifest,
    load_manifest,
)
from plugserve.registry.tensors.inputs import input_specs
from tests.batching_models import (
    dense_model,
    pair_model,
    quantized_model,
    ragged_model,
)
from tests.helpers import write_plugin

Arrays = Mapping[str, np.ndarray]
PADDED = BatchLayout(BatchingSection({"x": InputBatching(ragged="pad", ragged_axes=(1,))}))


def session(model: Path) -> tuple[Execute, Any]:
    """An ``execute`` over ONNX Runtime, and the model's declared tensors as metadata."""
    runs = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in runs.get_outputs()]

    async def execute(inputs: Arrays) -> Arrays:
        return dict(zip(names, runs.run(names, dict(inputs)), strict=True))

    def dims(shape: list[Any]) -> list[int]:
        return [d if isinstance(d, int) else -1 for d in shape]

    metadata = {
        kind: [{"name": t.name, "datatype": "FP32", "shape": dims(t.shape)} for t in tensors]
        for kind, tensors in (("inputs", runs.get_inputs()), ("outputs", runs.get_outputs()))
    }
    return execute, metadata


async def check(model: Path, layout: BatchLayout | None = None, **spec: Any) -> Any:
    execute, metadata = session(model)
    return await check_batching(
        execute, layout, input_specs(metadata), BatchCheckSpec(**spec), max_batch_size=8
    )


async def test_a_model_whose_rows_are_independent_is_exact(tmp_path: Path) -> None:
    found = await check(dense_model(tmp_path / "dense.onnx"))
    assert found.exact and found.requests == 8 and found.differences == ()
    assert found.text() == "exact: 8 requests alone and batched (rtol 1e-05, atol 1e-05)"


async def test_a_dynamically_quantized_model_is_found_and_its_output_named(
    tmp_path: Path,
) -> None:
    found = await check(quantized_model(tmp_path / "q.onnx"))
    assert not found.exact and found.outputs == ["y"]
    (difference,) = found.differences
    assert difference.requests >= 4 and 1e-3 < difference.largest < 10
    (problem,) = found.problems()
    assert problem.startswith("batching changes output 'y' in ")
    assert "largest difference" in problem and "(rtol 1e-05, atol 1e-05)" in problem
    assert "dynamic quantization" in (found.why() or "")
    # The differences are the quantization's: a tolerance above them passes the same model.
    assert (await check(quantized_model(tmp_path / "q.onnx"), atol=difference.largest)).exact


async def test_padding_is_exact_only_where_the_model_masks_it(tmp_path: Path) -> None:
    """Zeros padded onto a sum change nothing; onto a mean, they change every shorter row."""
    summed = await check(ragged_model(tmp_path / "sum.onnx", "ReduceSum"), PADDED)
    assert summed.exact and summed.padded
    averaged = await check(ragged_model(tmp_path / "mean.onnx", "ReduceMean"), PADDED)
    assert averaged.outputs == ["y"] and averaged.padded


async def test_a_batch_the_model_refuses_is_a_failure_not_a_pass(tmp_path: Path) -> None:
    """``a [1, 1] @ b [1, 4]`` runs alone; stacked, ``b``'s rows are ``a``'s inner dimension
    no more, and ONNX Runtime refuses the batch. (No declared shape says that the two must
    agree: a sample file gives the requests.)"""
    rng = np.random.default_rng(5)
    requests = {f"{i}/{name}": rng.standard_normal(shape).astype(np.float32)
                for i in range(3) for name, shape in (("a", (1, 1)), ("b", (1, 4)))}  # fmt: skip
    np.savez(tmp_path / "pairs.npz", **requests)
    found = await check(pair_model(tmp_path / "pair.onnx"), sample=tmp_path / "pairs.npz")
    assert not found.exact and found.failed is not None
    assert "MatMul" in found.failed
    assert found.problems()[0].startswith("a batch of 3 sample requests failed where each alone")


async def test_requests_that_never_batch_are_not_checked(tmp_path: Path) -> None:
    layout = BatchLayout(BatchingSection())
    execute, _ = session(dense_model(tmp_path / "dense.onnx"))
    scalar = input_specs({"inputs": [{"name": "x", "datatype": "FP32", "shape": []}]})
    found = await check_batching(execute, layout, scalar, BatchCheckSpec(), 8)
    assert found.exact and found.skipped is not None
    assert "requests never batch: input 'x' has 0 dimensions" in found.skipped


async def test_a_sample_file_gives_the_requests(tmp_path: Path) -> None:
    rows = np.random.default_rng(3).standard_normal((3, 16)).astype(np.float32)
    np.savez(tmp_path / "rows.npz", x=rows)
    found = await check(dense_model(tmp_path / "d.onnx"), sample=tmp_path / "rows.npz")
    assert found.exact and found.requests == 3
    named = {f"{i}/x": rows[i : i + 1] * (10**i) for i in range(3)}
    np.savez(tmp_path / "named.npz", **named)
    found = await check(quantized_model(tmp_path / "q.onnx"), sample=tmp_path / "named.npz")
    assert found.requests == 3 and found.outputs == ["y"]
    np.savez(tmp_path / "bad.npz", x=rows, y=rows[:2])
    found = await check(dense_model(tmp_path / "d.onnx"), sample=tmp_path / "bad.npz")
    assert not found.exact and "as many rows each" in (found.error or "")


def test_sample_requests_are_one_row_each_and_ragged_where_declared() -> None:
    specs = input_specs({"inputs": [
        {"name": "x", "datatype": "FP32", "shape": [-1, -1]},
        {"name": "ids", "datatype": "INT64", "shape": [-1, 5]},
    ]})  # fmt: skip
    requests = sample_requests(specs, PADDED, 8, seed=1)
    assert {r["x"].shape[0] for r in requests} == {1} and len({r["x"].shape for r in requests}) > 1
    assert all(r["ids"].shape == (1, 5) and r["ids"].dtype == np.int64 for r in requests)
    again = sample_requests(specs, PADDED, 8, seed=1)
    assert all(np.array_equal(a["x"], b["x"]) for a, b in zip(requests, again, strict=True))


async def test_the_probe_names_an_output_shape_the_model_contradicts(tmp_path: Path) -> None:
    """A model declaring ``y [1, 8]`` that returns a row per input row: ONNX Runtime keeps
    the declaration (and warns on every run); two rows show it."""
    execute, metadata = session(dense_model(tmp_path / "d.onnx", out_batch=1))
    assert metadata["outputs"][0]["shape"] == [1, 8]
    (said,) = await probe_outputs(execute, None, input_specs(metadata), metadata, batching=True)
    assert said == (
        "output 'y' is declared [1, 8] (-1: any) and the model returned [2, 8] for an input "
        "of 2 row(s)"
    )
    execute, metadata = session(dense_model(tmp_path / "e.onnx"))
    assert await probe_outputs(execute, None, input_specs(metadata), metadata, True) == []


async def test_the_probe_names_an_output_whose_rows_are_on_another_axis() -> None:
    async def execute(inputs: Arrays) -> Arrays:  # [T, N, 8]: its rows on axis 1
        return {"y": np.zeros((5, inputs["x"].shape[0], 8), np.float32)}

    metadata = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}],
                "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, -1]}]}  # fmt: skip
    said = await probe_outputs(execute, None, input_specs(metadata), metadata, batching=True)
    assert said == [
        "output 'y' is declared [1, -1] (-1: any) and the model returned [5, 2, 8] for an "
        "input of 2 row(s)",
        "output 'y' holds 5 on its batch axis 0 ([5, 2, 8]) for an input of 2 row(s): a batch "
        "cannot be split into answers; declare the axis its rows are on in "
        "[runner.batching.outputs]",
    ]


def manifest(tmp_path: Path, check: str) -> Manifest:
    runner = f'[runner]\nbackend = "onnxruntime"\nmodel = "m.onnx"\n[runner.batching]\n{check}\n'
    return load_manifest(write_plugin(tmp_path, "runner", "c", "1.0.0", runner, module=None))


def check_of(found: Manifest) -> BatchCheckSpec | None:
    assert found.runner is not None and found.runner.batching is not None
    return found.runner.batching.check


def test_the_manifest_reads_a_check_as_true_or_a_table(tmp_path: Path) -> None:
    table = manifest(tmp_path, 'check = { rtol = 1e-3, atol = 0.5, seed = 4, sample = "s.npz" }')
    assert check_of(table) == BatchCheckSpec(1e-3, 0.5, 4, table.path / "s.npz")
    assert check_of(manifest(tmp_path, "check = true")) == BatchCheckSpec()
    assert check_of(manifest(tmp_path, "check = false")) is None
    for bad, said in (("check = 1", "must be true, false or a table"),
                      ("check = { sample = '../s.npz' }", "must stay inside the plugin folder"),
                      ("check = { rtol = -1 }", "check.rtol: must be a finite number")):  # fmt: skip
        with pytest.raises(ManifestError, match=said):
            manifest(tmp_path, bad)


class Said:
    """Stands in for the scheduler's logger: what it warned."""

    def __init__(self) -> None:
        self.warnings: list[dict[str, Any]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append({"event": event, **fields})


async def test_a_batch_run_again_one_by_one_is_counted_and_said_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A runner that refuses every batch of several rows: each batch is one execution more
    than its requests, counted in the statistics, and the first said in the log."""
    said = Said()
    monkeypatch.setattr(batch_execution, "log", said)
    gate = asyncio.Event()

    async def execute(inputs: Arrays) -> Arrays:
        await gate.wait()
        if inputs["x"].shape[0] > 1:
            raise PluginError("runner/t@1.0.0", ValueError("a batch of one row only"))
        return {"y": inputs["x"] * 2}

    stats = RunnerStats()
    scheduler = Scheduler(execute, BatchPolicy(max_batch_size=8), "runner/t@1.0.0",
                          on_execution=stats.record_execution,
                          on_fallback=stats.record_fallback)  # fmt: skip
    rows = [{"x": np.full((1, 2), float(i), np.float32)} for i in range(7)]
    first = asyncio.ensure_future(scheduler.submit(rows[0]))
    await asyncio.sleep(0)
    waves = [asyncio.ensure_future(scheduler.submit(r)) for r in rows[1:4]]
    gate.set()
    answers = await asyncio.gather(first, *waves)
    gate.clear()
    second = asyncio.ensure_future(scheduler.submit(rows[4]))
    await asyncio.sleep(0)
    more = [asyncio.ensure_future(scheduler.submit(r)) for r in rows[5:]]
    gate.set()
    answers += await asyncio.gather(second, *more)
    assert [a["y"][0, 0] for a in answers] == [2.0 * i for i in range(7)]
    assert (stats.batch_fallbacks, stats.fallback_requests) == (2, 5)
    assert scheduler.executions == 7 + 2  # one an answer, and each failed batch
    assert (
        scheduler.fallback_why == "plugin runner/t@1.0.0 raised ValueError: a batch of one row only"
    )
    (warning,) = [w for w in said.warnings if w["event"] == "batch_fallback"]
    assert (warning["runner"], warning["requests"], warning["rows"]) == ("runner/t@1.0.0", 3, 3)
    assert "a batch of one row only" in warning["why"]
    doc = stats.executions_json()
    other = RunnerStats()
    other.add_executions(doc)
    assert (other.batch_fallbacks, other.fallback_requests) == (2, 5)
