"""Test helpers: plugin folders and ONNX models written to real files, and real servers."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper
from prometheus_client.parser import text_string_to_metric_families

from plugserve.server.config import Settings

ROOT = Path(__file__).resolve().parent.parent


def write_plugin(
    plugins_dir: Path,
    kind: str,
    name: str,
    version: str,
    manifest: str = "",
    files: dict[str, str] | None = None,
    module: str | None = "plugin.py",
) -> Path:
    """Write ``<plugins_dir>/<kind>/<name>/<version>/`` with a manifest and source files.

    ``manifest`` is TOML appended after the ``[plugin]`` table (``[config]``,
    ``[runner]``, ``[route]``); ``files`` maps relative paths to (dedented) text.
    """
    folder = plugins_dir / kind / name / version
    folder.mkdir(parents=True, exist_ok=True)
    head = f'[plugin]\nname = "{name}"\nversion = "{version}"\ntype = "{kind}"\n'
    if module is not None:
        head += f'module = "{module}"\n'
    (folder / "plugin.toml").write_text(head + textwrap.dedent(manifest))
    for rel, text in (files or {}).items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return folder


# Processor sources used across tests: pluggy and numpy only, as a plugin author writes them.
ADD_PROCESSOR = """
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Add:
        def __init__(self, amount):
            self.amount = amount

        def {method}(self, data, ctx):
            return {{k: np.asarray(v) + self.amount for k, v in data.items()}}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Add(config.get("amount", 0))
"""


# Streaming runners (registry/hookspecs.py, "Streaming runners"), as a plugin author writes them.
# Each takes "n" (how many responses) and answers i = 1..n, one a step, "step_s" apart (a sync
# generator fails at step "fail_at" if set); the
# step runner also reports how many streams its step advanced ("batch"), and both write the
# steps they ran to the file [config] log names, if any (a test reads when steps stopped).
STREAMING_RUNNERS = """
    import asyncio
    import time

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    def _log(path, line):
        if path:
            with open(path, "a") as f:
                f.write(line + "\\n")

    class Countdown:
        def __init__(self, config):
            self.step_s = config.get("step_s", 0.0)
            self.log = config.get("log")
            self.fail_at = config.get("fail_at", 0)
            self.declare_outputs = config.get("declare_outputs", False)

        def metadata(self):
            spec = {"inputs": [{"name": "n", "datatype": "INT64", "shape": [1]}]}
            if self.declare_outputs:
                spec["outputs"] = [
                    {"name": "i", "datatype": "INT64", "shape": [1]},
                    {"name": "text_output", "datatype": "BYTES", "shape": [1]},
                ]
            return spec

        def infer(self, inputs):
            for i in range(1, int(inputs["n"][0]) + 1):
                time.sleep(self.step_s)
                _log(self.log, f"step {i}")
                if i == self.fail_at:
                    raise RuntimeError(f"failed at step {i}")
                yield {"i": np.array([i], np.int64), "text_output": np.array([f"t{i} "], object)}

    class AsyncCountdown(Countdown):
        async def infer(self, inputs):
            for i in range(1, int(inputs["n"][0]) + 1):
                await asyncio.sleep(self.step_s)
                _log(self.log, f"step {i}")
                yield {"i": np.array([i], np.int64), "text_output": np.array([f"t{i} "], object)}

    class Steps:
        def __init__(self, config, invalid=ValueError):
            self.step_s = config.get("step_s", 0.0)
            self.log = config.get("log")
            self.stopped = 0
            self.InvalidInput = invalid

        def validate(self, inputs):
            if int(inputs["n"][0]) > 100_000:
                raise self.InvalidInput("n is at most 100000")

        def metadata(self):
            return {"inputs": [{"name": "n", "datatype": "INT64", "shape": [1]}]}

        def start(self, inputs):
            n = int(inputs["n"][0])
            if n < 0:
                raise ValueError("a negative count")
            return {"left": n, "i": 0}

        def step(self, states):
            time.sleep(self.step_s)
            _log(self.log, f"step {len(states)}")
            out = []
            for state in states:
                if state["left"] == 0:
                    out.append(None)
                    continue
                state["left"] -= 1
                state["i"] += 1
                i, batch = np.array([state["i"]], np.int64), np.array([len(states)], np.int64)
                out.append({"i": i, "batch": batch, "text_output": np.array([f"t{state['i']} "], object)})
            return out

        def stop(self, state):
            _log(self.log, "stop")

    KINDS = {"generator": Countdown, "async": AsyncCountdown, "steps": Steps}

    @hookimpl
    def plugserve_create_component(plugin, config):
        kind = config.get("kind", "steps")
        if kind == "steps":
            return Steps(config, plugin.InvalidInput)
        return KINDS[kind](config)
