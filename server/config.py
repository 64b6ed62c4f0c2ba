"""Server settings: defaults, then a TOML config file, then the environment, then flags."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plugserve.registry import checks
from plugserve.registry.errors import ConfigError
from plugserve.registry.lifecycle.budget import parse_budget, parse_gpu_budget
from plugserve.server.runtime.cores import usable_cores

ADMIN_TOKEN_ENV = "PLUGSERVE_ADMIN_TOKEN"
ADMIN_TOKEN_FILE_ENV = "PLUGSERVE_ADMIN_TOKEN_FILE"
INFERENCE_TOKEN_ENV = "PLUGSERVE_INFERENCE_TOKEN"
INFERENCE_TOKEN_FILE_ENV = "PLUGSERVE_INFERENCE_TOKEN_FILE"
TOKENS = ("admin_token", "inference_token")
MAX_TOKEN_FILE_BYTES = 64 * 1024
"""A token file larger than this is refused (it is a secret, not a document)."""
"""Each token setting has a ``<name>_file`` twin and the env vars ``PLUGSERVE_<NAME>[_FILE]``."""
ETCD_PASSWORD_ENV = "PLUGSERVE_ETCD_PASSWORD"
_PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Every number setting is finite and inside these bounds; one not listed: |x| <= 2**53.
_BOUNDS: dict[str, tuple[float, float]] = {
    "port": (0, 65535),
    "admin_port": (1, 65535),
    "grpc_port": (0, 65535),
    "drain_timeout_s": (0, 86_400),
    "max_body_bytes": (1, 2**40),
    "max_json_bytes": (1, 2**40),
    "reload_debounce_ms": (0, 3_600_000),
    "max_inputs": (1, 1_000_000),
    "max_tensor_rank": (1, 64),
    "max_tensor_elements": (1, 2**40),
    "max_bytes_elements": (1, 2**40),
    "fleet_lease_ttl_s": (2, 86_400),
    "fleet_startup_wait_s": (0, 3600),
    "rollout_interval_s": (0.05, 3600),
    "load_timeout_s": (0, 1e6),
    "close_timeout_s": (0, 1e6),
    "header_timeout_s": (0, 86_400),
    "body_timeout_s": (0, 86_400),
    "grpc_idle_timeout_s": (0, 86_400),
    "max_connections": (1, 1_000_000),
    "body_threads": (1, 64),
    "max_large_bodies": (1, 10_000),
    "request_bytes_budget": (0, 2**44),
    "workers": (1, 1024),
    "worker_stall_timeout_s": (0, 86_400),
    "runner_stall_timeout_s": (0, 86_400),
    "response_cache_bytes": (0, 2**40),
}
"""Each number setting's bounds; any other number is finite and at most 2**53."""
MIN_STALL_TIMEOUT_S = 1.0
"""The shortest stall check there is (0 turns it off): a loop busy with one large batch or a
collection must not read as stuck."""
_ABOVE_LOW = {
    "load_timeout_s",
    "close_timeout_s",
    "header_timeout_s",
    "body_timeout_s",
    "grpc_idle_timeout_s",
}
"""Settings that must be more than their low bound (a zero timeout means nothing)."""


def bundled_dir(name: str) -> Path:
    """The bundled ``plugins/`` or ``models/`` of a source checkout, else ``./<name>``."""
    bundled = _PROJECT_ROOT / name
    return bundled if bundled.is_dir() else Path.cwd() / name


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; nothing is allocated before these are checked."""

    max_inputs: int = 64
    max_rank: int = 16
    max_elements: int = 1 << 26
    max_bytes_elements: int = 1 << 20


@dataclass(frozen=True)
class Settings:
    """Everything the server is configured with. Paths are absolute."""

    host: str = "127.0.0.1"
    port: int = 8000
    plugins_dir: Path = dataclasses.field(default_factory=lambda: bundled_dir("plugins"))
    models_dir: Path = dataclasses.field(default_factory=lambda: bundled_dir("models"))
    admin_token: str | None = dataclasses.field(default=None, repr=False)
    admin_token_file: Path | None = None
    admin_host: str | None = None
    admin_port: int | None = None
    grpc_port: int = 8001
    """The KServe v2 gRPC service's port (on ``host``); 0 turns it off (server/grpc_api/)."""
    log_format: str = "console"
    log_level: str = "info"
    drain_timeout_s: float = 30.0
    load_timeout_s: float = 120.0
    """The bound on a version's import, create and warmup, and on each startup hook."""
    close_timeout_s: float = 10.0
    """The bound on a component's ``close()`` and on the shutdown hooks."""
    max_body_bytes: int = 64 * 1024 * 1024
    max_json_bytes: int = 16 * 1024 * 1024
    """The JSON of a request (a JSON body, or the JSON header of a body with binary tensor
    data) is at most this long, else 413: a JSON parse holds the interpreter for its whole
    length, so other requests wait on it; large tensors travel as binary data."""
    watch: bool = True
    reload_debounce_ms: int = 200
    event_loop: str = "auto"
    access_log: bool = False
    fast_path: bool = True
    """Whether plain HTTP/1.1 v2 infer requests take the fast path (``server/http/fastpath.py``)
    on the data port; off (or with an inference token set), every request is aiohttp's."""
    memory_budget: int | str = 0
    """What the runner versions loaded on demand may hold resident, in bytes, a size
    (``"4GiB"``) or a share of the machine or cgroup (``"60%"``); 0: no budget."""
    gpu_memory_budget: int | str = 0
    """What the runner versions loaded on demand may hold on each GPU: bytes, a size
    (``"20GiB"``) or a share of each GPU's memory (``"80%"``); 0: no GPU budget."""
    strict_readiness: bool = True
    """At start-up, ready (``/v2/health/ready``) only once every route can serve; a route
    that cannot keeps the server unready and is named in the answer. Off, the server is
    ready without the routes that failed (a partial start). Once the server has been
    ready, a route that fails is reported there and never takes readiness away."""
    default_load: str = "eager"
    """When a runner version that does not say (``[runner] load``) loads: ``eager`` (at
    start and on every change) or ``on_demand`` (on its first request)."""
    grpc_engine: str = "native"
    """What serves gRPC: ``native`` (HTTP/2 read on the event loop's thread,
    ``server/grpc_api/front.py``) or ``grpcio`` (grpc.aio, gRPC's C core)."""
    max_inputs: int = 64
    max_tensor_rank: int = 16
    max_tensor_elements: int = 1 << 26
    max_bytes_elements: int = 1 << 20
    """Elements per BYTES tensor: each one is a Python object, built and checked one by one."""
    registry: str = "local"
    """Where runtime routes live: ``local`` (this process) or ``etcd://host:port/prefix``."""
    etcd_password: str | None = dataclasses.field(default=None, repr=False)
    """Fleet mode with etcd authentication: the password of the URL's user."""
    runtime_routes_file: Path | None = None
    """Local mode: where runtime route changes are saved, to survive restarts."""
    replica_id: str | None = None
    """This replica's name in the fleet; default ``<hostname>:<port>``."""
    fleet_lease_ttl_s: int = 10
    fleet_startup_wait_s: float = 5.0
    rollout_interval_s: float = 1.0
    """How often a rollout's figures are looked at (and, in fleet mode, published)."""
    # Connections and bodies (server/http/connections.py, server/http/bodies.py).
    header_timeout_s: float = 10.0
    """A request's headers must be complete this long after the connection opened or the
    request's first byte arrived; else 408 and the connection is closed."""
    body_timeout_s: float = 60.0
    """A request's whole body must arrive within this long of its headers (else 408), and a
    client that reads nothing of its answer for this long is dropped."""
    max_connections: int | None = None
    """Open client connections per listener; more are answered 503 and closed. Default:
    the open-files limit less 256, at most 4096. It bounds gRPC's open calls too (health
    and readiness apart): more are refused ``RESOURCE_EXHAUSTED``."""
    grpc_idle_timeout_s: float = 75.0
    """A gRPC stream (``ModelStreamInfer``) with no request in flight that sends none for
    this long is ended, and a gRPC connection with no call open is closed."""
    body_threads: int = 2
    """Threads that parse large request bodies and encode large responses."""
    max_large_bodies: int = 8
    """Large bodies (over 256 KiB, or compressed) parsed or waiting at once; more get 429.
    gRPC's large or compressed request messages have as many places of their own (more are
    refused ``RESOURCE_EXHAUSTED``)."""
    request_bytes_budget: int = 0
    """Bytes of requests a process holds while they arrive, and that compressed ones inflate
    to, HTTP's large bodies and gRPC's messages together (``server/http/budget.py``); each
    protocol at most three quarters of it. Past it a request is refused: HTTP 503, gRPC
    ``RESOURCE_EXHAUSTED``. 0: eight times ``max_body_bytes``."""
    # -- data plane access (docs/security.md) --
    inference_token: str | None = dataclasses.field(default=None, repr=False)
    """With a value, every data-plane call but health and ``/metrics`` needs it (or the
    admin token) as ``Authorization: Bearer <token>``."""
    inference_token_file: Path | None = None
    response_cache_bytes: int = 64 * 1024 * 1024
    """The response cache's bound, per worker process: whole responses of the routes whose
    runner sets ``[runner] response_cache = true`` (server/dataplane/cache.py); 0 turns it off."""
    shared_memory: str = "loopback"
    """Who may use Triton's system shared memory extension: ``loopback`` (clients on this
    host), ``any`` (every caller the data plane admits) or ``off``."""
    # -- processes (server/processes/) --
    workers: int | str = "auto"
    """HTTP worker processes sharing the port: a number, or ``auto`` (the default: one per
    usable core). With more than one, a supervisor process runs them (docs/operations.md)."""

    worker_stall_timeout_s: float = 30.0
    """With several workers: one whose event loop has not answered the supervisor for this
    long is killed and replaced (plugin code stuck on its loop); 0 turns the check off."""
    runner_stall_timeout_s: float = 60.0
    """An isolated runner's process whose event loop has not answered for this long (a
    batch stuck in the plugin's code: its sync runner runs on that loop) is killed: its
    requests are answered 500 saying so, and it is started again. 0 turns the check off."""
    inline_runners: str = "auto"
    """Where a worker runs its in-worker runners' batches: ``on`` its event loop (within a
    few ms a batch, ``registry/execution/components/inline.py``), ``off`` on a thread each,
    or ``auto``: on the loop when every usable core has a worker of its own (``workers``
    > 1 and at least one per core), where a thread only adds hand-offs."""

    @property
    def request_bytes(self) -> int:
        """The request byte budget in force (``request_bytes_budget``, or its default)."""
        return self.request_bytes_budget or 8 * self.max_body_bytes

    @property
    def worker_count(self) -> int:
        if self.workers == "auto":
            return max(1, usable_cores())
        return int(self.workers)

    @property
    def runners_on_loop(self) -> bool:
        """Whether each worker runs its runners' batches on its event loop (``inline_runners``)."""
        if self.inline_runners == "auto":
            count = self.worker_count
            return count > 1 and count >= usable_cores()
        return self.inline_runners == "on"

    @functools.cached_property
    def limits(self) -> Limits:
        return Limits(
            self.max_inputs,
            self.max_tensor_rank,
            self.max_tensor_elements,
            self.max_bytes_elements,
        )

    @property
    def memory_budget_bytes(self) -> int:
        """``memory_budget`` in bytes (0: none)."""
        return parse_budget(self.memory_budget)

    @property
    def gpu_memory_budget_value(self) -> int | float:
        """``gpu_memory_budget``: bytes, or a share of each GPU (a float); 0: none."""
        return parse_gpu_budget(self.gpu_memory_budget)

    def __post_init__(self) -> None:
        if isinstance(self.workers, str) and self.workers != "auto":
            text = self.workers  # from the command line: ASCII digits, as a number is written
            if not (text.isascii() and text.isdigit() and len(text) <= 9):
                raise ConfigError(f"workers must be a number or 'auto', not {text!r}")
            object.__setattr__(self, "workers", int(text))
        self._check_tokens()
        _check_numbers(self)  # every number setting against its bounds in _BOUNDS
        if self.log_format not in ("console", "json"):
            raise ConfigError(f"log_format must be 'console' or 'json', not {self.log_format!r}")
        try:
            parse_budget(self.memory_budget)
            parse_gpu_budget(self.gpu_memory_budget)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.default_load not in ("eager", "on_demand"):
            raise ConfigError(f"default_load must be eager or on_demand, not {self.default_load!r}")
        if self.grpc_engine not in ("grpcio", "native"):
            raise ConfigError(f"grpc_engine must be grpcio or native, not {self.grpc_engine!r}")
        if self.event_loop not in ("auto", "asyncio", "uvloop"):
            raise ConfigError(f"event_loop must be auto, asyncio or uvloop: {self.event_loop!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(
                f"log_level must be debug, info, warning or error: {self.log_level!r}"
            )
        if self.grpc_port and self.grpc_port in (self.port, self.admin_port):
            which = "port" if self.grpc_port == self.port else "admin_port"
            raise ConfigError(
                f"grpc_port {self.grpc_port} is also {which}: give gRPC a port of its own "
                "(or grpc_port = 0 to turn it off)"
            )
        for key, whose in (("worker", "workers"), ("runner", "runner processes")):
            value = getattr(self, f"{key}_stall_timeout_s")
            if 0 < value < MIN_STALL_TIMEOUT_S:
                raise ConfigError(
                    f"{key}_stall_timeout_s must be 0 (off) or at least "
                    f"{MIN_STALL_TIMEOUT_S:g} s, not {value!r}: a shorter one would kill busy "
                    f"{whose}"
                )
        if self.inline_runners not in ("auto", "on", "off"):
            raise ConfigError(
                f"inline_runners must be auto, on or off, not {self.inline_runners!r}"
            )
        if self.shared_memory not in ("loopback", "any", "off"):
            raise ConfigError(
                f"shared_memory must be loopback, any or off, not {self.shared_memory!r}"
            )
        if self.registry != "local" and not self.registry.startswith(("etcd://", "etcds://")):
            raise ConfigError(
                "registry must be 'local' or etcd://[user@]host:port/prefix "
                f"(etcds:// for TLS), not a {self.registry.partition(':')[0]!r} URL"
            )

    def _check_tokens(self) -> None:
        """A token that is set must be usable: never empty, never an open door."""
        for name in TOKENS:
            token = getattr(self, name)
            if token is not None and not isinstance(token, str):
                raise ConfigError(f"{name} must be a string, not {_described(token)}")
            if token is not None and not token.strip():
                raise ConfigError(f"{name} is set but empty: set a token or remove the setting")
        if self.inference_token is not None and self.inference_token == self.admin_token:
            raise ConfigError("inference_token must differ from admin_token")


def _check_numbers(settings: Settings) -> None:
    """Every number setting finite and in its bounds (``inf``, ``nan``, ``1e999`` refused)."""
    for name in (f.name for f in dataclasses.fields(settings)):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        low, high = _BOUNDS.get(name, (-checks.MAX_INTEGER, checks.MAX_INTEGER))
        try:
            if isinstance(value, int) and name not in _ABOVE_LOW:
                checks.integer(value, name, low=int(low), high=int(high))
            else:
                checks.number(value, name, low=low, high=high, above=name in _ABOVE_LOW)
        except checks.ValueProblem as exc:
            raise ConfigError(str(exc)) from None


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
_PATHS = {
    "plugins_dir",
    "models_dir",
    "admin_token_file",
    "runtime_routes_file",
    "inference_token_file",
}


def load_settings(
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Merge the config file (relative paths are relative to it), the environment and flags.

    ``overrides`` holds command-line values; ``None`` values are ignored.
    """
    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(_read_config(config_file))
    env = os.environ if environ is None else environ
    from_env = _tokens_from_env(env)
    for name in TOKENS:  # the environment wins over the file, its token file included
        if f"{name}_file" in from_env and name not in from_env:
            values.pop(name, None)
    values.update(from_env)
    if env.get(ETCD_PASSWORD_ENV):
        values["etcd_password"] = env[ETCD_PASSWORD_ENV]
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    for key in _PATHS & values.keys():
        # Absolute, but symlinks kept: the watcher follows a folder's symlink swap.
        try:
            values[key] = Path(os.path.abspath(Path(values[key]).expanduser()))
        except (OSError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"{key}: {exc}") from None
    for name in TOKENS:
        if values.get(f"{name}_file") and values.get(name) is None:
            values[name] = _read_token(name, Path(values[f"{name}_file"]))
    try:
        return Settings(**values)
    except TypeError as exc:
        raise ConfigError(f"invalid settings: {exc}") from None


def _tokens_from_env(env: Mapping[str, str]) -> dict[str, str]:
    """``PLUGSERVE_<TOKEN>`` and ``PLUGSERVE_<TOKEN>_FILE``: set but empty is an error."""
    found = {}
    for name in TOKENS:
        for key in (name, f"{name}_file"):
            var = f"PLUGSERVE_{key.upper()}"
            if var in env:
                found[key] = _token_text(env[var], var)
    return found


def _token_text(value: str, source: str) -> str:
    """A token (or token file) setting without surrounding whitespace; empty is an error."""
    text = value.strip()
    if not text:
        raise ConfigError(f"{source} is set but empty: set a token or remove the setting")
    return text


def _read_token(name: str, path: Path) -> str:
    """A token from a file (a mounted secret); its value is never logged."""
    try:
        with path.open("rb") as secret:  # bounded: a token file may be anything, /dev/zero too
            data = secret.read(MAX_TOKEN_FILE_BYTES + 1)
        if len(data) > MAX_TOKEN_FILE_BYTES:
            raise ConfigError(f"{name}_file {path}: larger than {MAX_TOKEN_FILE_BYTES} bytes")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{name}_file {path}: {reason}") from None
    return _token_text(text, f"{name}_file {path}")


def _read_config(path: Path) -> dict[str, Any]:
    """The settings of a TOML file, each of its setting's type; raises :class:`ConfigError`."""
    try:
        raw = checks.read_toml(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except checks.ValueProblem as exc:
        raise ConfigError(f"{path}: {exc}") from None
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"{path}: unknown setting(s) {unknown}; known: {', '.join(_FIELDS)}")
    for key in TOKENS + tuple(f"{name}_file" for name in TOKENS):
        if isinstance(raw.get(key), str):
            raw[key] = _token_text(raw[key], f"{path}: {key}")
    for key, value in raw.items():
        if isinstance(value, str):
            try:
                checks.text(value, key)
            except checks.ValueProblem as exc:
                raise ConfigError(f"{path}: {exc}") from None
            hidden = next((c for c in value if not c.isprintable()), None)
            if hidden is not None:  # a format, unassigned or private-use character
                raise ConfigError(f"{path}: {key} must be printable text, not hold {hidden!r}")
        elif key in _PATHS:
            raise ConfigError(f"{path}: {key} must be a path (a string), not {_described(value)}")
    for key in _PATHS & raw.keys():
        raw[key] = path.parent / raw[key]
    for key, value in raw.items():
        expected = _expected_type(key)
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise ConfigError(f"{path}: {key} must be {_kind(expected)}, not {_described(value)}")
    return raw


_KINDS: dict[type, str] = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    Path: "a path (a string)",
    list: "a list",
    dict: "a table",
}


def _kind(expected: type | tuple[type, ...]) -> str:
    """What a setting must be, in words: ``an integer``, ``a number``, ``true or false``."""
    if expected == (int, float):
        return "a number"
    if expected == (int, str):
        return "a number or 'auto'"
    kinds = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(_KINDS.get(kind, kind.__name__) for kind in kinds)


def _described(value: Any) -> str:
    """A wrong value and what it is, for a message: ``a string ("abc")``."""
    shown = json.dumps(value) if isinstance(value, str) else repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"{_KINDS.get(type(value), 'a ' + type(value).__name__)} ({shown})"


def _expected_type(key: str) -> type | tuple[type, ...]:
    if key in _PATHS:
        return Path
    types: dict[str, type | tuple[type, ...]] = {
        "port": int,
        "max_body_bytes": int,
        "reload_debounce_ms": int,
        "admin_port": int,
        "grpc_port": int,
        "max_inputs": int,
        "max_tensor_rank": int,
        "max_tensor_elements": int,
        "max_bytes_elements": int,
        "watch": bool,
        "access_log": bool,
        "fast_path": bool,
        "strict_readiness": bool,
        "grpc_engine": str,
        "drain_timeout_s": (int, float),
        "load_timeout_s": (int, float),
        "close_timeout_s": (int, float),
        "fleet_lease_ttl_s": int,
        "fleet_startup_wait_s": (int, float),
        "rollout_interval_s": (int, float),
        # connections and bodies
        "header_timeout_s": (int, float),
        "body_timeout_s": (int, float),
        "grpc_idle_timeout_s": (int, float),
        "max_connections": int,
        "body_threads": int,
        "max_large_bodies": int,
        "request_bytes_budget": int,
        "max_json_bytes": int,
        "workers": (int, str),
        "worker_stall_timeout_s": (int, float),
        "runner_stall_timeout_s": (int, float),
        "response_cache_bytes": int,
        "memory_budget": (int, str),
        "gpu_memory_budget": (int, str),
    }
    return types.get(key, str)
