import json
import tomllib
from pathlib import Path

import jsonschema
import pytest

from plugserve.registry.errors import ConfigError
from plugserve.server.config import ADMIN_TOKEN_ENV, Settings, load_settings, settings_schema
from tests.helpers import ROOT

SCHEMA = ROOT / "docs" / "schemas" / "settings.schema.json"


def test_defaults_serve_the_bundled_folders() -> None:
    settings = load_settings(environ={})
    assert settings.plugins_dir.name == "plugins"
    assert (settings.plugins_dir / "runner" / "iris").is_dir()
    assert (settings.host, settings.port, settings.admin_token) == ("127.0.0.1", 8000, None)


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    config = tmp_path / "conf" / "plugserve.toml"
    config.parent.mkdir()
    config.write_text(
        'port = 9000\nplugins_dir = "p"\nadmin_token = "from-file"\nlog_format = "json"\n'
    )
    settings = load_settings(config, environ={})
    assert settings.port == 9000
    assert settings.plugins_dir == (tmp_path / "conf" / "p").resolve()
    assert settings.admin_token == "from-file"
    settings = load_settings(config, {"port": 9100, "host": None}, environ={ADMIN_TOKEN_ENV: "env"})
    assert settings.port == 9100
    assert settings.host == "127.0.0.1"
    assert settings.admin_token == "env"


INVALID = [
    ("prot = 1\n", "unknown setting"),
    ("port = 'x'\n", 'port must be an integer, not a string \\("x"\\)'),
    ("watch = 1\n", "watch must be true or false, not an integer \\(1\\)"),
    ("plugins_dir = 3\n", "plugins_dir must be a path \\(a string\\), not an integer"),
    ("port = 70000\n", "port: must be an integer >= 0 and <= 65535"),
    ("log_format = 'xml'\n", "log_format"),
    ("port = \n", "plugserve.toml"),
    ("registry = 'redis://x:1'\n", "registry must be 'local' or etcd://"),
    ("fleet_lease_ttl_s = 1\n", "fleet_lease_ttl_s: must be an integer >= 2"),
    ("fleet_lease_ttl_s = 2.5\n", "fleet_lease_ttl_s must be an integer, not a number"),
    ("load_timeout_s = 0\n", "load_timeout_s: must be a finite number > 0"),
    ("close_timeout_s = nan\n", "close_timeout_s: must be a finite number"),
    ("close_timeout_s = inf\n", "close_timeout_s: must be a finite number"),
    ("close_timeout_s = '10'\n", "close_timeout_s must be a number, not a string"),
    ("grpc_port = 70000\n", "grpc_port: must be an integer >= 0 and <= 65535"),
    ("grpc_port = 8000\n", "grpc_port 8000 is also port"),
    ("admin_port = 8001\n", "grpc_port 8001 is also admin_port"),
    ("grpc_idle_timeout_s = 0\n", "grpc_idle_timeout_s: must be a finite number > 0"),
    ("grpc_idle_timeout_s = 1e6\n", "grpc_idle_timeout_s: must be a finite number"),
    ("grpc_idle_timeout_s = '75'\n", "grpc_idle_timeout_s must be a number, not a string"),
    ("workers = 0\n", "workers: must be an integer >= 1 and <= 1024, not 0"),
    ("workers = 2.5\n", "workers must be an integer or 'auto', not a number"),
    ("max_connections = 0\n", "max_connections: must be an integer >= 1"),
    ("memory_budget = 'lots'\n", "memory_budget 'lots' is not bytes"),
    ("memory_budget = true\n", "memory_budget must be an integer or a string"),
    ("admin_token = ''\n", "admin_token is set but empty"),
]
"""Config files the server refuses, and what it says."""
BEYOND_SCHEMA = {
    "port = \n",
    "grpc_port = 8000\n",
    "admin_port = 8001\n",
    "close_timeout_s = nan\n",
}
"""What a JSON Schema cannot say: TOML syntax, two settings together, NaN (JSON has none)."""


@pytest.mark.parametrize(("text", "message"), INVALID)
def test_invalid_config_files(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "plugserve.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(config, environ={})


def test_token_is_not_in_the_repr() -> None:
    assert "hunter2" not in repr(Settings(admin_token="hunter2"))


def test_the_etcd_password_comes_from_the_environment_and_is_never_shown() -> None:
    from plugserve.server.cli import _shown_registry

    settings = load_settings(
        None,
        {"registry": "etcd://svc@e1:2379,e2:2379/team"},
        {"PLUGSERVE_ETCD_PASSWORD": "hunter2"},
    )
    assert settings.etcd_password == "hunter2" and "hunter2" not in repr(settings)
    assert _shown_registry("etcds://svc:hunter2@e1:2379/team") == "etcds://svc@e1:2379/team"
    assert _shown_registry("local") == "local"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"drain_timeout_s = inf\n", "drain_timeout_s: must be a finite number"),
        (b"drain_timeout_s = nan\n", "drain_timeout_s: must be a finite number"),
        (b"drain_timeout_s = 1e999\n", "drain_timeout_s: must be a finite number"),
        (b"drain_timeout_s = 1e300\n", "<= 86400"),
        (b"fleet_startup_wait_s = -inf\n", "fleet_startup_wait_s"),
        (b"max_body_bytes = 9223372036854775807\n", "max_body_bytes: must be an integer"),
        (b"reload_debounce_ms = 99999999999\n", "reload_debounce_ms"),
        (b"max_tensor_rank = 100000\n", "max_tensor_rank"),
        (b"plugins_dir = 5\n", "plugins_dir must be a path"),
        (b'plugins_dir = "a\\u0000b"\n', "control characters"),
        (b'host = "127.0.0.1\\n"\n', "host: must not hold control characters"),
        (b'host = "\\ud7fc"\n', "host must be printable text"),  # unassigned
        (b'replica_id = "a\\u202eb"\n', "replica_id must be printable text"),  # bidi override
        (b"port = " + b"[" * 500 + b"]" * 500 + b"\n", "deeper than"),
        (b'host = "\xff"\n', "not UTF-8"),
    ],
)
def test_hostile_config_values_are_config_errors(tmp_path: Path, data: bytes, message: str) -> None:
    """issue 12, finding 1: non-finite, huge and negative numbers, control characters, deep
    nesting and bad bytes in the config file are a ConfigError naming the setting."""
    config = tmp_path / "plugserve.toml"
    config.write_bytes(data)
    with pytest.raises(ConfigError, match=message):
        load_settings(config, environ={})


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0, 10**20])
def test_settings_refuse_non_finite_and_out_of_bound_numbers(value: float) -> None:
    with pytest.raises(ConfigError, match="drain_timeout_s"):
        Settings(drain_timeout_s=value)