"""


PID_RUNNER = """
    import os

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class AddPid:
        def infer(self, inputs):
            x = np.asarray(inputs["x"])
            return {"y": x + 1, "pid": np.full((x.shape[0], 1), os.getpid(), dtype=np.int64)}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return AddPid()
"""
"""``y = x + 1`` and the pid of the process that ran it (a worker: the runner is in it)."""


def write_streaming_runner(
    plugins_dir: Path, name: str, kind: str = "steps", runner: str = "", config: str = ""
) -> Path:
    """A streaming runner (``kind``: ``steps``, ``generator`` or ``async``) serving ``name``."""
    manifest = f'[config]\nkind = "{kind}"\n{config}\n[runner]\n{runner}\n'
    return write_plugin(
        plugins_dir, "runner", name, "1.0.0", manifest, {"plugin.py": STREAMING_RUNNERS}
    )


def processor_source(kind: str) -> str:
    return ADD_PROCESSOR.format(method="process" if kind == "preprocessor" else "format")


def write_processor(plugins_dir: Path, kind: str, name: str, version: str, amount: float) -> Path:
    """A processor that adds ``amount`` to every named tensor."""
    return write_plugin(
        plugins_dir,
        kind,
        name,
        version,
        f"[config]\namount = {amount}\n",
        {"plugin.py": processor_source(kind)},
    )


def add_model(path: Path, amount: float = 1.0, features: int = 4) -> Path:
    """An ONNX model ``y = x + amount`` on FP32 ``[N, features]``."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", features])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", features])
    const = helper.make_tensor("amount", TensorProto.FLOAT, [1], [amount])
    graph = helper.make_graph([helper.make_node("Add", ["x", "amount"], ["y"])], "add", [x], [y])
    graph.initializer.append(const)
    return _save(graph, path)


