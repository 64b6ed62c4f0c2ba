"""The ``plugserve`` command: ``serve``, ``validate``, ``new`` and ``doctor``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import sys
import threading
import time
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from plugserve.registry import checks
from plugserve.registry.backends import cpu_share
from plugserve.registry.backends.cpu_share import CpuShare
from plugserve.registry.errors import ConfigError, PlugserveError
from plugserve.registry.fleet.etcd_store import EtcdLocation
from plugserve.registry.manifest import BatchCheckSpec
from plugserve.server import __version__
from plugserve.server.app import create_app
from plugserve.server.commands.validate import ERROR, OUTCOMES, VALID, Report, validate_all
from plugserve.server.config import FLAGS, Settings, load_settings
from plugserve.server.grpc_api.listener import grpc_lifetime
from plugserve.server.http.connections import (
    KEEPALIVE_TIMEOUT_S,
    MIN_REFUSING,
    ConnectionLimits,
    Listener,
)
from plugserve.server.http.fastpath import FAST_PATH
from plugserve.server.http.startup import (
    bind,
    default_max_connections,
    raise_open_files_limit,
    refusing_budget,
    run_app,
)
from plugserve.server.runtime.cores import usable_cores
from plugserve.server.runtime.logs import configure_logging, protocol_logger
from plugserve.server.runtime.stdio import flush_std_streams, protect_std_streams
from plugserve.server.state import DRAIN, METRICS

if TYPE_CHECKING:
    from aiohttp import web

    from plugserve.server.processes.link import WorkerLink

THREAD_GRACE_S = 0.5
"""How long the process waits, after shutdown, for threads other than its own to end."""

ADMIN_CONNECTIONS = 64
"""Open connections on the control plane's own listener (``admin_port``)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plugserve", description="A plugin-based model server.")
    parser.add_argument("--version", action="version", version=f"plugserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the plugins directory over HTTP")
    serve.add_argument("--config", type=Path, help="a TOML settings file")
    checks.with_docstrings(Settings)  # the flags' help
    for name in FLAGS:
        _setting_flag(serve, name)

    validate = commands.add_parser(
        "validate",
        help="load one plugin package as the server would, without a server",
        description="Exit 0: valid; 1: invalid package; 2: usage or environment error.",
    )
    validate.add_argument(
        "folder",
        type=Path,
        nargs="+",
        help="a package: <plugins_dir>/<type>/<name>/<version>, or anywhere; several "
        "packages are validated together (their chains may name each other)",
    )
    validate.add_argument("--models-dir", type=Path, help="default: ./models")
    validate.add_argument(
        "--plugins-dir",
        type=Path,
        help="check the runner's chain against this folder (default: the one FOLDER lies in)",
    )
    validate.add_argument("--json", action="store_true", help="print a JSON object")
    check = validate.add_argument_group(
        "batching",
        "--batching runs the same sample requests alone and batched and compares the answers "
        "(exit 1 where batching changes one past the tolerance: |batched - alone| > "
        "atol + rtol * |alone|)",
    )
    check.add_argument("--batching", action="store_true", help="check that batching is exact")
    defaults = BatchCheckSpec()
    check.add_argument("--rtol", type=float, default=defaults.rtol, help="default: %(default)g")
    check.add_argument("--atol", type=float, default=defaults.atol, help="default: %(default)g")
    check.add_argument(
        "--sample",
        type=Path,
        help="a .npz of sample inputs: arrays named <input> (one request a row) or "
        "<request>/<input>; default: random inputs of the declared shapes",
    )
    check.add_argument(
        "--seed", type=int, default=defaults.seed, help="of the random inputs (default: 0)"
    )

    new = commands.add_parser("new", help="write a working plugin package to start from")
    new.add_argument("type", choices=["runner", "preprocessor", "postprocessor"])
    new.add_argument("name", help="[a-z0-9][a-z0-9_-]{0,63}")
    new.add_argument("--version", default="1.0.0", dest="package_version")
    new.add_argument("--dir", type=Path, default=Path("plugins"), help="default: ./plugins")
    new.add_argument(
        "--backend",
        choices=["python", "onnxruntime"],
        default="python",
        help="a runner's: a Python module (default), or a manifest-only ONNX Runtime runner",
    )
    new.add_argument(
        "--model",
        help="with --backend onnxruntime: the model, models:NAME[/VERSION[/FILE]]",
    )
    new.add_argument("--models-dir", type=Path, default=Path("models"), help="default: ./models")

    doctor = commands.add_parser(
        "doctor",
        help="check this machine: Python, ONNX Runtime, GPU libraries, etcd, settings",
        description="Exit 0: serving would work; 1: it would not.",
    )
    doctor.add_argument("--config", type=Path, help="a TOML settings file")
    doctor.add_argument("--json", action="store_true", help="print a JSON object")
    return parser


async def _install_signal_handlers(app: web.Application) -> None:
    app[DRAIN].install()