def test_a_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_settings(tmp_path / "absent.toml", environ={})


@pytest.mark.parametrize(("value", "ok"), [(0, True), (1 << 30, True), (-1, False), (2**41, False)])
def test_response_cache_bytes_bounds(value: int, ok: bool) -> None:
    if ok:
        assert Settings(response_cache_bytes=value).response_cache_bytes == value
    else:
        with pytest.raises(ConfigError, match="response_cache_bytes"):
            Settings(response_cache_bytes=value)
    assert Settings().response_cache_bytes == 64 * 1024 * 1024


def test_inline_runners_is_auto_on_or_off() -> None:
    with pytest.raises(ConfigError, match="inline_runners must be auto, on or off"):
        Settings(inline_runners="sometimes")


def test_runners_run_on_the_loop_when_asked_or_when_every_core_has_a_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import plugserve.server.config as config

    monkeypatch.setattr(config, "usable_cores", lambda: 4)
    assert not Settings(workers=1).runners_on_loop  # one worker: its runners on threads
    assert Settings().runners_on_loop  # auto: a worker per core
    assert not Settings(workers=2).runners_on_loop  # cores to spare: threads use them
    assert Settings(workers=4).runners_on_loop
    assert Settings(workers="auto").runners_on_loop
    assert not Settings(workers=4, inline_runners="off").runners_on_loop
    assert Settings(inline_runners="on").runners_on_loop
    monkeypatch.setattr(config, "usable_cores", lambda: 1)
    assert not Settings(workers="auto").runners_on_loop  # one core, one worker


@pytest.mark.parametrize("key", ["worker_stall_timeout_s", "runner_stall_timeout_s"])
@pytest.mark.parametrize("value", [0.001, 0.5, -1, float("nan"), float("inf"), 1e999, 10**6])
def test_a_stall_timeout_is_off_or_a_second_at_least(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=key):
        Settings(**{key: value})
    assert getattr(Settings(**{key: 0}), key) == 0
    assert getattr(Settings(**{key: 1}), key) == 1


@pytest.mark.parametrize(("value", "ok"), [(1, True), (1 << 30, True), (0, False), (2**41, False)])
def test_max_json_bytes_bounds(tmp_path: Path, value: int, ok: bool) -> None:
    config = tmp_path / "plugserve.toml"
    config.write_text(f"max_json_bytes = {value}\n")
    if ok:
        assert load_settings(config, environ={}).max_json_bytes == value
    else:
        with pytest.raises(ConfigError, match="max_json_bytes"):
            load_settings(config, environ={})
    assert Settings().max_json_bytes == 16 * 1024 * 1024
    config.write_text('max_json_bytes = "big"\n')
    with pytest.raises(ConfigError, match="max_json_bytes"):
        load_settings(config, environ={})


@pytest.mark.parametrize("text", ["1_0", "\u0662", " 2 ", "+2", "2.0", "0x2"])
def test_workers_from_the_command_line_are_ascii_digits(text: str) -> None:
    """int() takes "1_0" (10 workers) and other scripts' digits; a count is written plainly."""
    with pytest.raises(ConfigError, match="workers must be a number or 'auto'"):
        Settings(workers=text)
    assert Settings(workers="3").workers == 3


def test_the_published_settings_schema_is_the_declared_one() -> None:
    """docs/schemas/settings.schema.json is what ``python -m plugserve.server.config``
    prints: regenerate it when a setting changes."""
    assert json.loads(SCHEMA.read_text()) == settings_schema()


def test_the_settings_schema_takes_the_bundled_settings_files() -> None:
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    bundled = [ROOT / "deploy" / "systemd" / "plugserve.toml"]
    for path in bundled:
        assert not list(validator.iter_errors(tomllib.loads(path.read_text()))), path
    assert validator.is_valid(
        {"workers": "auto", "memory_budget": "60%", "registry": "etcd://e:2379/p"}
    )


@pytest.mark.parametrize(("text", "message"), [c for c in INVALID if c[0] not in BEYOND_SCHEMA])
def test_the_settings_schema_refuses_what_the_server_refuses(text: str, message: str) -> None:
    """An editor validating against the published schema flags what the server refuses."""
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    assert not validator.is_valid(tomllib.loads(text)), text