def accumulator_model(path: Path, features: int = 4) -> Path:
    """An ONNX model with a recurrent state: ``y = state_out = state_in + x``, FP32
    ``[N, features]``: over a sequence, ``y`` is the running sum of its ``x``."""
    dims: list[str | int] = ["N", features]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    state_in = helper.make_tensor_value_info("state_in", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
    state_out = helper.make_tensor_value_info("state_out", TensorProto.FLOAT, dims)
    nodes = [
        helper.make_node("Add", ["x", "state_in"], ["y"]),
        helper.make_node("Identity", ["y"], ["state_out"]),
    ]
    graph = helper.make_graph(nodes, "accumulator", [x, state_in], [y, state_out])
    return _save(graph, path)


SEQUENCE_RUNNER = """
[runner]
backend = "onnxruntime"
model = "model.onnx"
max_batch_size = 16
max_queue_delay_ms = 2
{runner}
[runner.sequence]
{sequence}
[[runner.sequence.state]]
input = "state_in"
output = "state_out"
datatype = "FP32"
shape = [4]
"""


def write_sequence_runner(
    plugins_dir: Path, name: str, version: str = "1.0.0", runner: str = "", sequence: str = ""
) -> Path:
    """A runner serving sequences over :func:`accumulator_model`, its state kept by the
    server: each answer is the running sum of the sequence's inputs."""
    manifest = SEQUENCE_RUNNER.format(runner=runner, sequence=sequence)
    folder = write_plugin(plugins_dir, "runner", name, version, manifest, module=None)
    accumulator_model(folder / "model.onnx")
    return folder


def vad_model(path: Path) -> Path:
    """An ONNX model shaped like a streaming voice-activity detector: ``input`` FP32
    ``[N, 4]``, a recurrent ``state`` FP32 ``[2, N, 3]`` (its rows on axis 1) and a sample
    rate ``sr``, an INT64 scalar for the whole batch. ``output`` ``[N, 1]`` is the chunk's
    sum scaled by ``sr / 16000`` plus the state's sum; ``stateN = state + the chunk's sum``."""
    inputs = [
        helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4]),
        helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "N", 3]),
        helper.make_tensor_value_info("sr", TensorProto.INT64, []),
    ]
    outputs = [
        helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", 1]),
        helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, "N", 3]),
    ]
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    state_axes = helper.make_tensor("state_axes", TensorProto.INT64, [2], [0, 2])
    rate = helper.make_tensor("rate", TensorProto.FLOAT, [], [16000.0])
    nodes = [
        helper.make_node("ReduceSum", ["input", "axes"], ["chunk"], keepdims=1),  # [N, 1]
        helper.make_node("Cast", ["sr"], ["sr_f"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["sr_f", "rate"], ["scale"]),
        helper.make_node("Mul", ["chunk", "scale"], ["scaled"]),
        helper.make_node("ReduceSum", ["state", "state_axes"], ["kept"], keepdims=0),  # [N]
        helper.make_node("Unsqueeze", ["kept", "axes"], ["kept_col"]),  # [N, 1]
        helper.make_node("Add", ["scaled", "kept_col"], ["output"]),
        helper.make_node("Add", ["state", "chunk"], ["stateN"]),  # [2, N, 3] + [N, 1]
    ]
    graph = helper.make_graph(nodes, "vad", inputs, outputs, initializer=[axes, state_axes, rate])
    return _save(graph, path)


VAD_RUNNER = """
[runner]
backend = "onnxruntime"
model = "model.onnx"
max_batch_size = 16
max_queue_delay_ms = 2
{runner}
{batching}
{sequence}
"""

VAD_SEQUENCE = """
[runner.sequence]
idle_timeout_s = 30

[[runner.sequence.state]]
input = "state"
output = "stateN"
datatype = "FP32"
shape = [2, 3]
"""

VAD_BATCHING = """
[runner.batching.inputs]
state = { axis = 1 }
sr = { shared = true }

[runner.batching.outputs]
stateN = { axis = 1 }
"""


def write_vad_runner(
    plugins_dir: Path,
    name: str = "vad",
    runner: str = "",
    batching: str = VAD_BATCHING,
    sequence: str = VAD_SEQUENCE,
) -> Path:
    """A runner over :func:`vad_model`, by default serving sequences with its state kept by
    the server, batched on axis 1, and its sample rate one value for the batch."""
    manifest = VAD_RUNNER.format(runner=runner, batching=batching, sequence=sequence)
    folder = write_plugin(plugins_dir, "runner", name, "1.0.0", manifest, module=None)
    vad_model(folder / "model.onnx")
    return folder


# Every ONNX element type v2 can carry, by a short key the tests name tensors with.
ONNX_TYPES = {
    "bool": TensorProto.BOOL, "u8": TensorProto.UINT8, "u16": TensorProto.UINT16,
    "u32": TensorProto.UINT32, "u64": TensorProto.UINT64, "i8": TensorProto.INT8,
    "i16": TensorProto.INT16, "i32": TensorProto.INT32, "i64": TensorProto.INT64,
    "f16": TensorProto.FLOAT16, "f32": TensorProto.FLOAT, "f64": TensorProto.DOUBLE,
    "str": TensorProto.STRING,
}  # fmt: skip


def identity_model(path: Path, types: dict[str, int], shape: list[Any] | None = None) -> Path:
    """An ONNX model passing each input ``in_<name>`` through to ``out_<name>``."""
    dims: Sequence[str | int | None] = shape if shape is not None else ["N", 2]
    inputs = [helper.make_tensor_value_info(f"in_{n}", t, dims) for n, t in types.items()]
    outputs = [helper.make_tensor_value_info(f"out_{n}", t, dims) for n, t in types.items()]
    nodes = [helper.make_node("Identity", [f"in_{n}"], [f"out_{n}"]) for n in types]
    return _save(helper.make_graph(nodes, "identity", inputs, outputs), path)


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def write_add_runner(
    plugins_dir: Path,
    name: str,
    version: str,
    amount: float = 1.0,
    route: str = "",
    runner: str = "",
) -> Path:
    """A declarative ONNX runner with its own ``model.onnx`` computing ``x + amount``."""
    folder = write_plugin(
        plugins_dir,
        "runner",
        name,
        version,
        f'[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\n{runner}\n{route}',
        module=None,
    )
    add_model(folder / "model.onnx", amount)
    return folder


def fake_distribution(
    site: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]
) -> None:
    """An installed package as importlib.metadata sees it, without installing anything."""
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[plugserve]\n{lines}\n")
    for name, source in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(source))


def workers_failing(count: int, reason: str, strict: bool = True) -> Any:
    """``count`` as an argument of ``pytest.mark.workers``, expected to fail (a known bug)."""
    return pytest.param(count, marks=pytest.mark.xfail(strict=strict, reason=reason))


def rss_mib(pid: int) -> float:
    """A process's resident memory, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` different ports free now: each socket is held until all are bound (a port
    closed at once may be handed out again at the next call)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def wait_until_ok(
    proc: subprocess.Popen[bytes], url: str, timeout: float, log: Callable[[], str]
) -> None:
    """Poll ``url`` until it answers 200; fail with the process's log if it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}:\n{log()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.05)
    raise TimeoutError(f"{url} not answering 200 within {timeout}s:\n{log()}")


