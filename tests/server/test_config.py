from pathlib import Path

import pytest

from registry.errors import ConfigError
from server.config import ADMIN_TOKEN_ENV, Settings, load_settings


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


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prot = 1\n", "unknown setting"),
        ("port = 'x'\n", "port must be"),
        ("port = 70000\n", "port must be 0..65535"),
        ("log_format = 'xml'\n", "log_format"),
        ("port = \n", "plugserve.toml"),
        ("registry = 'redis://x:1'\n", "registry must be 'local' or etcd://"),
        ("fleet_lease_ttl_s = 1\n", "fleet_lease_ttl_s must be >= 2"),
        ("fleet_lease_ttl_s = 2.5\n", "fleet_lease_ttl_s must be"),
        ("load_timeout_s = 0\n", "load_timeout_s must be a number of seconds, > 0"),
        ("close_timeout_s = nan\n", "close_timeout_s must be a number of seconds"),
        ("close_timeout_s = inf\n", "close_timeout_s must be a number of seconds"),
        ("close_timeout_s = '10'\n", "close_timeout_s must be"),
    ],
)
def test_invalid_config_files(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "plugserve.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(config, environ={})


def test_token_is_not_in_the_repr() -> None:
    assert "hunter2" not in repr(Settings(admin_token="hunter2"))


def test_the_etcd_password_comes_from_the_environment_and_is_never_shown() -> None:
    from server.cli import _shown_registry

    settings = load_settings(
        None,
        {"registry": "etcd://svc@e1:2379,e2:2379/team"},
        {"PLUGSERVE_ETCD_PASSWORD": "hunter2"},
    )
    assert settings.etcd_password == "hunter2" and "hunter2" not in repr(settings)
    assert _shown_registry("etcds://svc:hunter2@e1:2379/team") == "etcds://svc@e1:2379/team"
    assert _shown_registry("local") == "local"
