from pathlib import Path

import pytest
import tomli_w

from plugserve.registry.errors import ManifestError
from plugserve.registry.manifest import MAX_MANIFEST_BYTES, load_manifest
from plugserve.registry.refs import Ref
from plugserve.registry.versions import Version
from tests.helpers import write_plugin


def _folder(plugins_dir: Path, text: str, kind: str = "runner", name: str = "iris",
            version: str = "1.0.0") -> Path:  # fmt: skip
    folder = plugins_dir / kind / name / version
    folder.mkdir(parents=True)
    (folder / "plugin.toml").write_text(text)
    return folder


def test_full_runner_manifest_is_parsed(plugins_dir: Path) -> None:
    folder = write_plugin(
        plugins_dir,
        "runner",
        "iris",
        "1.2.3-rc.1",
        """
        description = "d"
        [config]
        labels = ["a", "b"]
        [runner]
        backend = "onnxruntime"
        model = "models:iris/2"
        providers = [{ name = "CUDAExecutionProvider", device_id = 1 }, "CPUExecutionProvider"]
        max_batch_size = 8
        max_queue_delay_ms = 1.5
        instances = 2
        [route]
        name = "flowers"
        preprocess = ["scale@1.0.0", "clip"]
        postprocess = ["label"]
        """,
        module=None,
    )
    m = load_manifest(folder)
    assert (m.type, m.name, m.version) == ("runner", "iris", Version.parse("1.2.3-rc.1"))
    assert m.module is None
    assert m.config["labels"] == ["a", "b"]
    assert m.runner is not None
    assert m.runner.backend == "onnxruntime" and m.runner.model == "models:iris/2"
    assert (m.runner.max_batch_size, m.runner.max_queue_delay_ms, m.runner.instances) == (8, 1.5, 2)
    assert m.runner.providers == ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert m.runner.cast_inputs is False  # issue 12, finding 16: datatypes must match by default
    assert m.runner.response_cache is False  # issue 15: a route caches only when asked to
    assert m.route_name == "flowers"
    assert m.route.preprocess == (Ref("scale", Version.parse("1.0.0")), Ref("clip"))
    assert m.label == "runner/iris@1.2.3-rc.1"


