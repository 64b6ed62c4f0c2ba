"""``plugserve new``: a working plugin package to start from (manifest, module, a test).

Every file is written by a writer that escapes what it holds: manifests by tomli_w (read
back and compared with the data they hold before they are written), modules from
templates whose pasted names are checked plugin names, identifiers or ``repr()`` texts, and
compiled before they are written.
"""

from __future__ import annotations

import keyword
import os
import re
import shutil
import tomllib
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomli_w

from plugserve.registry.errors import ConfigError
from plugserve.registry.refs import NAME_PATTERN, is_valid_name
from plugserve.registry.versions import Version
from plugserve.server.commands.model_hints import Hints, Tensor, shape_hints

RUNNER_MODULE = '''\
"""{name}: a runner that multiplies its input by ``[config] factor``.

TODO: replace the multiplication with your model. The contract (plugserve's
``registry/hookspecs.py``): ``infer`` takes and returns a dict of numpy arrays
whose first axis is the batch (requests are batched together, up to
``[runner] max_batch_size`` rows); ``metadata()`` declares the tensors, so that
requests are checked before ``infer`` runs; ``warmup()`` runs once before the
first request and ``close()`` after the last. Raise ``plugin.InvalidInput`` for
a bad request (the client gets a 400).
"""

import numpy as np
import pluggy

hookimpl = pluggy.HookimplMarker("plugserve")


class Runner:
    def __init__(self, plugin, factor):
        self.InvalidInput = plugin.InvalidInput
        self.factor = np.float32(factor)

    def metadata(self):
        # -1: any size; the first axis is the batch
        spec = {{"datatype": "FP32", "shape": [-1, -1]}}
        return {{
            "inputs": [{{"name": "input", **spec}}],
            "outputs": [{{"name": "output", **spec}}],
        }}

    def validate(self, inputs):
        if not np.isfinite(inputs["input"]).all():
            raise self.InvalidInput("input must be finite numbers")

    def infer(self, inputs):
        return {{"output": inputs["input"] * self.factor}}

    def warmup(self):
        self.infer({{"input": np.zeros((1, 1), dtype=np.float32)}})

    def close(self):
        pass  # release what the runner holds (sessions, threads, files)


@hookimpl
def plugserve_create_component(plugin, config):
    return Runner(plugin, float(config.get("factor", 2.0)))
'''

PROCESSOR_MODULE = '''\
"""{name}: a {kind} that passes its data through unchanged.

TODO: transform the data. The contract (plugserve's ``registry/hookspecs.py``):
``{method}(data, ctx)`` takes the request's data ({what}) and returns
the data for the next stage; raise ``ctx.InvalidInput`` for a bad request (the
client gets a 400). ``ctx.parameters`` holds the request's parameters.
"""

import pluggy

hookimpl = pluggy.HookimplMarker("plugserve")


class {cls}:
    def __init__(self, config):
        self.config = config

    def {method}(self, data, ctx):
        return data  # TODO


@hookimpl
def plugserve_create_component(plugin, config):
    return {cls}(config)
'''

TEST_HEAD = '''\
"""Tests of {name}: ``pytest test_plugin.py`` in this folder (numpy, pluggy and pytest).

They load the module as plugserve does (its manifest's ``module`` and
``[config]``) and call the component; ``plugserve validate .`` checks the
package as the server loads it.
"""

import importlib.util
import tomllib
import types
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


class InvalidInput(ValueError):
    """Stands for plugserve's InvalidInput (a 400 for the client)."""


def create():
    manifest = tomllib.loads((HERE / "plugin.toml").read_text())
    module_file = HERE / manifest["plugin"]["module"]
    spec = importlib.util.spec_from_file_location({module!r}, module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    plugin = types.SimpleNamespace(
        name=manifest["plugin"]["name"],
        version=manifest["plugin"]["version"],
        type=manifest["plugin"]["type"],
        path=HERE,
        InvalidInput=InvalidInput,
    )
    config = manifest.get("config", {{}})
    return module.plugserve_create_component(plugin=plugin, config=config)
'''