def _setting_flag(parser: argparse.ArgumentParser, name: str) -> None:
    """The flag of setting ``name`` (``--grpc-port``), as the setting declares it: its type,
    its choices, ``--no-`` for a switch, its description's first sentence and default."""
    field = Settings.model_fields[name]
    annotation = field.annotation
    members = typing.get_args(annotation) or (annotation,)
    options: dict[str, Any] = {}
    if typing.get_origin(annotation) is typing.Literal:
        options["choices"] = list(members)
    elif annotation is bool:
        options.update(action=argparse.BooleanOptionalAction, default=None)
    elif annotation is int:
        options["type"] = int
    elif Path in members:
        options["type"] = Path
    about = " ".join((field.description or "").split()).replace("``", "").replace("%", "%%")
    first = about.split(". ")[0].rstrip(".")
    default = field.get_default(call_default_factory=False)
    if isinstance(default, bool):
        default = "on" if default else "off"
    shown = f"; default: {default}" if default not in (None, "") and "default" not in first else ""
    if first[1:2].islower():
        first = first[:1].lower() + first[1:]
    parser.add_argument(f"--{name.replace('_', '-')}", help=first + shown, **options)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "new":
            return _new(args)
        if args.command == "doctor":
            from plugserve.server.commands.doctor import run_doctor

            return run_doctor(args.config, args.json)
        return _validate(args)
    except PlugserveError as exc:
        print(f"plugserve: {exc.message}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    flags = {name: getattr(args, name) for name in FLAGS}
    settings = load_settings(args.config, flags)
    protect_std_streams()
    configure_logging(settings.log_format, settings.log_level)
    log = structlog.get_logger("plugserve.server")
    log.info(
        "serving",
        url=f"http://{settings.host}:{settings.port}",
        plugins_dir=str(settings.plugins_dir),
        models_dir=str(settings.models_dir),
        admin_token=settings.admin_token is not None,
        inference_token=settings.inference_token is not None,
        registry=_shown_registry(settings.registry),
        workers=settings.worker_count,
        admin_url=f"http://{settings.admin_host or settings.host}:{settings.admin_port}"
        if settings.admin_port
        else None,
    )
    workers = settings.worker_count
    # Backends size their thread pools from it: every worker runs an event loop.
    cpu_share.assign(CpuShare(usable_cores(), workers))
    if workers > 1:
        from plugserve.server.processes.supervisor import supervise

        return supervise(settings, workers, _event_loop(settings.event_loop))
    sockets = _sockets(settings)
    if settings.grpc_port:  # free, as one process finds it: a clean error now, not at startup
        bind(settings.host, settings.grpc_port, reuse_port=False).close()
    return serve_sockets(settings, sockets)


def serve_sockets(
    settings: Settings, sockets: list[socket.socket], worker: WorkerLink | None = None
) -> int:
    """Serve the app on ``sockets`` until a signal stops it; the exit code.

    A worker (one of several processes) listens only once its plugins are loaded:
    until then the other workers, or at the first start its supervisor, answer.
    """
    app = create_app(settings, worker=worker)
    app.on_startup.append(_install_signal_handlers)
    app.cleanup_ctx.append(grpc_lifetime(shared=worker is not None))
    listeners = _listeners(settings, len(sockets))
    listeners[0].fast = app.get(FAST_PATH)  # the data plane's; the admin port's is aiohttp's
    app[METRICS].collect_connections(listeners)
    run_app(
        app,
        sockets,
        listeners,
        _event_loop(settings.event_loop),
        access_log=None,
        logger=protocol_logger(),
        keepalive_timeout=KEEPALIVE_TIMEOUT_S,
        # Our drain (server/runtime/shutdown.py) has already waited for in-flight requests.
        shutdown_timeout=1.0,
        accept_while_starting=worker is None,
        listening=None if worker is None else worker.listening,
    )
    _leave_lingering_threads(0)
    return 0


def _leave_lingering_threads(code: int) -> None:
    """Exit now if threads a plugin started (not daemon ones) would keep the process up.

    The plugins are closed by now; a thread still running after a short grace
    would keep the interpreter waiting forever, so the process exits with
    ``os._exit`` instead, once the log is flushed (``exit_with_threads`` names them).
    """
    deadline = time.monotonic() + THREAD_GRACE_S
    for thread in _lingering_threads():
        thread.join(max(0.0, deadline - time.monotonic()))
    left = _lingering_threads()
    if left:
        log = structlog.get_logger("plugserve.server")
        log.warning("exit_with_threads", threads=sorted(t.name for t in left))
        flush_std_streams()
        os._exit(code)


def _lingering_threads() -> list[threading.Thread]:
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]


def _listeners(settings: Settings, count: int) -> list[Listener]:
    """The data plane's listener, and the control plane's (its own cap) when it has a port."""
    open_files = raise_open_files_limit()
    if count > 1:  # the control plane's own listener: a small share, out of the same files
        open_files -= ADMIN_CONNECTIONS + MIN_REFUSING
    max_connections = settings.max_connections or default_max_connections(open_files)
    limits = ConnectionLimits(
        settings.header_timeout_s,
        settings.body_timeout_s,
        max_connections,
        refusing_budget(open_files, max_connections),
    )
    structlog.get_logger("plugserve.server").info(
        "connections",
        max_connections=limits.max_connections,
        open_files_limit=open_files,
        header_timeout_s=limits.header_timeout_s,
        body_timeout_s=limits.body_timeout_s,
    )
    admin = dataclasses.replace(
        limits, max_connections=ADMIN_CONNECTIONS, max_refusing=MIN_REFUSING
    )
    return [Listener("data", limits), Listener("admin", admin)][:count]


