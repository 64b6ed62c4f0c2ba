"""Triton's Python client examples against plugserve: which run unchanged and print PASS.

    python -m tests.benchmarks.triton_examples EXAMPLES_DIR [--only NAME ...] [--protocol P]
        [--server-root DIR] [--client-path DIR] [--timeout S] [--tail N]
        [--http-port P --grpc-port G] [--include-excluded]

EXAMPLES_DIR is ``src/python/examples`` of Triton's client repository, extracted
anywhere (its code is not part of plugserve): for instance ``git -C
<client.git> archive HEAD src/python/examples | tar -x -C /tmp/triton-examples``.

Builds the fixtures of ``tests/fixtures/triton_models`` (Triton's example models
as plugins) into a temporary folder, starts ``python -m plugserve serve`` on them
from ``--server-root`` (default: this checkout), and runs each example as a
subprocess, unchanged, with ``-u 127.0.0.1:<port>`` (HTTP) or ``-u
127.0.0.1:<grpc port>`` (gRPC), plus the arguments Triton's docs give it (and a
few variants: compression, ``-d`` for the dynamic sequence models, batched,
async and streaming image requests). An example passes when it exits 0 and, if
its source prints a ``PASS`` line, printed it. The model-control examples, which
load, reconfigure and unload ``simple`` and count the repository's models (seven
over HTTP, eight over gRPC), each get a fresh server holding that many. Prints
a table, the last lines of each failure, and the examples left out with why.

``--server-root`` serves from a working tree as it is (a merge in progress
included); to serve a commit, extract it first: ``git archive main | tar -x -C
/tmp/main-snap`` and ``--server-root /tmp/main-snap``.

The image examples need Pillow (and ``attrdict`` for HTTP) in the examples'
Python: ``--client-path DIR`` puts DIR first on their ``PYTHONPATH`` (``pip
install --target DIR pillow attrdict``). Not run by CI.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.fixtures.triton_models.build import SIMPLE, build
from tests.helpers import ROOT, free_port, wait_until_ok

IMAGE = "IMAGE"
"""Stands for the test image in an example's arguments."""

IMAGE_HTTP = ("PIL", "attrdict")
IMAGE_GRPC = ("PIL",)

SEVEN = SIMPLE
"""What simple_http_model_control.py counts: "There are seven models in the repository"."""
EIGHT = (*SIMPLE, "custom_identity_int32")
"""What simple_grpc_model_control.py counts: "There are eight models in the repository"."""


@dataclass(frozen=True)
class Example:
    script: str
    protocol: str  # "HTTP" or "gRPC": which port -u names
    args: str = ""  # beyond -u, as a shell would split them; IMAGE: the test image
    repository: tuple[str, ...] = ()  # runners of a fresh server of its own; () the shared one
    needs: tuple[str, ...] = ()  # modules the client must import

    @property
    def name(self) -> str:
        return f"{self.script} {self.args}".strip()