RUNNER_TEST = """

def test_it_multiplies_its_input_by_the_factor():
    runner = create()
    runner.warmup()
    batch = {"input": np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)}
    out = runner.infer(batch)
    np.testing.assert_allclose(out["output"], [[2.0, 4.0], [6.0, 8.0]])
    assert out["output"].dtype == np.float32


def test_it_refuses_what_is_not_finite():
    runner = create()
    try:
        runner.validate({"input": np.array([[np.nan]], dtype=np.float32)})
    except InvalidInput:
        return
    raise AssertionError("a NaN passed validate()")
"""

PROCESSOR_TEST = """

def test_it_passes_the_data_through():
    stage = create()
    ctx = types.SimpleNamespace(InvalidInput=InvalidInput, parameters={{}}, state={{}})
    data = {{"input": np.array([[1.0, 2.0]], dtype=np.float32)}}
    out = stage.{method}(data, ctx)
    np.testing.assert_array_equal(out["input"], data["input"])
"""

METHODS = {"preprocessor": "process", "postprocessor": "format"}


def toml_table(name: str, values: Mapping[str, Any]) -> str:
    """``[name]`` and its keys as tomli_w writes them: every string quoted and escaped."""
    return tomli_w.dumps({name: dict(values)})


def toml_value(value: Any) -> str:
    """``value`` as TOML writes it on one line (a string quoted, its newlines escaped), for
    a comment that shows what a model holds."""
    return tomli_w.dumps({"v": value}).removeprefix("v = ").removesuffix("\n")


def comment(*lines: str) -> str:
    """Comment lines, each ``# `` and one line of text; a line that could end the comment
    (a control character: a newline, a carriage return) is refused."""
    for line in lines:
        if any(unicodedata.category(char) == "Cc" for char in line):
            raise ConfigError(f"{line!r}: a comment line holds a control character")
    return "".join(f"# {line}\n" if line else "#\n" for line in lines)


def manifest_text(parts: Sequence[str], data: Mapping[str, Any]) -> str:
    """The manifest ``parts`` (tables from :func:`toml_table`, comments from
    :func:`comment`) make, once it reads back as exactly ``data``."""
    text = "".join(parts)
    if tomllib.loads(text) != data:
        raise ConfigError("the manifest written does not read back as the data it holds")
    return text


def python_text(text: str, filename: str) -> str:
    """``text`` once it compiles as Python (names pasted into it are identifiers or reprs)."""
    try:
        compile(text, filename, "exec")
    except SyntaxError as exc:
        raise ConfigError(f"{filename}: the module written does not compile: {exc}") from None
    return text


def class_name(name: str) -> str:
    """A Python class name made from plugin name ``name`` (``my-stage``: ``MyStage``);
    ``Stage`` before it where that alone is no identifier (``1st``, ``none``)."""
    cls = "".join(part.capitalize() for part in name.replace("-", "_").split("_"))
    if not cls.isidentifier() or keyword.iskeyword(cls):
        cls = f"Stage{cls}"
    return cls


def _plugin_table(name: str, version: str, kind: str, module: str | None) -> dict[str, str]:
    verb = "computes" if kind == "runner" else "does"
    table = {"name": name, "version": version, "type": kind}
    if module is not None:
        table["module"] = module
    return {**table, "description": f"TODO: say what {name} {verb}"}


CONFIG_NOTE = comment("[config] is handed to plugserve_create_component.")
CHAIN_LINES = comment(
    'preprocess = ["scale"]    # stages from <plugins>/preprocessor, in order (name or name@1.2.3)',
    'postprocess = ["label"]   # stages from <plugins>/postprocessor',
)


def _route_parts(name: str) -> tuple[str, str, str]:
    return (
        comment(f"Served at /predict/{name} and /v2/models/{name}/infer."),
        toml_table("route", {"name": name}),
        CHAIN_LINES,
    )


def runner_manifest(name: str, version: str) -> str:
    """A module runner's ``plugin.toml``."""
    data: dict[str, dict[str, Any]] = {
        "plugin": _plugin_table(name, version, "runner", "plugin.py"),
        "config": {"factor": 2.0},
        "runner": {"max_batch_size": 8, "max_queue_delay_ms": 1.0},
        "route": {"name": name},
    }
    parts = [
        toml_table("plugin", data["plugin"]),
        "\n", CONFIG_NOTE, toml_table("config", data["config"]),
        "\n", comment(
            "max_batch_size: requests batched into one infer() call; 0 turns batching off.",
            "max_queue_delay_ms: how long a batch waits to fill.",
        ), toml_table("runner", data["runner"]),
        "\n", *_route_parts(name),
    ]  # fmt: skip
    return manifest_text(parts, data)