def _shown_registry(url: str) -> str:
    """The registry setting for the log, never with a password in it."""
    return url if url == "local" else EtcdLocation.parse(url).shown


def _sockets(settings: Settings) -> list[socket.socket]:
    """The data plane's listening socket, and the control plane's when it has its own."""
    addresses = [(settings.host, settings.port)]
    if settings.admin_port is not None:
        addresses.append((settings.admin_host or settings.host, settings.admin_port))
    sockets = []
    for host, port in addresses:
        sock = bind(host, port, reuse_port=False)
        sock.listen(1024)
        sock.setblocking(False)
        sockets.append(sock)
    return sockets


def _event_loop(choice: str) -> asyncio.AbstractEventLoop:
    """uvloop where it is installed (``auto``) or asked for; else asyncio's own loop."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ConfigError("event_loop = 'uvloop' but uvloop is not installed") from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _new(args: argparse.Namespace) -> int:
    """``plugserve new``: 0 with the package written, 1 when its folder exists already."""
    from plugserve.server.commands.scaffold import onnx_runner_files, write_package

    files = None
    if args.backend == "onnxruntime":
        files = _onnx_files(args, onnx_runner_files)
    elif args.model is not None:
        raise ConfigError("--model takes --backend onnxruntime")
    try:
        folder = write_package(args.type, args.name, args.package_version, args.dir, files)
    except FileExistsError as exc:
        print(f"plugserve: {exc}: not overwritten", file=sys.stderr)
        return 1
    except OSError as exc:  # --dir a file, unwritable: the environment's, as a usage error
        print(f"plugserve: cannot write the package under {args.dir}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {folder}")
    print(f"  check it:  plugserve validate {folder} --models-dir {args.models_dir}")
    if files is None:
        print(f"  test it:   pytest {folder / 'test_plugin.py'}")
    return 0


def _onnx_files(
    args: argparse.Namespace, make: Callable[[str, str, str, Path], dict[str, str]]
) -> dict[str, str]:
    """The files of a manifest-only ONNX runner: its model resolved where the server will
    resolve it (``models:`` in ``--models-dir``; a plain path in the package)."""
    from plugserve.registry.models import MODELS_SCHEME, resolve_model

    if args.type != "runner":
        raise ConfigError("--backend takes a runner")
    if args.model is None:
        raise ConfigError("--backend onnxruntime needs --model (models:NAME[/VERSION[/FILE]])")
    if not args.model.startswith(MODELS_SCHEME):
        raise ConfigError(
            f"--model {args.model!r}: name a model in the models folder, models:NAME[/VERSION"
            "[/FILE]] (a file inside the package: write the package, copy the file in, set "
            "[runner] model)"
        )
    try:
        path = resolve_model(args.model, Path("."), args.models_dir, "model.onnx")
    except PlugserveError as exc:
        raise ConfigError(f"--model: {exc.message}") from None
    return make(args.name, args.package_version, args.model, path)


def _batch_check(args: argparse.Namespace) -> BatchCheckSpec | None:
    """``--batching`` and its options, checked (:class:`ConfigError` for a bad one)."""
    if not args.batching:
        return None
    if not (args.rtol >= 0 and args.atol >= 0):  # NaN too
        raise ConfigError("--rtol and --atol are at least 0")
    if args.sample is not None and not args.sample.is_file():
        raise ConfigError(f"--sample {args.sample}: no such file")
    sample = None if args.sample is None else Path(os.path.abspath(args.sample))
    return BatchCheckSpec(args.rtol, args.atol, args.seed, sample)


def _validate(args: argparse.Namespace) -> int:
    """``plugserve validate``: the report on stdout, its outcome as the exit code."""
    configure_logging("console", "warning")
    models_dir = Path(os.path.abspath(args.models_dir or "models"))
    try:
        batching = _batch_check(args)
        # What the package prints (at import, create, warmup) goes to stderr: stdout is the
        # report's, which --json keeps one JSON object.
        with contextlib.redirect_stdout(sys.stderr):
            reports = validate_all(
                args.folder, models_dir, args.plugins_dir, args.models_dir is not None, batching
            )
    except ConfigError as exc:  # a usage error: still one JSON object with --json
        if not args.json:
            raise
        report = Report(Path(os.path.abspath(args.folder[0])), models_dir, code=ERROR)
        report.problems.append(exc.message)
        reports = [report]
    code = max(report.code for report in reports)
    if len(reports) == 1:
        shown: dict[str, object] = reports[0].as_json()
    else:
        packages = [report.as_json() for report in reports]
        shown = {"outcome": OUTCOMES[code], "valid": code == VALID, "packages": packages}
    print(
        json.dumps(shown, indent=2)
        if args.json
        else "\n\n".join(report.text() for report in reports)
    )
    _leave_lingering_threads(code)
    return code