EXAMPLES = (
    Example("simple_http_infer_client.py", "HTTP"),
    Example(
        "simple_http_infer_client.py",
        "HTTP",
        "--request-compression-algorithm gzip --response-compression-algorithm deflate",
    ),
    Example("simple_http_async_infer_client.py", "HTTP"),
    Example("simple_http_aio_infer_client.py", "HTTP"),
    Example("simple_http_string_infer_client.py", "HTTP"),
    Example("simple_http_sequence_sync_infer_client.py", "HTTP"),
    Example("simple_http_sequence_sync_infer_client.py", "HTTP", "-d"),
    Example("simple_http_shm_client.py", "HTTP"),
    Example("simple_http_shm_string_client.py", "HTTP"),
    Example("reuse_infer_objects_client.py", "HTTP", "-i http"),
    Example("simple_http_model_control.py", "HTTP", repository=SEVEN),
    Example(
        "image_client.py", "HTTP", "-m densenet_onnx -c 3 -s INCEPTION IMAGE", needs=IMAGE_HTTP
    ),
    Example(
        "image_client.py",
        "HTTP",
        "-m inception_graphdef -b 2 -c 3 -s INCEPTION -a IMAGE",
        needs=IMAGE_HTTP,
    ),
    Example("ensemble_image_client.py", "HTTP", "-c 3 IMAGE"),
    Example("simple_grpc_infer_client.py", "gRPC"),
    Example("simple_grpc_infer_client.py", "gRPC", "-C gzip"),
    Example("simple_grpc_async_infer_client.py", "gRPC"),
    Example("simple_grpc_aio_infer_client.py", "gRPC"),
    Example("simple_grpc_custom_args_client.py", "gRPC"),
    Example("simple_grpc_keepalive_client.py", "gRPC"),
    Example("simple_grpc_string_infer_client.py", "gRPC"),
    Example("grpc_explicit_int_content_client.py", "gRPC"),
    Example("grpc_explicit_int8_content_client.py", "gRPC"),
    Example("grpc_explicit_byte_content_client.py", "gRPC"),
    Example("simple_grpc_sequence_sync_infer_client.py", "gRPC"),
    Example("simple_grpc_sequence_sync_infer_client.py", "gRPC", "-d"),
    Example("simple_grpc_sequence_stream_infer_client.py", "gRPC"),
    Example("simple_grpc_sequence_stream_infer_client.py", "gRPC", "-d"),
    Example("simple_grpc_aio_sequence_stream_infer_client.py", "gRPC"),
    Example("simple_grpc_aio_sequence_stream_infer_client.py", "gRPC", "-d"),
    Example("simple_grpc_shm_client.py", "gRPC"),
    Example("simple_grpc_shm_string_client.py", "gRPC"),
    Example("reuse_infer_objects_client.py", "gRPC", "-i grpc"),
    Example("simple_grpc_model_control.py", "gRPC", repository=EIGHT),
    Example("simple_grpc_custom_repeat.py", "gRPC"),  # decoupled: ten responses to one request
    Example("grpc_client.py", "gRPC"),
    Example(
        "image_client.py",
        "gRPC",
        "-i grpc -m densenet_onnx -c 3 -s INCEPTION IMAGE",
        needs=IMAGE_GRPC,
    ),
    Example(
        "image_client.py",
        "gRPC",
        "-i grpc --streaming -m inception_graphdef -c 3 -s INCEPTION IMAGE",
        needs=IMAGE_GRPC,
    ),
    Example(
        "grpc_image_client.py", "gRPC", "-m densenet_onnx -c 3 -s INCEPTION IMAGE", needs=IMAGE_GRPC
    ),
    Example("ensemble_image_client.py", "gRPC", "-i grpc -c 3 IMAGE"),
)
"""What runs, in order; each script with the arguments of its use in Triton's docs."""

EXCLUDED = {
    "simple_http_cudashm_client.py": "CUDA shared memory: needs a GPU (and cuda-python)",
    "simple_grpc_cudashm_client.py": "CUDA shared memory: needs a GPU (and cuda-python)",
    "simple_http_health_metadata.py": "fails unless the server's name is 'triton' "
    "(get_server_metadata()['name'])",
    "simple_grpc_health_metadata.py": "fails unless the server's name is 'triton' "
    "(ServerMetadata.name)",
    "memory_growth_test.py": "no URL option (localhost:8000 and 8001 written in) and no PASS "
    "line: a QA memory test; runs with --http-port 8000 --grpc-port 8001",
}
"""Examples the harness does not run by default, with why."""

MEMORY_GROWTH = (
    Example("memory_growth_test.py", "HTTP", "-r 20"),
    Example("memory_growth_test.py", "gRPC", "-i grpc -r 20"),
)


@dataclass
class Outcome:
    example: Example
    verdict: str  # PASS, FAIL, SKIP
    detail: str = ""
    seconds: float = 0.0