def processor_manifest(kind: str, name: str, version: str) -> str:
    """A preprocessor's or postprocessor's ``plugin.toml``."""
    data: dict[str, dict[str, Any]] = {
        "plugin": _plugin_table(name, version, kind, "plugin.py"),
        "config": {},
    }
    parts = [toml_table("plugin", data["plugin"]), "\n", CONFIG_NOTE, toml_table("config", {})]
    return manifest_text(parts, data)


def package_files(kind: str, name: str, version: str) -> dict[str, str]:
    """The files of a new ``kind`` package: ``plugin.toml``, ``plugin.py``, ``test_plugin.py``.

    Raises :class:`ConfigError` for a name plugserve refuses (it is pasted into the
    modules' docstrings)."""
    _check_name(name)
    head = TEST_HEAD.format(name=name, module=f"{name}_plugin")
    if kind == "runner":
        return {
            "plugin.toml": runner_manifest(name, version),
            "plugin.py": python_text(RUNNER_MODULE.format(name=name), "plugin.py"),
            "test_plugin.py": python_text(head + RUNNER_TEST, "test_plugin.py"),
        }
    method = METHODS[kind]
    what = "the client's inputs" if kind == "preprocessor" else "the runner's outputs"
    module = PROCESSOR_MODULE.format(
        name=name, kind=kind, method=method, what=what, cls=class_name(name)
    )
    return {
        "plugin.toml": processor_manifest(kind, name, version),
        "plugin.py": python_text(module, "plugin.py"),
        "test_plugin.py": python_text(
            head + PROCESSOR_TEST.format(method=method), "test_plugin.py"
        ),
    }


def onnx_runner_files(name: str, version: str, model: str, model_file: Path) -> dict[str, str]:
    """The manifest of a runner served by the onnxruntime backend from ``model`` (as the
    manifest names it: ``models:...`` or a path in the package), its tensors read from
    ``model_file`` and shown in a comment (each name as a TOML string). Batching is on
    when every tensor's first axis is dynamic; the tables the shapes suggest besides
    (``server/commands/model_hints.py``) follow ``[runner]``, commented out."""
    from plugserve.registry.backends.onnxruntime import ONNX_TO_V2

    _check_name(name)
    try:
        import onnxruntime as ort

        session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    except Exception as exc:  # the model's or the install's fault, said as is
        raise ConfigError(f"{model_file}: ONNX Runtime cannot load it: {exc}") from None
    tensors = [
        Tensor(kind, t.name, ONNX_TO_V2.get(t.type, t.type),
               tuple(d if isinstance(d, int) and d >= 0 else -1 for d in t.shape))
        for kind, listed in (("input", session.get_inputs()), ("output", session.get_outputs()))
        for t in listed
    ]  # fmt: skip
    lines = [f"  {t.kind:<6} {toml_value(t.name)} {t.datatype} {list(t.dims)}" for t in tensors]
    batchable = all(t.batches_on_first_axis for t in tensors)
    hints = shape_hints(tensors)
    if batchable:
        batching = "rows batched into one run (the first axis is dynamic)."
    elif hints.batching:
        batching = "0 until the rows' axes below are declared (a first axis is fixed)."
    else:
        batching = "0: a fixed first axis cannot batch."
    source = toml_value(model_file.name)
    runner: dict[str, Any] = {
        "backend": "onnxruntime",
        "model": model,
        "max_batch_size": 8 if batchable else 0,
        "max_queue_delay_ms": 1.0,
    }
    data: dict[str, dict[str, Any]] = {
        "plugin": _plugin_table(name, version, "runner", None),
        "runner": runner,
        "route": {"name": name},
    }
    parts = [
        toml_table("plugin", data["plugin"]),
        "\n", comment(
            "No module: the onnxruntime backend serves the model as it is.",
            f"max_batch_size: {batching}",
            "max_queue_delay_ms: how long a batch waits to fill.",
            "The model's tensors (the server reads them itself at load, checks requests",
            f"against them and shows them as the route's metadata), from {source}:",
            *lines,
        ), toml_table("runner", runner),
        *(("\n", hints_comment(hints)) if hints else ()),
        "\n", *_route_parts(name),
    ]  # fmt: skip
    return {"plugin.toml": manifest_text(parts, data)}


