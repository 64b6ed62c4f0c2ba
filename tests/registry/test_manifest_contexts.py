"""``[[runner.sequence.state]]`` tables with ``from_input``: a sequence's context, kept from
the last samples of a request input (``registry/manifest.py``)."""

from pathlib import Path

import pytest

from plugserve.registry.errors import ManifestError
from plugserve.registry.manifest import ContextSpec, StateSpec, load_manifest

HEAD = "[plugin]\nname='vad'\nversion='1.0.0'\ntype='runner'\n"
RUNNER = HEAD + "[runner]\nbackend='onnxruntime'\n"
SILERO = """
[runner.batching.inputs]
state = { axis = 1 }
sr = { shared = true }

[runner.batching.outputs]
stateN = { axis = 1 }

[runner.sequence]
[[runner.sequence.state]]
input = "state"
output = "stateN"
datatype = "FP32"
shape = [2, 128]

[[runner.sequence.state]]
input = "input"
from_input = "input"
axis = 1
datatype = "FP32"
shape = [64]
"""


def _folder(plugins_dir: Path, text: str, version: str = "1.0.0") -> Path:
    folder = plugins_dir / "runner" / "vad" / version
    folder.mkdir(parents=True)
    (folder / "plugin.toml").write_text(text.replace("'1.0.0'", f"'{version}'"))
    return folder


def test_silero_declares_its_state_and_its_prepended_context(plugins_dir: Path) -> None:
    runner = load_manifest(_folder(plugins_dir, RUNNER + SILERO)).runner
    assert runner is not None and runner.sequence is not None
    sequence = runner.sequence
    assert sequence.states == (StateSpec("state", "stateN", "FP32", (2, 128)),)
    (context,) = sequence.contexts
    assert context == ContextSpec("input", "input", 1, "FP32", (64,), 0.0)
    assert context.prepended and context.length(0) == 64
    # The client sends `input` (its chunk) and `sr`; the server feeds and keeps the rest.
    assert sequence.tensors == {"state", "stateN"}


def test_a_context_of_its_own_and_a_context_across_a_time_major_input(plugins_dir: Path) -> None:
    """The axis defaults to the last; the context's rows sit where its input's do."""
    text = (
        RUNNER
        + """
[runner.batching.inputs]
audio = { axis = 1 }          # [T, N, C]: time-major
[runner.sequence]
[[runner.sequence.state]]
input = "past"
from_input = "features"       # [N, 80, T]
datatype = "FP16"
shape = [80, 8]
initial = -1
[[runner.sequence.state]]
input = "audio"
from_input = "audio"
axis = 0
datatype = "FP32"
shape = [16, 2]
"""
    )
    runner = load_manifest(_folder(plugins_dir, text)).runner
    assert runner is not None and runner.sequence is not None
    past, audio = runner.sequence.contexts
    assert (past.input, past.source, past.axis, past.initial) == ("past", "features", 2, -1.0)
    assert not past.prepended and past.length(0) == 8
    assert audio.prepended and audio.axis == 0 and audio.length(1) == 16
    assert runner.sequence.tensors == {"past"}