def until(
    check: Callable[[], Any],
    timeout: float = 10.0,
    what: str = "",
    *,
    interval: float = 0.05,
    ignoring: tuple[type[BaseException], ...] = (),
) -> Any:
    """Call ``check()`` every ``interval`` seconds until it returns a truthy value, and return it.

    ``check`` runs at least once, and once more after ``timeout`` seconds have passed;
    still falsy then, an ``AssertionError`` names ``what`` (else ``check``) and its last
    value. An exception of a type in ``ignoring`` raised by ``check`` counts as "not yet"
    (a connection a restarting worker reset; an assertion a replica does not meet yet) and
    is named as the last value; any other exception propagates at once. (``Any``: a check
    such as ``row is not None and row["ok"] and row`` returns its row once truthy.)
    """
    deadline = time.monotonic() + timeout
    while True:
        last: object
        try:
            value = check()
        except ignoring as error:
            last = error
        else:
            if value:
                return value
            last = value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or repr(check)} (last: {last!r})")
        time.sleep(interval)


def chooses_workers(args: Sequence[str]) -> bool:
    """Whether a ``serve`` command line sets ``workers``: by flag, or in its config file.

    Servers in tests run one process unless the test asks for more; the default
    (``auto``, one worker per usable core) would make the suite's processes depend on
    the machine it runs on.
    """
    if "--workers" in args:
        return True
    if "--config" in args:
        config = Path(args[list(args).index("--config") + 1])
        return config.is_file() and "workers" in tomllib.loads(config.read_text())
    return False


GRPC_ENGINE_VARIABLE = "PLUGSERVE_TEST_GRPC_ENGINE"
"""Set (``grpcio``), the servers of the tests serve gRPC with that engine: CI runs the gRPC
tests once with each."""


def grpc_engine() -> str:
    """The gRPC engine the tests' servers run: the variable's, else the default."""
    return os.environ.get(GRPC_ENGINE_VARIABLE) or Settings().grpc_engine


class ServerProcess:
    """``plugserve serve`` as a real subprocess on a free loopback port."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        command = [sys.executable, "-m", "plugserve", "serve", "--port", str(self.port), *args]
        if not chooses_workers(args):
            command += ["--workers", "1"]  # one process, whatever the machine's cores
        # Its own gRPC port too (the default, 8001, would be shared by the servers of a test).
        self.grpc_port = 0
        if "--grpc-port" not in args:
            self.grpc_port = free_port()
            while self.grpc_port == self.port:  # the kernel may hand the same port out twice
                self.grpc_port = free_port()
            command += ["--grpc-port", str(self.grpc_port)]
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        engine = os.environ.get(GRPC_ENGINE_VARIABLE)
        if engine and "--grpc-engine" not in args:
            command += ["--grpc-engine", engine]
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            command, cwd=ROOT, env=environ, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = 30.0) -> ServerProcess:
        wait_until_ok(self.proc, self.url + "/v2/health/ready", timeout, self.log)
        return self

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        hdrs = {"Content-Type": "application/json"} if isinstance(body, dict) else {}
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={**hdrs, **(headers or {})}
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        self.proc.terminate()
        try:
            code = self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log.close()
        return code


def metric(source: ServerProcess | str | bytes, name: str, /, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``; 0.0 if none.

    ``source`` is a server (its ``/metrics`` is read, and must answer 200) or the exposition
    text itself. ``name`` is a sample's name as exposed: ``plugserve_requests_total``,
    ``..._count``, ``..._bucket`` (with ``le="0.5"`` among ``labels``). The text is read by
    ``prometheus_client``'s own parser; every label not in ``labels`` may have any value
    (so, say, every worker's or every status's samples add up). ``source`` and ``name`` are
    positional only: ``name="add"`` is a label, as in ``plugserve_executions_total``.
    """
    if isinstance(source, ServerProcess):
        status, _, body = source.request("GET", "/metrics")
        assert status == 200, body
        source = body
    text = source.decode() if isinstance(source, bytes) else source
    wanted = labels.items()
    return float(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and wanted <= sample.labels.items()
        )
    )


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, their children ...), from /proc."""
    found: set[int] = set()
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            tasks = list(Path(f"/proc/{current}/task").iterdir())
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                kids = [int(p) for p in (task / "children").read_text().split()]
            except FileNotFoundError:
                continue
            pending += [k for k in kids if k not in found]
            found.update(kids)
    return found


def tree_rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and every process below it (workers, runner processes)."""
    total = 0.0
    for each in {pid, *descendants(pid)}:
        with contextlib.suppress(FileNotFoundError, RuntimeError):  # ended meanwhile
            total += rss_mib(each)
    return total


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not reaped yet, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