HEAD = "[plugin]\nname='iris'\nversion='1.0.0'\ntype='runner'\n"
RUNNER = HEAD + "[runner]\nbackend='onnxruntime'\n"


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        ("", "plugin", "is required"),
        ("[plugin]\nname='iris'\ntype='runner'\n", "plugin.version", "is required"),
        ("[plugin\n", None, "invalid TOML"),
        ("[plugin]\nname='iris'\nversion='1.0.0'\ntype='model'\n", "plugin.type", "one of"),
        ("[plugin]\nname='other'\nversion='1.0.0'\ntype='runner'\n", "plugin.name", "differs"),
        ("[plugin]\nname='iris'\nversion='1.0.1'\ntype='runner'\n", "plugin.version", "differs"),
        ("[plugin]\nname='iris'\nversion=1\ntype='runner'\n", "plugin.version", "must be a string"),
        ("[plugin]\nname='iris'\nversion='1.0.0'\ntype='runner'\nmodul='x.py'\n", "plugin",
         "unknown key"),
        ("[plugin]\nname='iris'\nversion='1.0.0'\ntype='runner'\n", "runner.backend",
         "needs a backend or a module"),
        ("[plugin]\nname='iris'\nversion='1.0.0'\ntype='runner'\n[runner]\nbackend='onnxruntime'\n"
         "max_batch_size=-1\n", "runner.max_batch_size", "integer >= 0"),
        ("[plugin]\nname='iris'\nversion='1.0.0'\ntype='runner'\n[runner]\nbackend='onnxruntime'\n"
         "model='../../x.onnx'\n", "runner.model", "inside the plugin folder"),
        ("[plugin]\nname='iris'\nversion='1.0.0'\ntype='runner'\n[runner]\nbackend='onnxruntime'\n"
         "[route]\npreprocess=['Bad Name']\n", "route.preprocess", "must match"),
        ("[plugin]\nname='iris'\nversion='1.0.0'\ntype='runner'\n[runner]\nbackend='onnxruntime'\n"
         "[route]\npreprocess=['scale@1.0']\n", "route.preprocess", "semantic version"),
        ("[plugin]\nname='iris'\nversion='1.0.0'\ntype='runner'\n[runner]\nbackend='onnxruntime'\n"
         "cast_inputs='yes'\n", "runner.cast_inputs", "must be true or false"),
        (RUNNER + "isolation='thread'\n", "runner.isolation", "one of none, process"),
        (RUNNER + "response_cache=1\n", "runner.response_cache", "must be true or false"),
        (RUNNER + "isolation='process'\ndevice='gpu0'\n", "runner.device", "such as 'cuda:0'"),
        (RUNNER + "device='cuda:0'\n", "runner.device", "needs isolation"),
        (RUNNER + "isolation='process'\ndevice='cuda:0'\ndevices=['cuda:1']\n",
         "runner.devices", "not both"),
        (RUNNER + "isolation='process'\ndevice='cuda:\u0661'\n", "runner.device", "such as"),
        (RUNNER + "isolation='process'\ndevices=['cuda:0', 'cuda:1']\n", "runner.devices",
         "2 devices for 1 instance"),
        ("[plugin]\nname='iris'\nversion='1.0.0'\ntype='runner'\nrequires=['numpy >>> 1']\n"
         "[runner]\nbackend='onnxruntime'\n", "plugin.requires[0]", "is not a requirement"),
        ("[plugin]\nname='iris'\nversion='1.0.0'\ntype='runner'\nrequires='numpy'\n"
         "[runner]\nbackend='onnxruntime'\n", "plugin.requires", "must be a list"),
        (RUNNER + "[runner.sequence]\nidle_timeout=1\n", "runner.sequence", "unknown key"),
        (RUNNER + "[runner.sequence]\nidle_timeout_s=0\n", "runner.sequence.idle_timeout_s",
         "> 0"),
        (RUNNER + "[runner.sequence]\nmax_sequences=0\n", "runner.sequence.max_sequences",
         "integer >= 1"),
        (RUNNER + "response_cache=true\n[runner.sequence]\n", "runner.sequence",
         "no response_cache"),
        (RUNNER + "[[runner.sequence.state]]\ninput='s'\noutput='t'\ndatatype='BYTES'\nshape=[1]\n",
         "runner.sequence.state[0].datatype", "one of BOOL"),
        (RUNNER + "[[runner.sequence.state]]\ninput='s'\noutput='t'\ndatatype='FP32'\nshape=[0]\n",
         "runner.sequence.state[0].shape", "integer >= 1"),
        (RUNNER + "[[runner.sequence.state]]\ninput='s'\noutput='t'\ndatatype='FP32'\n"
         "shape=[16777216, 16777216]\n", "runner.sequence.state[0].shape", "at most 16777216"),
        (RUNNER + "[[runner.sequence.state]]\ninput='s'\noutput='t'\ndatatype='UINT8'\n"
         "shape=[4]\ninitial=-1\n", "runner.sequence.state[0].initial", "not a UINT8 value"),
        (RUNNER + "[[runner.sequence.state]]\ninput='s'\noutput='t'\ndatatype='INT32'\n"
         "shape=[4]\ninitial=1.5\n", "runner.sequence.state[0].initial", "not a INT32 value"),
        (RUNNER + "[[runner.sequence.state]]\ninput='s'\noutput='t'\ndatatype='FP16'\n"
         "shape=[4]\ninitial=1e10\n", "runner.sequence.state[0].initial", "not a FP16 value"),
        (RUNNER + "[[runner.sequence.state]]\ninput='s'\noutput='t'\ndatatype='BOOL'\n"
         "shape=[4]\ninitial=2\n", "runner.sequence.state[0].initial", "not a BOOL value"),
        (RUNNER + "[[runner.sequence.state]]\noutput='t'\ndatatype='FP32'\nshape=[1]\n",
         "runner.sequence.state[0].input", "is required"),
        (RUNNER + "[[runner.sequence.state]]\ninput='s'\noutput='t'\ndatatype='FP32'\nshape=[1]\n"
         "[[runner.sequence.state]]\ninput='s'\noutput='u'\ndatatype='FP32'\nshape=[1]\n",
         "runner.sequence.state", "of its own"),
    ],
)  # fmt: skip
def test_manifest_errors_name_file_and_field(
    plugins_dir: Path, text: str, field: str | None, message: str
) -> None:
    folder = _folder(plugins_dir, text)
    with pytest.raises(ManifestError, match=message) as info:
        load_manifest(folder)
    assert info.value.fields["file"] == str(folder / "plugin.toml")
    assert info.value.fields["field"] == field
    assert str(folder / "plugin.toml") in info.value.message


