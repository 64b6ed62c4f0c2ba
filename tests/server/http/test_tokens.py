"""Token settings: every way to set the admin and inference tokens, and every way to get it wrong."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plugserve.registry.errors import ConfigError
from plugserve.server.config import Settings, load_settings
from tests.helpers import ROOT

TOKENS = ("admin_token", "inference_token")


def env_var(key: str) -> str:
    return f"PLUGSERVE_{key.upper()}"


@pytest.mark.parametrize("name", TOKENS)
@pytest.mark.parametrize("value", ["", " ", "\t\n"])
def test_an_empty_token_in_the_config_file_is_refused(
    tmp_path: Path, name: str, value: str
) -> None:
    """issue 12, finding 7: ``admin_token = ""`` opened the admin API to the network."""
    config = tmp_path / "plugserve.toml"
    config.write_text(f"{name} = {json.dumps(value)}\n")  # a TOML basic string
    with pytest.raises(ConfigError, match=f"{name} is set but empty"):
        load_settings(config, environ={})


@pytest.mark.parametrize("key", [*TOKENS, *(f"{name}_file" for name in TOKENS)])
@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_token_environment_variable_is_refused(key: str, value: str) -> None:
    """issue 12, finding 7 (the class): set but empty is an error, never "no token"."""
    with pytest.raises(ConfigError, match=env_var(key)):
        load_settings(None, environ={env_var(key): value})


@pytest.mark.parametrize("name", TOKENS)
def test_an_empty_token_file_path_in_the_config_file_is_refused(tmp_path: Path, name: str) -> None:
    """issue 12, finding 7 (the class): ``<token>_file = ""`` named the config's own folder."""
    config = tmp_path / "plugserve.toml"
    config.write_text(f'{name}_file = ""\n')
    with pytest.raises(ConfigError, match=f"{name}_file is set but empty"):
        load_settings(config, environ={})


@pytest.mark.parametrize("name", TOKENS)
@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "empty"),
        (b" \n\n", "empty"),
        (b"\xff\xfe", "not UTF-8"),
        (None, "No such file"),
        (b"x" * (64 * 1024 + 1), "larger than 65536 bytes"),
    ],
)
def test_a_token_file_must_hold_a_token(
    tmp_path: Path, name: str, content: bytes | None, reason: str
) -> None:
    """issue 12, finding 7 (the class): an empty, unreadable or missing token file stops start."""
    secret = tmp_path / "secret"
    if content is not None:
        secret.write_bytes(content)
    for environ, config_text in (
        ({env_var(f"{name}_file"): str(secret)}, None),
        ({}, f'{name}_file = "{secret}"\n'),
    ):
        config = None
        if config_text is not None:
            config = tmp_path / "plugserve.toml"
            config.write_text(config_text)
        with pytest.raises(ConfigError, match=reason):
            load_settings(config, environ=environ)


def test_a_token_file_that_never_ends_is_refused(tmp_path: Path) -> None:
    """Attack round after issue 12: ``admin_token_file = "/dev/zero"`` was read to the end."""
    config = tmp_path / "plugserve.toml"
    config.write_text('admin_token_file = "/dev/zero"\n')
    with pytest.raises(ConfigError, match="larger than"):
        load_settings(config, environ={})


def test_a_directly_built_settings_refuses_an_empty_token() -> None:
    """issue 12, finding 7: the last guard, whatever built the settings."""
    for name in TOKENS:
        with pytest.raises(ConfigError, match="empty"):
            Settings(**{name: "  "})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", TOKENS)
def test_tokens_from_each_source_with_the_environment_winning(tmp_path: Path, name: str) -> None:
    secret = tmp_path / "secret"
    secret.write_text(" from-file\n")
    config = tmp_path / "plugserve.toml"
    config.write_text(f'{name} = " from-config "\n')
    assert getattr(load_settings(config, environ={}), name) == "from-config"
    env = {env_var(name): "from-env\n"}
    assert getattr(load_settings(config, environ=env), name) == "from-env"
    # A token file from the environment wins over a token in the config file.
    env = {env_var(f"{name}_file"): str(secret)}
    assert getattr(load_settings(config, environ=env), name) == "from-file"
    config.write_text(f'{name}_file = "secret"\n')  # relative to the config file
    assert getattr(load_settings(config, environ={}), name) == "from-file"


def test_the_inference_token_must_differ_from_the_admin_token() -> None:
    with pytest.raises(ConfigError, match="differ"):
        load_settings(
            None, environ={"PLUGSERVE_ADMIN_TOKEN": "same", "PLUGSERVE_INFERENCE_TOKEN": "same"}
        )


def test_tokens_are_not_in_the_repr() -> None:
    assert "tok-" not in repr(Settings(admin_token="tok-a", inference_token="tok-i"))


@pytest.mark.parametrize(
    ("config_text", "env", "message"),
    [
        ('admin_token = ""\n', {}, "admin_token is set but empty"),
        ('inference_token = "  "\n', {}, "inference_token is set but empty"),
        ("", {"PLUGSERVE_INFERENCE_TOKEN": ""}, "PLUGSERVE_INFERENCE_TOKEN is set but empty"),
        ("", {"PLUGSERVE_INFERENCE_TOKEN_FILE": "/nonexistent/t"}, "inference_token_file"),
    ],
)
def test_a_bad_token_setting_stops_the_server_with_exit_2(
    tmp_path: Path, config_text: str, env: dict[str, str], message: str
) -> None:
    """issue 12, finding 7: a clear message and exit 2 before anything listens."""
    config = tmp_path / "plugserve.toml"
    config.write_text(config_text)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PLUGSERVE_")}
    result = subprocess.run(
        [sys.executable, "-m", "plugserve", "serve", "--config", str(config), "--port", "1"],
        cwd=ROOT,
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
