"""Server settings: defaults, then a TOML config file, then the environment, then flags."""

from __future__ import annotations

import dataclasses
import functools
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry.errors import ConfigError
from server.codec import Limits

ADMIN_TOKEN_ENV = "PLUGSERVE_ADMIN_TOKEN"
ADMIN_TOKEN_FILE_ENV = "PLUGSERVE_ADMIN_TOKEN_FILE"
ETCD_PASSWORD_ENV = "PLUGSERVE_ETCD_PASSWORD"
_PROJECT_ROOT = Path(__file__).resolve().parent.parent


def bundled_dir(name: str) -> Path:
    """The bundled ``plugins/`` or ``models/`` of a source checkout, else ``./<name>``."""
    bundled = _PROJECT_ROOT / name
    return bundled if bundled.is_dir() else Path.cwd() / name


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
    log_format: str = "console"
    log_level: str = "info"
    drain_timeout_s: float = 30.0
    max_body_bytes: int = 64 * 1024 * 1024
    watch: bool = True
    reload_debounce_ms: int = 200
    event_loop: str = "auto"
    access_log: bool = False
    max_inputs: int = 64
    max_tensor_rank: int = 16
    max_tensor_elements: int = 1 << 26
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
    # Connections and bodies (server/connections.py, server/bodies.py).
    header_timeout_s: float = 10.0
    """A request's headers must be complete this long after the connection opened or the
    request's first byte arrived; else 408 and the connection is closed."""
    body_timeout_s: float = 60.0
    """A request's whole body must arrive within this long of its headers (else 408), and a
    client that reads nothing of its answer for this long is dropped."""
    max_connections: int | None = None
    """Open client connections per listener; more are answered 503 and closed. Default:
    the open-files limit less 256, at most 4096."""
    body_threads: int = 2
    """Threads that parse large request bodies and encode large responses."""
    max_large_bodies: int = 8
    """Large bodies (over 256 KiB, or compressed) parsed or waiting at once; more get 429."""

    @functools.cached_property
    def limits(self) -> Limits:
        return Limits(self.max_inputs, self.max_tensor_rank, self.max_tensor_elements)

    def __post_init__(self) -> None:
        if self.log_format not in ("console", "json"):
            raise ConfigError(f"log_format must be 'console' or 'json', not {self.log_format!r}")
        if min(self.max_inputs, self.max_tensor_rank, self.max_tensor_elements) < 1:
            raise ConfigError("max_inputs, max_tensor_rank and max_tensor_elements must be >= 1")
        if self.event_loop not in ("auto", "asyncio", "uvloop"):
            raise ConfigError(f"event_loop must be auto, asyncio or uvloop: {self.event_loop!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(
                f"log_level must be debug, info, warning or error: {self.log_level!r}"
            )
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0..65535, not {self.port}")
        if self.admin_port is not None and not 0 < self.admin_port <= 65535:
            raise ConfigError(f"admin_port must be 1..65535, not {self.admin_port}")
        if self.registry != "local" and not self.registry.startswith(("etcd://", "etcds://")):
            raise ConfigError(
                "registry must be 'local' or etcd://[user@]host:port/prefix "
                f"(etcds:// for TLS), not a {self.registry.partition(':')[0]!r} URL"
            )
        if self.fleet_lease_ttl_s < 2 or self.fleet_startup_wait_s < 0:
            raise ConfigError("fleet_lease_ttl_s must be >= 2 and fleet_startup_wait_s >= 0")
        self._check_connections()
        if self.max_body_bytes < 1 or self.drain_timeout_s < 0 or self.reload_debounce_ms < 0:
            raise ConfigError(
                "max_body_bytes must be >= 1, drain_timeout_s and reload_debounce_ms >= 0"
            )

    def _check_connections(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not 0 < value <= 86400:  # also refuses NaN
                raise ConfigError(f"{name} must be a number of seconds in (0, 86400], not {value}")
        if self.max_connections is not None and not 1 <= self.max_connections <= 1_000_000:
            raise ConfigError(f"max_connections must be 1..1000000, not {self.max_connections}")
        if not 1 <= self.body_threads <= 64 or not 1 <= self.max_large_bodies <= 10_000:
            raise ConfigError("body_threads must be 1..64 and max_large_bodies 1..10000")


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
_PATHS = {"plugins_dir", "models_dir", "admin_token_file", "runtime_routes_file"}


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
    if env.get(ADMIN_TOKEN_FILE_ENV):
        values["admin_token_file"] = env[ADMIN_TOKEN_FILE_ENV]
    if env.get(ADMIN_TOKEN_ENV):
        values["admin_token"] = env[ADMIN_TOKEN_ENV]
    if env.get(ETCD_PASSWORD_ENV):
        values["etcd_password"] = env[ETCD_PASSWORD_ENV]
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    for key in _PATHS & values.keys():
        values[key] = Path(values[key]).expanduser().resolve()
    if values.get("admin_token_file") and not values.get("admin_token"):
        values["admin_token"] = _read_token(Path(values["admin_token_file"]))
    try:
        return Settings(**values)
    except TypeError as exc:
        raise ConfigError(f"invalid settings: {exc}") from None


def _read_token(path: Path) -> str:
    """The admin token from a file (a mounted secret); its value is never logged."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"admin_token_file {path}: {exc.strerror}") from None
    if not token:
        raise ConfigError(f"admin_token_file {path} is empty")
    return token


def _read_config(path: Path) -> dict[str, Any]:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"{path}: unknown setting(s) {unknown}; known: {', '.join(_FIELDS)}")
    for key in _PATHS & raw.keys():
        raw[key] = path.parent / str(raw[key])
    for key, value in raw.items():
        expected = _expected_type(key)
        if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
            raise ConfigError(f"{path}: {key} must be {expected}, not {type(value).__name__}")
    return raw


def _expected_type(key: str) -> type | tuple[type, ...]:
    if key in _PATHS:
        return Path
    types: dict[str, type | tuple[type, ...]] = {
        "port": int,
        "max_body_bytes": int,
        "reload_debounce_ms": int,
        "admin_port": int,
        "max_inputs": int,
        "max_tensor_rank": int,
        "max_tensor_elements": int,
        "watch": bool,
        "access_log": bool,
        "drain_timeout_s": (int, float),
        "fleet_lease_ttl_s": int,
        "fleet_startup_wait_s": (int, float),
        # connections and bodies
        "header_timeout_s": (int, float),
        "body_timeout_s": (int, float),
        "max_connections": int,
        "body_threads": int,
        "max_large_bodies": int,
    }
    return types.get(key, str)