class Server:
    """``python -m plugserve serve`` from ``root`` on one fixtures folder, on free (or given) ports."""

    def __init__(self, root: Path, fixtures: Path, log: Path, http: int, grpc: int) -> None:
        """``grpc`` 0: no ``--grpc-port`` (a checkout from before gRPC, HTTP examples only)."""
        self.http_port, self.grpc_port, self.log_path = http, grpc, log
        plugins, models = fixtures / "plugins", fixtures / "models"
        command = [sys.executable, "-m", "plugserve", "serve", "--plugins-dir", str(plugins),
                   "--models-dir", str(models), "--port", str(http)]  # fmt: skip
        if grpc:
            command += ["--grpc-port", str(grpc)]
        # No __pycache__ written into a checkout that is not ours (--server-root).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            command, cwd=root, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def url(self, protocol: str) -> str:
        return f"127.0.0.1:{self.http_port if protocol == 'HTTP' else self.grpc_port}"

    def wait_ready(self, timeout: float = 60.0) -> Server:
        url = f"http://127.0.0.1:{self.http_port}/v2/health/ready"
        wait_until_ok(self.proc, url, timeout, lambda: self.log_path.read_text(errors="replace"))
        return self

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def write_image(path: Path, width: int = 96, height: int = 64) -> Path:
    """A binary PPM (P6) gradient: PIL reads it, and the ensemble's preprocessor decodes it."""
    pixels = bytearray()
    for y in range(height):
        for x in range(width):
            pixels += bytes((x * 255 // width, y * 255 // height, 128))
    path.write_bytes(b"P6\n%d %d\n255\n" % (width, height) + bytes(pixels))
    return path


def prints_pass(script: Path) -> bool:
    """Whether the example's source prints a PASS line (then it must print it to pass)."""
    return re.search(r"print\(\s*[\"']PASS", script.read_text()) is not None


def missing_modules(python: str, modules: tuple[str, ...], env: dict[str, str]) -> list[str]:
    """Which of ``modules`` the examples' Python cannot find (found, not imported:
    attrdict imports only after image_client.py patches ``collections``)."""
    missing = []
    for module in modules:
        probe = (
            f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
        )
        if subprocess.run([python, "-c", probe], env=env).returncode != 0:
            missing.append(module)
    return missing


def run_example(
    example: Example,
    examples_dir: Path,
    url: str,
    image: Path,
    env: dict[str, str],
    timeout: float,
    tail: int,
) -> Outcome:
    script = examples_dir / example.script
    args = [str(image) if a == IMAGE else a for a in shlex.split(example.args)]
    command = [sys.executable, str(script), "-u", url, *args]
    if example.script == "memory_growth_test.py":
        command = [sys.executable, str(script), *args]  # it takes no URL
    started = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=examples_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        lines = output.decode(errors="replace").splitlines()[-tail:]
        took = time.monotonic() - started
        return Outcome(
            example, "FAIL", "\n".join([f"timed out after {timeout:.0f}s", *lines]), took
        )
    took = time.monotonic() - started
    text = output.decode(errors="replace")
    passed = proc.returncode == 0
    if passed and prints_pass(script):
        passed = any(line.startswith("PASS") for line in text.splitlines())
    if passed:
        return Outcome(example, "PASS", "", took)
    lines = text.splitlines()[-tail:]
    head = f"exit {proc.returncode}" + ("" if proc.returncode else ", no PASS line")
    return Outcome(example, "FAIL", "\n".join([head, *lines]), took)


def selected(
    only: list[str] | None, protocol: str | None, include_excluded: bool, fixed_ports: bool
) -> list[Example]:
    examples = list(EXAMPLES)
    if include_excluded:
        examples += [
            Example(s, "gRPC" if "grpc" in s else "HTTP")
            for s in EXCLUDED
            if s != "memory_growth_test.py"
        ]
    if fixed_ports or include_excluded:
        examples += MEMORY_GROWTH
    if protocol:
        examples = [e for e in examples if e.protocol.lower() == protocol.lower()]
    if not only:
        return examples
    wanted = {n.removesuffix(".py") for n in only}
    return [e for e in examples if e.script.removesuffix(".py") in wanted or e.name in only]


@dataclass
class Run:
    """What every example of one harness run shares."""

    examples_dir: Path
    server_root: Path
    scratch: Path
    image: Path
    env: dict[str, str]
    ports: tuple[int, int]
    timeout: float
    tail: int


def client_env(client_path: Path | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    if client_path:
        paths = [str(client_path.resolve()), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def serve_group(
    run: Run, name: str, group: list[Example], runners: tuple[str, ...] | None
) -> list[Outcome]:
    """Build a repository (all fixtures, or ``runners``), serve it, run ``group`` against it."""
    build(run.scratch / name, runners)
    server = Server(run.server_root, run.scratch / name, run.scratch / f"{name}.log", *run.ports)
    try:
        server.wait_ready()
    except (RuntimeError, TimeoutError) as exc:
        server.stop()
        tail = "\n".join(str(exc).splitlines()[-run.tail :])
        return [Outcome(e, "FAIL", f"server did not start:\n{tail}") for e in group]
    outcomes = []
    try:
        for example in group:
            print(f"... {example.name} ({example.protocol})", file=sys.stderr, flush=True)
            url = server.url(example.protocol)
            outcomes.append(
                run_example(example, run.examples_dir, url, run.image, run.env, run.timeout,
                            run.tail)
            )  # fmt: skip
    finally:
        server.stop()
    return outcomes


def run_all(args: argparse.Namespace) -> list[Outcome]:
    """Every selected example: the shared server's, then each on a fresh server of its own."""
    examples_dir = args.examples_dir.resolve()
    env = client_env(args.client_path)
    fixed = args.http_port == 8000 and args.grpc_port == 8001
    chosen = selected(args.only, args.protocol, args.include_excluded, fixed)
    outcomes: list[Outcome] = []
    runnable: list[Example] = []
    for example in chosen:
        missing = missing_modules(sys.executable, example.needs, env)
        if not (examples_dir / example.script).is_file():
            outcomes.append(Outcome(example, "SKIP", "not in EXAMPLES_DIR"))
        elif missing:
            detail = f"the client lacks {', '.join(missing)} (see --client-path)"
            outcomes.append(Outcome(example, "SKIP", detail))
        else:
            runnable.append(example)
    grpc = any(e.protocol == "gRPC" for e in runnable)
    ports = (args.http_port or free_port(), (args.grpc_port or free_port()) if grpc else 0)
    with tempfile.TemporaryDirectory(prefix="triton-examples-") as tmp:
        scratch = Path(tmp)
        image = write_image(scratch / "image.ppm")
        run = Run(examples_dir, args.server_root.resolve(), scratch, image, env, ports,
                  args.timeout, args.tail)  # fmt: skip
        shared = [e for e in runnable if not e.repository]
        if shared:
            outcomes += serve_group(run, "all", shared, None)
        for index, example in enumerate(e for e in runnable if e.repository):
            outcomes += serve_group(run, f"fresh-{index}", [example], example.repository)
    return sorted(outcomes, key=lambda o: chosen.index(o.example))


ERROR_LINE = re.compile(r"error|exception|fail|improper|expect|unknown", re.IGNORECASE)
NOISE = ("Unclosed connector", "connector:", "connections:", "Traceback")


def summary(outcome: Outcome, width: int = 100) -> str:
    """One line for the table: why it was skipped, that it exited 0 without its PASS line,
    or the failure's error: a gRPC error's details, else the last line that reads as one."""
    lines = [line.strip() for line in outcome.detail.splitlines() if line.strip()]
    if not lines or outcome.verdict == "PASS":
        return ""
    line = lines[-1]
    if outcome.verdict == "SKIP" or lines[0].startswith("exit 0"):
        line = lines[0]
    elif details := [x for x in lines if x.startswith("details = ")]:
        line = details[-1]
    elif errors := [x for x in lines[1:] if ERROR_LINE.search(x) and not x.startswith(NOISE)]:
        line = errors[-1]
    return line if len(line) <= width else line[: width - 3] + "..."


def report(outcomes: list[Outcome], examples_dir: Path, args: argparse.Namespace) -> None:
    width = max(len(o.example.name) for o in outcomes)
    print(f"\n| {'example':<{width}} | protocol | result | s | why |")
    print(f"| {'-' * width} | -------- | ------ | - | --- |")
    for o in outcomes:
        print(
            f"| {o.example.name:<{width}} | {o.example.protocol:<8} | {o.verdict:<6} |"
            f" {o.seconds:.1f} | {summary(o)} |"
        )
    passed = sum(o.verdict == "PASS" for o in outcomes)
    print(f"\n{passed} of {len(outcomes)} passed")
    failures = [o for o in outcomes if o.verdict == "FAIL"]
    for o in failures:
        print(f"\n--- FAIL {o.example.name} ({o.example.protocol})")
        print(o.detail)
    if not args.include_excluded:
        print("\nNot run:")
        for script, reason in EXCLUDED.items():
            print(f"  {script}: {reason}")
    known = {e.script for e in EXAMPLES} | set(EXCLUDED)
    unlisted = sorted(p.name for p in examples_dir.glob("*.py") if p.name not in known)
    if unlisted:
        print("\nIn EXAMPLES_DIR but unknown to this harness: " + ", ".join(unlisted))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples_dir", type=Path, help="src/python/examples of Triton's client")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="script names (with or without .py) or full example names",
    )
    parser.add_argument(
        "--server-root",
        type=Path,
        default=ROOT,
        help="the checkout `python -m plugserve` runs from (default: this one)",
    )
    parser.add_argument(
        "--client-path", type=Path, help="put first on the examples' PYTHONPATH (Pillow, attrdict)"
    )
    parser.add_argument("--protocol", choices=["HTTP", "gRPC"], help="only these examples")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per example")
    parser.add_argument("--tail", type=int, default=8, help="output lines shown per failure")
    parser.add_argument("--http-port", type=int, default=0, help="default: a free port")
    parser.add_argument("--grpc-port", type=int, default=0, help="default: a free port")
    parser.add_argument(
        "--include-excluded", action="store_true", help="run the examples left out as well"
    )
    args = parser.parse_args()
    if not (args.server_root / "server" / "__main__.py").is_file():
        parser.error(f"--server-root {args.server_root}: no server/__main__.py there")
    outcomes = run_all(args)
    if not outcomes:
        parser.error("no example selected")
    report(outcomes, args.examples_dir, args)
    sys.exit(0 if all(o.verdict != "FAIL" for o in outcomes) else 1)


if __name__ == "__main__":
    main()