def hints_comment(hints: Hints) -> str:
    """``hints`` as TOML tables, commented out after what suggests each and the docs'
    section on it. The TOML is read back first: uncommented, it holds what ``hints`` do."""
    why = ["The model's shapes suggest more; uncomment what fits (docs/plugins.md):"]
    if hints.batching:
        why += [
            '- [runner.batching] ("Declared batching"): a tensor\'s first axis is fixed, so',
            "  each tensor's rows go on its first free axis, and an input with none is one",
            "  value for the whole batch; then raise max_batch_size to batch.",
        ]
    for state in hints.states:
        names = f"{toml_value(state.input.name)} and {toml_value(state.output.name)}"
        why += [
            f'- [runner.sequence] ("Sequences"): {names} look like a recurrent',
            "  state, which the server keeps for each sequence from one request to the next",
            '  (served by several workers, the runner needs isolation = "process").',
        ]
    tables: list[str] = []
    data: dict[str, Any] = {}
    for kind, specs in (("inputs", hints.inputs), ("outputs", hints.outputs)):
        if specs:
            rows = "".join(f"{toml_key(n)} = {inline_table(s)}\n" for n, s in specs.items())
            tables.append(f"[runner.batching.{kind}]\n{rows}")
            data.setdefault("batching", {})[kind] = specs
    if hints.states:
        tables.append("[runner.sequence]\nidle_timeout_s = 60\n")
        states = [state.table() for state in hints.states]
        data["sequence"] = {"idle_timeout_s": 60, "state": states}
        for table in states:
            rows = "".join(f"{key} = {inline_value(value)}\n" for key, value in table.items())
            tables.append(f"[[runner.sequence.state]]\n{rows}")
    toml = "\n".join(tables)
    if tomllib.loads(toml) != {"runner": data}:
        raise ConfigError("the tables suggested do not read back as the data they hold")
    return comment(*why, "", *toml.removesuffix("\n").split("\n"))


def inline_table(values: Mapping[str, Any]) -> str:
    """``values`` as a one-line TOML table: ``{ axis = 1 }``."""
    return "{ " + ", ".join(f"{toml_key(k)} = {inline_value(v)}" for k, v in values.items()) + " }"


def inline_value(value: Any) -> str:
    """``value`` as TOML on one line: a list of sizes as ``[2, 128]``, else as
    :func:`toml_value` writes it."""
    if isinstance(value, list):
        return "[" + ", ".join(inline_value(item) for item in value) + "]"
    return toml_value(value)


def toml_key(name: str) -> str:
    """``name`` as a TOML key: bare where TOML allows, else a quoted, escaped string."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else toml_value(name)


def _check_name(name: str) -> None:
    if not is_valid_name(name):
        raise ConfigError(f"{name!r}: a plugin name must match {NAME_PATTERN}")


def write_package(
    kind: str,
    name: str,
    version: str,
    plugins_dir: Path,
    files: dict[str, str] | None = None,
) -> Path:
    """Write ``<plugins_dir>/<kind>/<name>/<version>/``; the folder it wrote. ``files``:
    the package's files (by default :func:`package_files`').

    Written under a hidden name first and then renamed, so a server watching
    ``plugins_dir`` sees the whole package at once. Raises
    :class:`FileExistsError` when the folder exists (never overwritten) and
    :class:`ConfigError` for a name or version plugserve refuses.
    """
    _check_name(name)
    try:
        Version.parse(version)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    parent = Path(os.path.abspath(plugins_dir)) / kind / name
    folder = parent / version
    if folder.exists() or folder.is_symlink():
        raise FileExistsError(str(folder))
    staging = parent / f".{version}.tmp"
    staging.mkdir(parents=True, exist_ok=False)
    try:
        chosen = files if files is not None else package_files(kind, name, version)
        for relative, text in chosen.items():
            (staging / relative).write_text(text, encoding="utf-8")
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder
