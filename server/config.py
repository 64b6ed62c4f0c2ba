"""Server settings: each declared once in :class:`Settings` (its type, default, bounds and
what it does), read from the defaults, then a TOML config file, then the environment, then
the command line's flags (``cli.py`` makes a flag of each setting :data:`FLAGS` names).
``python -m plugserve.server.config`` prints the settings file's JSON Schema."""

from __future__ import annotations

import functools
import json
import os
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from plugserve.registry import checks
from plugserve.registry.errors import ConfigError
from plugserve.registry.lifecycle.budget import parse_budget, parse_gpu_budget
from plugserve.server.runtime.cores import usable_cores

ADMIN_TOKEN_ENV = "PLUGSERVE_ADMIN_TOKEN"
ADMIN_TOKEN_FILE_ENV = "PLUGSERVE_ADMIN_TOKEN_FILE"
INFERENCE_TOKEN_ENV = "PLUGSERVE_INFERENCE_TOKEN"
INFERENCE_TOKEN_FILE_ENV = "PLUGSERVE_INFERENCE_TOKEN_FILE"
TOKENS = ("admin_token", "inference_token")
"""Each token setting has a ``<name>_file`` twin and the env vars ``PLUGSERVE_<NAME>[_FILE]``."""
MAX_TOKEN_FILE_BYTES = 64 * 1024
"""A token file larger than this is refused (it is a secret, not a document)."""
ETCD_PASSWORD_ENV = "PLUGSERVE_ETCD_PASSWORD"
_PROJECT_ROOT = Path(__file__).resolve().parent.parent
MIN_STALL_TIMEOUT_S = 1.0
"""The shortest stall check there is (0 turns it off): a loop busy with one large batch or a
collection must not read as stuck."""
DAY_S = 86_400


def bundled_dir(name: str) -> Path:
    """The bundled ``plugins/`` or ``models/`` of a source checkout, else ``./<name>``."""
    bundled = _PROJECT_ROOT / name
    return bundled if bundled.is_dir() else Path.cwd() / name


class SettingsError(ConfigError):
    """Settings that are not valid, each problem naming its setting."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; nothing is allocated before these are checked."""

    max_inputs: int = 64
    max_rank: int = 16
    max_elements: int = 1 << 26
    max_bytes_elements: int = 1 << 20


PathSetting = Annotated[Path, Field(strict=False)]
"""A path: from a file, relative to it; made absolute, symlinks kept (the watcher follows a
folder's symlink swap)."""
Seconds = Annotated[float, Field(allow_inf_nan=False)]
Timeout = Annotated[float, Field(gt=0, le=DAY_S, allow_inf_nan=False)]
"""A timeout: more than 0 (a zero timeout means nothing), at most a day."""
Port = Annotated[int, Field(ge=0, le=65535)]
Count = Annotated[int, Field(ge=1, le=1_000_000)]
Bytes = Annotated[int, Field(ge=1, le=2**40)]
Budget = Annotated[
    Annotated[int, Field(ge=0)]
    | Annotated[
        str,
        Field(
            json_schema_extra={"pattern": r"^\s*\d+(\.\d+)?\s*(%|[KMGTkmgt][iI]?[bB]?|[bB])?\s*$"}
        ),
    ],
    Field(union_mode="left_to_right"),
]
"""Bytes (an integer), a size (``"4GiB"``) or a share (``"60%"``)."""
Token = Annotated[str, Field(json_schema_extra={"minLength": 1})]
"""A secret: never shown, never empty."""


class Settings(BaseModel):
    """Everything the server is configured with. Paths are absolute."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        strict=True,
        title="plugserve settings",
    )

    host: str = "127.0.0.1"
    """The address the data plane listens on."""
    port: Port = 8000
    """The data plane's HTTP port."""
    plugins_dir: PathSetting = Field(default_factory=lambda: bundled_dir("plugins"))
    """The plugins folder (``<type>/<name>/<version>/``); default: the bundled ``plugins/``."""
    models_dir: PathSetting = Field(default_factory=lambda: bundled_dir("models"))
    """The models folder plugins name their model files in; default: the bundled ``models/``."""
    admin_token: Token | None = Field(default=None, repr=False)
    """The bearer token of ``/admin/`` (and of every data-plane call); unset: the admin
    endpoints answer loopback clients only."""
    admin_token_file: PathSetting | None = None
    """A file holding ``admin_token`` (a mounted secret)."""
    admin_host: str | None = None
    """With ``admin_port``: the address the admin endpoints listen on; default: ``host``."""
    admin_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    """A port of their own for ``/admin/`` (then not served on the data port)."""
    grpc_port: Port = 8001
    """The KServe v2 gRPC service's port (on ``host``); 0 turns it off."""
    log_format: Literal["console", "json"] = "console"
    """Logs for a person (``console``) or one JSON object a line (``json``)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """The least severe log events written."""
    drain_timeout_s: Annotated[Seconds, Field(ge=0, le=DAY_S)] = 30.0
    """At shutdown, how long requests in flight may take to finish."""
    load_timeout_s: Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)] = 120.0
    """The bound on a version's import, create and warmup, and on each startup hook."""
    close_timeout_s: Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)] = 10.0
    """The bound on a component's ``close()`` and on the shutdown hooks."""
    max_body_bytes: Bytes = 64 * 1024 * 1024
    """A request body is at most this long, else 413."""
    max_json_bytes: Bytes = 16 * 1024 * 1024
    """The JSON of a request (a JSON body, or the JSON header of a body with binary tensor
    data) is at most this long, else 413: a JSON parse holds the interpreter for its whole
    length, so other requests wait on it; large tensors travel as binary data."""
    watch: bool = True
    """Watch the plugins and models folders and reload what changes."""
    reload_debounce_ms: Annotated[int, Field(ge=0, le=3_600_000)] = 200
    """How long changes to a folder must settle before it is reloaded."""
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    """The event loop: ``uvloop`` where installed (``auto``) or asyncio's own."""
    access_log: bool = False
    """Log every request."""
    fast_path: bool = True
    """Whether plain HTTP/1.1 v2 infer requests take the fast path (``server/http/fastpath.py``)
    on the data port; off (or with an inference token set), every request is aiohttp's."""
    memory_budget: Budget = 0
    """What the runner versions loaded on demand may hold resident, in bytes, a size
    (``"4GiB"``) or a share of the machine or cgroup (``"60%"``); 0: no budget."""
    gpu_memory_budget: Budget = 0
    """What the runner versions loaded on demand may hold on each GPU: bytes, a size
    (``"20GiB"``) or a share of each GPU's memory (``"80%"``); 0: no GPU budget."""
    strict_readiness: bool = True
    """At start-up, ready (``/v2/health/ready``) only once every route can serve; a route
    that cannot keeps the server unready and is named in the answer. Off, the server is
    ready without the routes that failed (a partial start). Once the server has been
    ready, a route that fails is reported there and never takes readiness away."""
    default_load: Literal["eager", "on_demand"] = "eager"
    """When a runner version that does not say (``[runner] load``) loads: ``eager`` (at
    start and on every change) or ``on_demand`` (on its first request)."""
    grpc_engine: Literal["native", "grpcio"] = "native"
    """What serves gRPC: ``native`` (HTTP/2 read on the event loop's thread) or ``grpcio``
    (grpc.aio, gRPC's C core)."""
    max_inputs: Count = 64
    """Inputs (and requested outputs) one request may name."""
    max_tensor_rank: Annotated[int, Field(ge=1, le=64)] = 16
    """Dimensions one tensor may have."""
    max_tensor_elements: Bytes = 1 << 26
    """Elements one tensor may have."""
    max_bytes_elements: Bytes = 1 << 20
    """Elements per BYTES tensor: each one is a Python object, built and checked one by one."""
    registry: Annotated[str, Field(json_schema_extra={"pattern": "^(local|etcds?://.+)$"})] = (
        "local"
    )
    """Where runtime routes live: ``local`` (this process) or ``etcd://host:port/prefix``
    (``etcds://`` for TLS)."""
    etcd_password: str | None = Field(default=None, repr=False)
    """Fleet mode with etcd authentication: the password of the URL's user."""
    runtime_routes_file: PathSetting | None = None
    """Local mode: where runtime route changes are saved, to survive restarts."""
    replica_id: str | None = None
    """This replica's name in the fleet; default ``<hostname>:<port>``."""
    fleet_lease_ttl_s: Annotated[int, Field(ge=2, le=DAY_S)] = 10
    """A fleet replica's etcd lease: a replica silent this long leaves the fleet."""
    fleet_startup_wait_s: Annotated[Seconds, Field(ge=0, le=3600)] = 5.0
    """How long a replica waits for etcd at start before serving its local routes."""
    rollout_interval_s: Annotated[Seconds, Field(ge=0.05, le=3600)] = 1.0
    """How often a rollout's figures are looked at (and, in fleet mode, published)."""
    header_timeout_s: Timeout = 10.0
    """A request's headers must be complete this long after the connection opened or the
    request's first byte arrived; else 408 and the connection is closed."""
    body_timeout_s: Timeout = 60.0
    """A request's whole body must arrive within this long of its headers (else 408), and a
    client that reads nothing of its answer for this long is dropped."""
    max_connections: Count | None = None
    """Open client connections per listener; more are answered 503 and closed. Default:
    the open-files limit less 256, at most 4096. It bounds gRPC's open calls too (health
    and readiness apart): more are refused ``RESOURCE_EXHAUSTED``."""
    grpc_idle_timeout_s: Timeout = 75.0
    """A gRPC stream (``ModelStreamInfer``) with no request in flight that sends none for
    this long is ended, and a gRPC connection with no call open is closed."""
    body_threads: Annotated[int, Field(ge=1, le=64)] = 2
    """Threads that parse large request bodies and encode large responses."""
    max_large_bodies: Annotated[int, Field(ge=1, le=10_000)] = 8
    """Large bodies (over 256 KiB, or compressed) parsed or waiting at once; more get 429.
    gRPC's large or compressed request messages have as many places of their own (more are
    refused ``RESOURCE_EXHAUSTED``)."""
    request_bytes_budget: Annotated[int, Field(ge=0, le=2**44)] = 0
    """Bytes of requests a process holds while they arrive, and that compressed ones inflate
    to, HTTP's large bodies and gRPC's messages together (``server/http/budget.py``); each
    protocol at most three quarters of it. Past it a request is refused: HTTP 503, gRPC
    ``RESOURCE_EXHAUSTED``. 0: eight times ``max_body_bytes``."""
    inference_token: Token | None = Field(default=None, repr=False)
    """With a value, every data-plane call but health and ``/metrics`` needs it (or the
    admin token) as ``Authorization: Bearer <token>``."""
    inference_token_file: PathSetting | None = None
    """A file holding ``inference_token`` (a mounted secret)."""
    response_cache_bytes: Annotated[int, Field(ge=0, le=2**40)] = 64 * 1024 * 1024
    """The response cache's bound, per worker process: whole responses of the routes whose
    runner sets ``[runner] response_cache = true``; 0 turns it off."""
    shared_memory: Literal["loopback", "any", "off"] = "loopback"
    """Who may use Triton's system shared memory extension: ``loopback`` (clients on this
    host), ``any`` (every caller the data plane admits) or ``off``."""
    workers: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] = Field(
        default="auto", union_mode="left_to_right"
    )
    """HTTP worker processes sharing the port: a number, or ``auto`` (the default: one per
    usable core). With more than one, a supervisor process runs them."""
    worker_stall_timeout_s: Annotated[Seconds, Field(ge=0, le=DAY_S)] = 30.0
    """With several workers: one whose event loop has not answered the supervisor for this
    long is killed and replaced (plugin code stuck on its loop); 0 turns the check off, else
    at least 1 s."""
    runner_stall_timeout_s: Annotated[Seconds, Field(ge=0, le=DAY_S)] = 60.0
    """An isolated runner's process whose event loop has not answered for this long (a
    batch stuck in the plugin's code: its sync runner runs on that loop) is killed: its
    requests are answered 500 saying so, and it is started again. 0 turns the check off,
    else at least 1 s."""
    inline_runners: Literal["auto", "on", "off"] = "auto"
    """Where a worker runs its in-worker runners' batches: ``on`` its event loop (within a
    few ms a batch), ``off`` on a thread each, or ``auto``: on the loop when every usable
    core has a worker of its own (``workers`` > 1 and at least one per core), where a thread
    only adds hand-offs."""

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except pydantic.ValidationError as exc:
            raise SettingsError(checks.schema_problems(exc, type(self))) from None

    @field_validator("*", mode="before")
    @classmethod
    def _text(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        """Every text setting short, printable and free of control characters; a token (or
        token file) without surrounding whitespace, and never empty."""
        name = info.field_name or ""
        if not isinstance(value, str):
            return value
        if name in TOKENS:  # a secret, compared byte for byte: any bytes the environment holds
            return _token_text(value, name)
        if name.removesuffix("_file") in TOKENS:
            value = _token_text(value, name)
        _printable(value, name)
        if name == "workers" and value != "auto":
            if not (value.isascii() and value.isdigit() and len(value) <= 9):
                raise ValueError(f"workers must be a number or 'auto', not {value!r}")
            return int(value)  # from the command line: ASCII digits, as a number is written
        return value

    @field_validator("memory_budget", "gpu_memory_budget")
    @classmethod
    def _budget(cls, value: int | str, info: pydantic.ValidationInfo) -> int | str:
        (parse_budget if info.field_name == "memory_budget" else parse_gpu_budget)(value)
        return value

    @field_validator("registry")
    @classmethod
    def _registry(cls, value: str) -> str:
        if value != "local" and not value.startswith(("etcd://", "etcds://")):
            raise ValueError(
                "registry must be 'local' or etcd://[user@]host:port/prefix "
                f"(etcds:// for TLS), not a {value.partition(':')[0]!r} URL"
            )
        return value

    @model_validator(mode="after")
    def _together(self) -> Settings:
        """What no one setting says alone: distinct ports and tokens, stall checks long
        enough to tell a busy loop from a stuck one."""
        if self.grpc_port and self.grpc_port in (self.port, self.admin_port):
            which = "port" if self.grpc_port == self.port else "admin_port"
            raise ValueError(
                f"grpc_port {self.grpc_port} is also {which}: give gRPC a port of its own "
                "(or grpc_port = 0 to turn it off)"
            )
        for key, whose in (("worker", "workers"), ("runner", "runner processes")):
            value = getattr(self, f"{key}_stall_timeout_s")
            if 0 < value < MIN_STALL_TIMEOUT_S:
                raise ValueError(
                    f"{key}_stall_timeout_s must be 0 (off) or at least "
                    f"{MIN_STALL_TIMEOUT_S:g} s, not {value!r}: a shorter one would kill busy "
                    f"{whose}"
                )
        if self.inference_token is not None and self.inference_token == self.admin_token:
            raise ValueError("inference_token must differ from admin_token")
        return self

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
            max_inputs=self.max_inputs,
            max_rank=self.max_tensor_rank,
            max_elements=self.max_tensor_elements,
            max_bytes_elements=self.max_bytes_elements,
        )

    @property
    def memory_budget_bytes(self) -> int:
        """``memory_budget`` in bytes (0: none)."""
        return parse_budget(self.memory_budget)

    @property
    def gpu_memory_budget_value(self) -> int | float:
        """``gpu_memory_budget``: bytes, or a share of each GPU (a float); 0: none."""
        return parse_gpu_budget(self.gpu_memory_budget)


