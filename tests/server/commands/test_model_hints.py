"""What a model's shapes suggest its manifest declare: declared batching for a fixed first
axis, a sequence's state for inputs and outputs named and shaped like one."""

import tomllib

import pytest

from plugserve.server.commands.model_hints import Tensor, looks_like_state, shape_hints
from plugserve.server.commands.scaffold import hints_comment


def tensors(*specs: tuple[str, str, list[int]], datatype: str = "FP32") -> list[Tensor]:
    return [Tensor(kind, name, datatype, tuple(dims)) for kind, name, dims in specs]


@pytest.mark.parametrize(
    "name", ["state", "stateN", "state_in", "state_out", "h0", "hn", "c0", "cn", "hidden_state",
             "lstm.c_out", "initialState", "memory"],
)  # fmt: skip
def test_names_of_a_recurrent_state(name: str) -> None:
    assert looks_like_state(name)


@pytest.mark.parametrize(
    "name", ["x", "y", "input", "output", "sr", "chunk", "logits", "channel", "mean", "in"]
)
def test_names_of_anything_else(name: str) -> None:
    assert not looks_like_state(name)


def test_an_lstm_pairs_each_state_with_the_output_named_after_it() -> None:
    """``h0`` with ``hn`` and ``c0`` with ``cn``, whatever order the outputs come in; the
    rows of each on axis 1, the state's shape without it."""
    model = tensors(
        ("input", "x", [-1, 4]), ("input", "h0", [1, -1, 8]), ("input", "c0", [1, -1, 8]),
        ("output", "y", [-1, 4]), ("output", "cn", [1, -1, 8]), ("output", "hn", [1, -1, 8]),
    )  # fmt: skip
    hints = shape_hints(model)
    assert [(s.input.name, s.output.name) for s in hints.states] == [("h0", "hn"), ("c0", "cn")]
    assert [s.table()["shape"] for s in hints.states] == [[1, 8], [1, 8]]
    assert hints.batching
    assert hints.inputs == {"h0": {"axis": 1}, "c0": {"axis": 1}}
    assert hints.outputs == {"cn": {"axis": 1}, "hn": {"axis": 1}}


def test_a_state_output_whose_shape_the_model_leaves_free_still_pairs() -> None:
    """ONNX Runtime often reports a state output's sizes as free: it takes the rows'
    axis of its input."""
    model = tensors(
        ("input", "input", [-1, 512]), ("input", "state", [2, -1, 128]),
        ("output", "output", [-1, 1]), ("output", "stateN", [-1, -1, -1]),
    )  # fmt: skip
    hints = shape_hints(model)
    (state,) = hints.states
    assert state.table() == {"input": "state", "output": "stateN", "datatype": "FP32",
                             "shape": [2, 128]}  # fmt: skip
    assert hints.outputs == {"stateN": {"axis": 1}}


@pytest.mark.parametrize(
    "model",
    [
        # Shapes alike but for their names.
        tensors(("input", "x", [-1, 4]), ("output", "y", [-1, 4])),
        # A state whose one sequence's shape is not fixed (two free axes).
        tensors(("input", "state", [-1, -1]), ("output", "stateN", [-1, -1])),
        # Named like one, of different shapes or datatypes.
        tensors(("input", "state", [-1, 4]), ("output", "stateN", [-1, 5])),
        [Tensor("input", "h", "FP32", (-1, 4)), Tensor("output", "hn", "FP16", (-1, 4))],
        # A datatype no state holds.
        tensors(("input", "state", [-1, 4]), ("output", "stateN", [-1, 4]), datatype="BYTES"),
    ],
)
def test_no_state_where_names_shapes_or_datatypes_disagree(model: list[Tensor]) -> None:
    hints = shape_hints(model)
    assert hints.states == () and not hints


def test_hints_read_back_as_tables_whatever_the_names() -> None:
    """A name with a newline, a dot or quotes is a quoted key, and the hint's TOML reads
    back as exactly the names the model gave."""
    state, odd = 'state"\n[route]', "rate.hz"
    model = tensors(
        ("input", "x", [-1, 4]), ("input", state, [2, -1, 3]), ("input", odd, []),
        ("output", "y", [-1, 4]), ("output", state + "N", [2, -1, 3]),
    )  # fmt: skip
    text = hints_comment(shape_hints(model))
    assert all(line.startswith("#") for line in text.splitlines())
    toml = "\n".join(line.removeprefix("# ") for line in text.split("\n#\n", 1)[1].splitlines())
    assert tomllib.loads(toml)["runner"] == {
        "batching": {
            "inputs": {state: {"axis": 1}, odd: {"shared": True}},
            "outputs": {state + "N": {"axis": 1}},
        },
        "sequence": {"idle_timeout_s": 60, "state": [
            {"input": state, "output": state + "N", "datatype": "FP32", "shape": [2, 3]}]},
    }  # fmt: skip