def test_isolation_and_devices_are_read(plugins_dir: Path) -> None:
    folder = _folder(
        plugins_dir, RUNNER + "isolation='process'\ninstances=2\ndevices=['cuda:0', 'cuda:1']\n"
    )
    runner = load_manifest(folder).runner
    assert runner is not None
    assert runner.isolated
    assert runner.devices == ("cuda:0", "cuda:1")
    other = RUNNER.replace("1.0.0", "2.0.0")
    default = load_manifest(_folder(plugins_dir, other, version="2.0.0")).runner
    assert default is not None
    assert (default.isolation, default.devices) == ("none", ())


def test_missing_manifest(plugins_dir: Path) -> None:
    folder = plugins_dir / "runner" / "iris" / "1.0.0"
    folder.mkdir(parents=True)
    with pytest.raises(ManifestError, match="no plugin.toml"):
        load_manifest(folder)


def test_processor_needs_module_and_no_runner_table(plugins_dir: Path) -> None:
    folder = _folder(
        plugins_dir, "[plugin]\nname='s'\nversion='1.0.0'\ntype='preprocessor'\n", "preprocessor",
        "s",
    )  # fmt: skip
    with pytest.raises(ManifestError, match="needs a module"):
        load_manifest(folder)
    (folder / "plugin.toml").write_text(
        "[plugin]\nname='s'\nversion='1.0.0'\ntype='preprocessor'\nmodule='p.py'\n[runner]\n"
    )
    with pytest.raises(ManifestError, match=r"only runners have a \[runner\]"):
        load_manifest(folder)


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        (RUNNER + "[route]\nrate_limit = { rps = inf }\n", "route.rate_limit.rps", "finite"),
        (RUNNER + "[route]\nrate_limit = { rps = nan }\n", "route.rate_limit.rps", "finite"),
        (RUNNER + "[route]\nrate_limit = { rps = 1e999 }\n", "route.rate_limit.rps", "finite"),
        (RUNNER + "[route]\nrate_limit = { rps = 1e-300 }\n", "route.rate_limit.rps", ">= 0.001"),
        (RUNNER + "[route]\nrate_limit = { rps = 1, burst = 9223372036854775807 }\n",
         "route.rate_limit.burst", "<= 1000000"),
        (RUNNER + "max_queue_delay_ms = inf\n", "runner.max_queue_delay_ms", "finite"),
        (RUNNER + "max_queue_delay_ms = nan\n", "runner.max_queue_delay_ms", "finite"),
        (RUNNER + "breaker_reset_s = -inf\n", "runner.breaker_reset_s", "finite"),
        (RUNNER + "instances = 9223372036854775807\n", "runner.instances", "<= 1024"),
        (RUNNER + "max_batch_size = 1e3\n", "runner.max_batch_size", "integer"),
        (RUNNER + "preferred_batch_sizes = [4, inf]\n", "runner.preferred_batch_sizes", "integer"),
        (RUNNER + "tenant_weights = { gold = inf }\n", "runner.tenant_weights.gold", "finite"),
        (RUNNER + "tenant_weights = [1]\n", "runner.tenant_weights", "must be a table"),
        (RUNNER + 'model = "a\\u0000b.onnx"\n', "runner.model", "control characters"),
        (RUNNER + f'model = "{"a" * 300}.onnx"\n', "runner.model", "longer than 255 bytes"),
        (RUNNER + f'model = "models:iris/1/{"a" * 300}"\n', "runner.model", "longer than 255"),
        (HEAD + f'module = "{"a/" * 600}p.py"\n', "plugin.module", "at most 1024"),
        (HEAD + 'module = "plugin.py\\n"\n[runner]\n', "plugin.module", "control characters"),
        (HEAD + "[runner]\nbackend='onnxruntime'\n[route]\nname = \"iris\\n\"\n", "route.name",
         "control characters"),
    ],
)  # fmt: skip
def test_hostile_numbers_and_texts_are_manifest_errors(
    plugins_dir: Path, text: str, field: str, message: str
) -> None:
    """issue 12, finding 1: non-finite, huge or tiny numbers and control characters in a
    manifest are a ManifestError naming the field (inf escaped as OverflowError before)."""
    folder = _folder(plugins_dir, text)
    with pytest.raises(ManifestError, match=message) as info:
        load_manifest(folder)
    assert info.value.fields["field"] == field


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (HEAD.encode() + b"[config]\nx = " + b"[" * 500 + b"]" * 500 + b"\n", "deeper than"),
        (HEAD.encode() + b"[config]\nx = " + b"[" * 60 + b"]" * 60 + b"\n", "deeper than"),
        (HEAD.encode() + b"description = '\xff'\n", "not UTF-8"),
    ],
)
def test_deep_nesting_and_bad_bytes_are_manifest_errors(
    plugins_dir: Path, data: bytes, message: str
) -> None:
    """issue 12, finding 1: a plugin.toml nested ~500 deep (RecursionError before) or not
    UTF-8 is a failed load with its reason."""
    folder = _folder(plugins_dir, "")
    (folder / "plugin.toml").write_bytes(data)
    with pytest.raises(ManifestError, match=message):
        load_manifest(folder)


def test_unknown_runner_keys_are_refused_when_no_backend_declares_them(plugins_dir: Path) -> None:
    """issue 12, finding 18: ``max_batch_sise`` in a module runner's [runner] is an error."""
    folder = _folder(plugins_dir, HEAD + "module='plugin.py'\n[runner]\nmax_batch_sise = 8\n")
    with pytest.raises(ManifestError, match=r"unknown key\(s\) \['max_batch_sise'\]") as info:
        load_manifest(folder)
    assert "max_batch_size" in info.value.message and "cast_inputs" in info.value.message
    assert info.value.fields["field"] == "runner"


def test_unknown_top_level_tables_are_refused(plugins_dir: Path) -> None:
    folder = _folder(plugins_dir, RUNNER + "[route]\n[runer]\nmax_batch_size = 8\n")
    with pytest.raises(ManifestError, match=r"unknown key\(s\) \['runer'\]"):
        load_manifest(folder)


def test_multiline_descriptions_and_bounded_numbers_still_load(plugins_dir: Path) -> None:
    folder = _folder(
        plugins_dir,
        HEAD.replace("type='runner'", "type='runner'\ndescription = '''two\nlines'''")
        + "[runner]\nbackend='onnxruntime'\nmax_queue_delay_ms = 2\nbreaker_reset_s = 0.5\n"
        + "cast_inputs = true\n[route]\nrate_limit = { rps = 0.001 }\n",
    )
    m = load_manifest(folder)
    assert m.description == "two\nlines" and m.route.rate_limit is not None
    assert m.route.rate_limit.rps == 0.001 and m.route.rate_limit.burst == 1


def test_formats_and_labels_are_read_and_checked(plugins_dir: Path) -> None:
    runner = '[runner]\nbackend = "onnxruntime"\nmodel = "m.onnx"\n'
    folder = write_plugin(
        plugins_dir, "runner", "img", "1.0.0",
        runner + 'formats = { image = "FORMAT_NCHW" }\nlabels = { scores = "labels.txt" }\n',
        {"labels.txt": "cat\ndog\r\n\nbird\n"}, module=None,
    )  # fmt: skip
    m = load_manifest(folder)
    assert m.runner is not None
    assert dict(m.runner.formats) == {"image": "FORMAT_NCHW"}
    assert dict(m.runner.label_files) == {"scores": "labels.txt"}
    assert m.runner.labels["scores"] == ("cat", "dog", "", "bird")  # a line per class index
    for extra, field in [
        ('formats = { image = "NCHW" }', "runner.formats.image"),
        ('labels = { scores = "missing.txt" }', "runner.labels.scores"),
        ('labels = { scores = "../labels.txt" }', "runner.labels.scores"),
        ("labels = { scores = 3 }", "runner.labels.scores"),
    ]:
        (folder / "plugin.toml").write_text(
            '[plugin]\nname = "img"\nversion = "1.0.0"\ntype = "runner"\n' + runner + extra
        )
        with pytest.raises(ManifestError) as info:
            load_manifest(folder)
        assert info.value.fields["field"] == field, info.value.message


def test_a_sequence_table_is_read_with_its_states(plugins_dir: Path) -> None:
    folder = _folder(plugins_dir, RUNNER + """
[runner.sequence]
idle_timeout_s = 2.5
max_sequences = 8
[[runner.sequence.state]]
input = "h_in"
output = "h_out"
datatype = "FP16"
shape = [2, 64]
initial = -1
""")  # fmt: skip
    runner = load_manifest(folder).runner
    assert runner is not None and runner.sequence is not None
    assert (runner.sequence.idle_timeout_s, runner.sequence.max_sequences) == (2.5, 8)
    (state,) = runner.sequence.states
    assert (state.input, state.output, state.datatype) == ("h_in", "h_out", "FP16")
    assert (state.shape, state.initial) == ((2, 64), -1.0)
    plain = load_manifest(_folder(plugins_dir, RUNNER.replace("1.0.0", "2.0.0"), version="2.0.0"))
    assert plain.runner is not None and plain.runner.sequence is None


@pytest.mark.parametrize(
    ("requirement", "message"),
    [
        ("numpy; python_version ~= 'abc'", "marker that cannot be evaluated: UndefinedComparison"),
        ("numpy; os_name ~= '1'", "marker that cannot be evaluated: UndefinedComparison"),
        ("numpy; python_full_version ~= 'x.y'", "marker that cannot be evaluated"),
        ("numpy; python_version >= ", "is not a requirement"),
        ("numpy; nonsense == '1'", "is not a requirement"),
        ("numpy>=abc", "is not a requirement"),
        ("numpy @ ", "is not a requirement"),
    ],
)
def test_requirements_are_parsed_whole_and_their_markers_evaluated(
    plugins_dir: Path, requirement: str, message: str
) -> None:
    """A requirement whose marker parses but cannot be evaluated is the manifest's error,
    named by its field, before any load."""
    requires = tomli_w.dumps({"requires": ["pillow", requirement]})
    folder = _folder(plugins_dir, HEAD + requires + "[runner]\nbackend='onnxruntime'\n")
    with pytest.raises(ManifestError, match=message) as info:
        load_manifest(folder)
    assert info.value.fields["field"] == "plugin.requires[1]"


def test_requirements_whose_markers_evaluate_load(plugins_dir: Path) -> None:
    requires = ["numpy>=1", "pywin32; sys_platform == 'win32'", "x; python_version < '3.0'"]
    text = HEAD + tomli_w.dumps({"requires": requires}) + "[runner]\nbackend='onnxruntime'\n"
    assert load_manifest(_folder(plugins_dir, text)).requires == tuple(requires)


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ('[runner.batching.inputs]\n"x\\ninstances = 1024" = { axis = 1 }\n',
         "runner.batching.inputs"),
        ('[runner.batching.outputs]\n"y\\u0000" = { axis = 1 }\n', "runner.batching.outputs"),
        ('[runner.formats]\n"x\\r" = "FORMAT_NCHW"\n', "runner.formats"),
        ('[runner.labels]\n"y\\t" = "labels.txt"\n', "runner.labels"),
        ('[[runner.sequence.state]]\ninput = "s\\n"\noutput = "t"\ndatatype = "FP32"\n'
         "shape = [1]\n", "runner.sequence.state[0].input"),
    ],
)  # fmt: skip
def test_tensor_names_with_control_characters_are_refused(
    plugins_dir: Path, table: str, field: str
) -> None:
    """A tensor name is written into logs, metadata and manifests:
    one with a newline could pass as keys of its own."""
    folder = _folder(plugins_dir, RUNNER + table)
    (folder / "labels.txt").write_text("a\n")
    with pytest.raises(ManifestError, match="control characters") as info:
        load_manifest(folder)
    assert info.value.fields["field"] == field


def test_a_manifest_is_read_up_to_1_mib(plugins_dir: Path) -> None:
    """A manifest is a few KiB: one over 1 MiB is refused before it is parsed."""
    assert MAX_MANIFEST_BYTES == 1024 * 1024
    folder = _folder(plugins_dir, RUNNER)
    padding = MAX_MANIFEST_BYTES - len(RUNNER) - 1
    (folder / "plugin.toml").write_text(RUNNER + "#" * padding + "\n")
    assert load_manifest(folder).name == "iris"  # exactly 1 MiB: read
    (folder / "plugin.toml").write_text(RUNNER + "#" * (padding + 1) + "\n")
    with pytest.raises(ManifestError, match="larger than 1 MiB") as info:
        load_manifest(folder)
    assert info.value.fields["file"] == str(folder / "plugin.toml")
