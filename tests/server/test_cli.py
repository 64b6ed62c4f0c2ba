"""The command line: serving the bundled example with no flags, validate, logs."""

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import ROOT, ServerProcess, write_add_runner, write_plugin

pytestmark = pytest.mark.slow


def plugserve(
    *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "plugserve", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_serve_without_flags_serves_the_bundled_iris_chain(
    server: Callable[..., ServerProcess],
) -> None:
    srv = server()
    # The README's curl call.
    status, _, body = srv.request(
        "POST", "/predict/iris", {"input": [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]}
    )
    assert status == 200
    doc = json.loads(body)
    assert doc["label"] == ["setosa", "virginica"]
    assert len(doc["probabilities"]) == 2
    assert all(abs(sum(row) - 1) < 1e-5 for row in doc["probabilities"])
    status, _, body = srv.request(
        "POST",
        "/v2/models/iris/infer",
        {
            "inputs": [
                {"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [5.9, 3.0, 4.2, 1.5]}
            ]
        },
    )
    assert status == 200
    outputs = {o["name"]: o for o in json.loads(body)["outputs"]}
    assert outputs["label"]["data"] == ["versicolor"]


def test_validate_accepts_the_bundled_plugins() -> None:
    for folder in ("runner/iris/1.0.0", "preprocessor/scale/1.0.0", "postprocessor/label/1.0.0"):
        result = plugserve("validate", str(ROOT / "plugins" / folder), "--json")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["valid"] is True
    iris = str(ROOT / "plugins/runner/iris/1.0.0")
    report = json.loads(plugserve("validate", iris, "--json").stdout)
    assert report["route"] == "iris"
    assert report["metadata"]["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]


def test_validate_loads_an_isolated_runner_in_its_process_and_leaves_nothing(
    plugins_dir: Path, tmp_path: Path
) -> None:
    """Attack round on issue 14: each validate of one left an empty runners folder."""
    folder = write_add_runner(plugins_dir, "iso", "1.0.0", runner='isolation = "process"')
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = plugserve(
        "validate", str(folder), "--models-dir", str(tmp_path), "--json",
        env={"TMPDIR": str(scratch)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["valid"] is True
    assert report["metadata"]["inputs"][0]["name"] == "x"
    assert list(scratch.glob("plugserve-*")) == []


def test_validate_reports_a_broken_plugin(plugins_dir: Path) -> None:
    folder = write_plugin(
        plugins_dir, "preprocessor", "bad", "1.0.0", files={"plugin.py": "import not_a_module_xyz"}
    )
    result = plugserve("validate", str(folder), "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["valid"] is False and report["outcome"] == "invalid"
    assert "ModuleNotFoundError" in report["problems"][0]
    assert "preprocessor/bad@1.0.0" in report["problems"][0]


def test_validate_exits_when_the_plugin_left_a_thread_running(plugins_dir: Path) -> None:
    """issue 12, finding 6, for validate: a non-daemon thread a plugin starts kept the
    command from exiting."""
    source = """
        import threading, time
        import pluggy
        hookimpl = pluggy.HookimplMarker("plugserve")

        class Pre:
            def process(self, data, ctx):
                return data

        def spin():
            while True:
                time.sleep(0.1)

        @hookimpl
        def plugserve_create_component(plugin, config):
            threading.Thread(target=spin, name="left-running", daemon=False).start()
            return Pre()
    """
    folder = write_plugin(plugins_dir, "preprocessor", "spin", "1.0.0", files={"plugin.py": source})
    result = plugserve("validate", str(folder), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["valid"] is True
    assert "exit_with_threads" in result.stderr and "left-running" in result.stderr


def test_bad_config_exits_2_with_a_message(tmp_path: Path) -> None:
    config = tmp_path / "plugserve.toml"
    config.write_text("port = 'eighty'\n")
    result = plugserve("serve", "--config", str(config))
    assert result.returncode == 2
    assert "port must be" in result.stderr


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"drain_timeout_s = inf\n", "drain_timeout_s: must be a finite number"),
        (b"port = " + b"[" * 500 + b"]" * 500 + b"\n", "deeper than"),
        (b'host = "\xff"\n', "not UTF-8"),
        (b'host = "' + b"a" * 64 + b'"\n', "cannot listen on"),
    ],
)
def test_hostile_config_exits_2_with_a_message_and_no_traceback(
    tmp_path: Path, data: bytes, message: str
) -> None:
    """issue 12, finding 1: a config file with inf, ~500-deep nesting or bad bytes stops the
    start with a clean message and exit 2 (RecursionError and UnicodeDecodeError escaped before)."""
    config = tmp_path / "plugserve.toml"
    config.write_bytes(data)
    result = plugserve("serve", "--config", str(config))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.workers(  # it reads every line as JSON
    1, 2
)
def test_json_logs_carry_request_id_and_tracebacks_stay_in_the_log(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_plugin(
        plugins_dir,
        "runner",
        "boom",
        "1.0.0",
        files={
            "plugin.py": """
                import pluggy
                hookimpl = pluggy.HookimplMarker("plugserve")

                class Boom:
                    def infer(self, inputs):
                        raise RuntimeError("kaput")

                @hookimpl
                def plugserve_create_component(plugin, config):
                    return Boom()
            """
        },
    )
    config = plugins_dir.parent / "logging.toml"
    config.write_text("access_log = true\n")
    srv = server(
        "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir), "--log-format", "json",
        "--config", str(config),
    )  # fmt: skip
    status, headers, body = srv.request(
        "POST", "/predict/boom", {"x": [1]}, headers={"X-Request-ID": "trace-me-42"}
    )
    assert status == 500
    assert headers["X-Request-ID"] == "trace-me-42"
    assert b"Traceback" not in body
    assert json.loads(body)["error"] == "plugin runner/boom@1.0.0 raised RuntimeError: kaput"
    srv.stop()
    events = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
    raised = [e for e in events if e.get("event") == "plugin_raised"]
    assert raised, srv.log()
    assert raised[0]["request_id"] == "trace-me-42"
    assert raised[0]["route"] == "boom"
    assert raised[0]["versions"] == "boom@1.0.0"
    access = [e for e in events if e.get("event") == "request" and e["path"] == "/predict/boom"]
    assert access[0]["status"] == 500
    assert access[0]["path"] == "/predict/boom"
    assert access[0]["request_id"] == "trace-me-42"
    assert "Traceback" in raised[0]["exception"]
    assert "kaput" in raised[0]["exception"]
    ready = [e for e in events if e.get("event") == "plugin_ready"]
    assert ready[0]["plugin"] == "runner/boom@1.0.0"


@pytest.mark.workers(1, 2)
def test_admin_on_its_own_port_with_a_token_from_a_file(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    from tests.helpers import free_port

    admin_port = free_port()
    secret = tmp_path / "token"
    secret.write_text("s3cret-token\n")
    config = tmp_path / "plugserve.toml"
    config.write_text(f'admin_port = {admin_port}\nadmin_token_file = "{secret}"\n')
    srv = server(
        "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir), "--config", str(config)
    )
    auth = {"Authorization": "Bearer s3cret-token"}
    assert srv.request("GET", "/admin/plugins", headers=auth)[0] == 404  # not on the data port
    assert srv.request("GET", "/v2/health/live")[0] == 200
    admin = f"http://127.0.0.1:{admin_port}"
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(admin + "/admin/plugins", timeout=5)
    assert info.value.code == 401
    request = urllib.request.Request(admin + "/admin/plugins", headers=auth)
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200
    # issue 17: the status page too is only on the admin port; that port serves the data
    # plane as well (docs/security.md says both).
    assert srv.request("GET", "/admin/")[0] == 404
    for path in ("/admin/", "/v2/health/live"):
        with urllib.request.urlopen(admin + path, timeout=5) as response:
            assert response.status == 200, path
    assert "s3cret-token" not in srv.log()


def test_an_unreadable_token_file_stops_start_up(tmp_path: Path) -> None:
    config = tmp_path / "plugserve.toml"
    config.write_text(f'admin_token_file = "{tmp_path / "missing"}"\n')
    result = plugserve("serve", "--config", str(config))
    assert result.returncode == 2
    assert "admin_token_file" in result.stderr