FLAGS = (
    "plugins_dir",
    "models_dir",
    "host",
    "port",
    "grpc_port",
    "memory_budget",
    "gpu_memory_budget",
    "default_load",
    "strict_readiness",
    "grpc_engine",
    "workers",
    "inline_runners",
    "log_format",
    "log_level",
    "registry",
    "replica_id",
    "runtime_routes_file",
)
"""The settings ``plugserve serve`` takes as flags (``--plugins-dir`` ...); every setting
is a key of the config file."""
_PATHS = frozenset(
    name
    for name, field in Settings.model_fields.items()
    if Path in (field.annotation, *(checks.bare(a) for a in typing.get_args(field.annotation)))
)
"""The path settings: made absolute, a file's relative to the file."""


def settings_schema() -> dict[str, Any]:
    """The JSON Schema of the settings file (``plugserve.toml``)."""
    checks.with_docstrings(Settings)
    schema = Settings.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["description"] = "plugserve's settings file (`plugserve serve --config plugserve.toml`)"
    for field in schema["properties"].values():
        if field.get("format") == "path":
            field.pop("format")
        field.pop("title", None)
    return schema


def load_settings(
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Merge the config file (relative paths are relative to it), the environment and flags.

    ``overrides`` holds command-line values; ``None`` values are ignored. A problem with a
    value the file gave is named with the file.
    """
    values: dict[str, Any] = {}
    if config_file is not None:
        values.update(_read_config(config_file))
    from_file = set(values)
    env = os.environ if environ is None else environ
    from_env = _tokens_from_env(env)
    for name in TOKENS:  # the environment wins over the file, its token file included
        if f"{name}_file" in from_env and name not in from_env:
            values.pop(name, None)
    values.update(from_env)
    if env.get(ETCD_PASSWORD_ENV):
        values["etcd_password"] = env[ETCD_PASSWORD_ENV]
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    from_file -= set(from_env) | {k for k, v in (overrides or {}).items() if v is not None}
    for key in _PATHS & values.keys():
        # Absolute, but symlinks kept: the watcher follows a folder's symlink swap.
        if isinstance(values[key], str | Path):
            try:
                values[key] = Path(os.path.abspath(Path(values[key]).expanduser()))
            except (OSError, ValueError, RuntimeError) as exc:
                raise ConfigError(f"{key}: {exc}") from None
    for name in TOKENS:
        if values.get(f"{name}_file") and values.get(name) is None:
            values[name] = _read_token(name, Path(values[f"{name}_file"]))
    try:
        return Settings(**values)
    except SettingsError as exc:
        named = [f"{config_file}: {p}" if _names(p, from_file) else p for p in exc.problems]
        raise SettingsError(named) from None


def _names(problem: str, keys: set[str]) -> bool:
    """Whether ``problem`` is about one of ``keys`` (its message starts with the key)."""
    return any(problem.startswith((f"{key} ", f"{key}:")) for key in keys)


def _printable(value: str, name: str) -> None:
    """Short text without control, format, unassigned or private-use characters."""
    try:
        checks.text(value, name)
    except checks.ValueProblem as exc:
        raise ConfigError(str(exc)) from None
    hidden = next((c for c in value if not c.isprintable()), None)
    if hidden is not None:
        raise ConfigError(f"{name} must be printable text, not hold {hidden!r}")


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
    """The settings of a TOML file, its relative paths made relative to it; raises
    :class:`ConfigError` for a file that cannot be read or names an unknown setting (the
    values are checked with the others, by :class:`Settings`)."""
    try:
        raw = checks.read_toml(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except checks.ValueProblem as exc:
        raise ConfigError(f"{path}: {exc}") from None
    unknown = sorted(set(raw) - set(Settings.model_fields))
    if unknown:
        known = ", ".join(Settings.model_fields)
        raise ConfigError(f"{path}: unknown setting(s) {unknown}; known: {known}")
    for key in TOKENS + tuple(f"{name}_file" for name in TOKENS):
        if isinstance(raw.get(key), str):
            raw[key] = _token_text(raw[key], f"{path}: {key}")
    for key in TOKENS:  # in a file, printable text as every other value
        if isinstance(raw.get(key), str):
            _printable(raw[key], f"{path}: {key}")
    for key in _PATHS & raw.keys():
        if isinstance(raw[key], str):
            try:
                raw[key] = path.parent / checks.text(raw[key], key)
            except checks.ValueProblem as exc:
                raise ConfigError(f"{path}: {exc}") from None
    return raw


if __name__ == "__main__":
    json.dump(settings_schema(), sys.stdout, indent=2)
    sys.stdout.write("\n")