STATE = "[runner.sequence]\n[[runner.sequence.state]]\n"
CONTEXT = STATE + "input='input'\nfrom_input='input'\ndatatype='FP32'\n"


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        (STATE + "input='s'\noutput='t'\nfrom_input='x'\ndatatype='FP32'\nshape=[4]\n",
         "runner.sequence.state[0]", "either from a model output"),
        (STATE + "input='s'\ndatatype='FP32'\nshape=[4]\n",
         "runner.sequence.state[0]", "either from a model output"),
        (STATE + "input='s'\noutput='t'\naxis=1\ndatatype='FP32'\nshape=[4]\n",
         "runner.sequence.state[0].axis", "for a state kept from an input"),
        (CONTEXT + "shape=[64]\naxis=2\n", "runner.sequence.state[0].axis",
         "integer >= 0 and <= 1"),
        (CONTEXT + "shape=[]\n", "runner.sequence.state[0].shape", "at least one dimension"),
        (CONTEXT + "shape=[4096, 8192]\n", "runner.sequence.state[0].shape",
         "at most 16777216"),
        (STATE + "input='input'\nfrom_input='input'\ndatatype='INT16'\nshape=[64]\n"
         "initial=70000\n", "runner.sequence.state[0].initial", "not a INT16 value"),
        (STATE + "input='input'\nfrom_input='input'\nshape=[64]\n",
         "runner.sequence.state[0].datatype", "is required"),
        (STATE + "input='input'\nfrom_input='input'\ndatatype='BYTES'\nshape=[64]\n",
         "runner.sequence.state[0].datatype", "one of BOOL"),
        # Its samples on the batch axis: rows, not samples.
        (CONTEXT + "shape=[64]\naxis=0\n", "runner.sequence.state", "batch axis"),
        ("[runner.batching.inputs]\ninput={ axis = 1 }\n" + CONTEXT + "shape=[64]\naxis=1\n",
         "runner.sequence.state", "batch axis"),
        ("[runner.batching.inputs]\ninput={ shared = true }\n" + CONTEXT + "shape=[64]\n",
         "runner.batching.inputs.input", "neither shared nor concatenated"),
        ("[runner.batching.inputs]\ninput={ ragged = 'concat', lengths = 'n' }\n" + CONTEXT
         + "shape=[64]\n", "runner.batching.inputs.input", "neither shared nor concatenated"),
        ("[runner.batching.inputs]\ninput={ axis = 3 }\n" + CONTEXT + "shape=[64]\naxis=0\n",
         "runner.batching.inputs.input", "rows are on an axis from 0 to 1"),
        # A context of its own has its rows where its input has them.
        ("[runner.batching.inputs]\ninput={ axis = 1 }\n" + STATE
         + "input='ctx'\nfrom_input='input'\naxis=0\ndatatype='FP32'\nshape=[64]\n",
         "runner.batching.inputs.ctx", "rows where 'input' has them"),
        ("[runner.batching.inputs]\nctx={ shared = true }\n" + STATE
         + "input='ctx'\nfrom_input='input'\ndatatype='FP32'\nshape=[64]\n",
         "runner.batching.inputs.ctx", "neither shared nor ragged"),
        # The input it is kept from is one each request sends.
        (STATE + "input='s'\noutput='t'\ndatatype='FP32'\nshape=[4]\n"
         "[[runner.sequence.state]]\ninput='ctx'\nfrom_input='s'\ndatatype='FP32'\nshape=[4]\n",
         "runner.sequence.state[1].from_input", "the server feeds or keeps"),
        (STATE + "input='ctx'\nfrom_input='input'\ndatatype='FP32'\nshape=[4]\n"
         "[[runner.sequence.state]]\ninput='more'\nfrom_input='ctx'\ndatatype='FP32'\n"
         "shape=[4]\n", "runner.sequence.state[1].from_input", "the server feeds or keeps"),
        (CONTEXT + "shape=[64]\n[[runner.sequence.state]]\ninput='input'\n"
         "from_input='input'\ndatatype='FP32'\nshape=[32]\n",
         "runner.sequence.state", "of its own"),
        ("[runner.sequence.controls]\nstart='input'\n" + CONTEXT.replace(STATE, "[[runner."
         "sequence.state]]\n") + "shape=[64]\n", "runner.sequence.controls",
         "nor one a state is kept from"),
    ],
)  # fmt: skip
def test_context_errors_name_the_field(
    plugins_dir: Path, text: str, field: str, message: str
) -> None:
    folder = _folder(plugins_dir, RUNNER + text)
    with pytest.raises(ManifestError, match=message) as info:
        load_manifest(folder)
    assert info.value.fields["field"] == field, info.value.message
