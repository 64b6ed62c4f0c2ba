"""The watched folders themselves replaced, removed and brought back under a running server."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ServerProcess, add_model, write_plugin
from tests.server.test_hot_reload import drop, tag, until, write_tagger

pytestmark = [pytest.mark.slow, pytest.mark.workers(1, 2)]


@pytest.fixture
def serve(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> Callable[..., ServerProcess]:
    def start(*args: str) -> ServerProcess:
        return server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir), *args)

    return start


def readiness(srv: ServerProcess) -> tuple[int, dict[str, Any]]:
    status, _, body = srv.request("GET", "/v2/health/ready")
    return status, json.loads(body)


def readiness_or_none(srv: ServerProcess) -> tuple[int, dict[str, Any]] | None:
    """As :func:`readiness`, ``None`` while the port is not listening yet."""
    try:
        return readiness(srv)
    except OSError:
        return None


def not_ready(srv: ServerProcess) -> dict[str, Any] | None:
    status, body = readiness(srv)
    return body if status == 503 else None


def watch_status(srv: ServerProcess) -> dict[str, Any]:
    _, _, body = srv.request("GET", "/admin/status")
    return json.loads(body)["watch"]  # type: ignore[no-any-return]


def ready_everywhere(srv: ServerProcess, name: str) -> bool:
    """The version is ready on every worker (a merged row without ``states``)."""
    _, _, body = srv.request("GET", "/admin/plugins")
    row = next((r for r in json.loads(body)["plugins"] if r["name"] == name), None)
    return row is not None and row["state"] == "ready" and "states" not in row


def y(srv: ServerProcess, route: str = "add") -> float:
    _, _, body = srv.request("POST", f"/predict/{route}", {"x": [[0, 0, 0, 0]]})
    return float(json.loads(body)["y"][0][0])


def test_a_plugins_dir_renamed_into_place_is_rescanned_and_watched(
    tmp_path: Path, plugins_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    """issue 12, finding 17: ``mv plugins.new plugins`` used to end hot reload silently."""
    write_tagger(plugins_dir, "1.0.0", "old")
    write_tagger(plugins_dir, "1.1.0", "gone")
    srv = serve()
    assert tag(srv) == (200, "gone")
    new = tmp_path / "plugins.new"
    write_tagger(new, "1.0.0", "new")
    plugins_dir.rename(tmp_path / "plugins.old")
    new.rename(plugins_dir)
    until(lambda: tag(srv) == (200, "new"))  # 1.0.0 reloaded from the new folder, 1.1.0 gone
    drop(plugins_dir, "2.0.0", "two")  # and what is dropped in later is loaded
    until(lambda: tag(srv) == (200, "two"))
    assert readiness(srv)[0] == 200
    assert "watch_root_restored" in srv.log()
    assert watch_status(srv) == {"enabled": True, "lost": []}


@pytest.mark.workers(1, 2)
def test_a_removed_plugins_dir_keeps_serving_says_so_and_comes_back(
    tmp_path: Path, plugins_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    """issue 12, finding 17: after ``rm -rf plugins`` readiness stayed 200 with no routes."""
    write_tagger(plugins_dir, "1.0.0", "one")
    srv = serve()
    backup = tmp_path / "backup"
    shutil.copytree(plugins_dir, backup)
    shutil.rmtree(plugins_dir)
    body = until(lambda: not_ready(srv))
    assert str(plugins_dir) in body["error"]
    assert body["missing"] == [str(plugins_dir)]
    until(lambda: "watch_root_lost" in srv.log())
    assert str(plugins_dir) in srv.log()
    assert tag(srv) == (200, "one")  # what was loaded keeps serving
    status, _, reload = srv.request("POST", "/admin/reload")  # a rescan would unload it all
    assert status == 200  # 200 whatever failed, as every rescan answers
    assert "missing" in json.loads(reload)["failed"][0]["error"]
    assert tag(srv) == (200, "one")
    assert [lost["path"] for lost in watch_status(srv)["lost"]] == [str(plugins_dir)]
    write_tagger(backup, "1.5.0", "one-five")
    shutil.copytree(backup, plugins_dir)  # the copy back
    until(lambda: readiness(srv)[0] == 200)
    until(lambda: tag(srv) == (200, "one-five"))
    drop(plugins_dir, "2.0.0", "two")
    until(lambda: tag(srv) == (200, "two"))
    assert "watch_root_restored" in srv.log()
    assert watch_status(srv)["lost"] == []


@pytest.mark.workers(1, 2)
def test_a_replaced_or_removed_models_dir_is_watched_again(
    tmp_path: Path, plugins_dir: Path, models_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    """issue 12, finding 17 (its class): the model repository replaced, removed, restored."""
    add_model(models_dir / "add" / "1" / "model.onnx", amount=1)
    write_plugin(plugins_dir, "runner", "add", "1.0.0",
                 '[runner]\nbackend = "onnxruntime"\nmodel = "models:add"\n', module=None)  # fmt: skip
    srv = serve()
    assert y(srv) == 1.0
    new = tmp_path / "models.new"
    add_model(new / "add" / "1" / "model.onnx", amount=3)
    shutil.rmtree(models_dir)
    body = until(lambda: not_ready(srv))
    assert body["missing"] == [str(models_dir)]
    assert y(srv) == 1.0  # keeps serving the loaded model
    new.rename(models_dir)
    until(lambda: y(srv) == 3.0)
    until(lambda: readiness(srv)[0] == 200)
    staging = models_dir / "add" / ".2.tmp"
    add_model(staging / "model.onnx", amount=4)
    staging.rename(models_dir / "add" / "2")
    until(lambda: y(srv) == 4.0)


def test_a_folder_missing_at_start_is_watched_once_it_appears(
    tmp_path: Path, plugins_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """issue 12, finding 17 (its class): a root that never existed is not "lost", but watched."""
    models_dir = tmp_path / "models-later"
    write_plugin(plugins_dir, "runner", "add", "1.0.0",
                 '[runner]\nbackend = "onnxruntime"\nmodel = "models:add"\n', module=None)  # fmt: skip
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 ready=False)  # fmt: skip
    until(lambda: srv.log().count("watching") >= 1 and "watch_root_missing" in srv.log())
    # Not ready for the route its model would serve (strict readiness), not for a lost root.
    _, body = until(lambda: (answer := readiness_or_none(srv)) and answer[0] == 503
                         and "unserved" in answer[1] and answer)  # fmt: skip
    assert set(body["unserved"]) == {"add"} and "missing" not in body, body
    staging = tmp_path / ".models.tmp"
    add_model(staging / "add" / "1" / "model.onnx", amount=2)
    staging.rename(models_dir)
    until(lambda: srv.request("POST", "/predict/add", {"x": [[0, 0, 0, 0]]})[0] == 200)
    assert readiness(srv)[0] == 200
    # With several workers the first may answer while another still loads (each request on a
    # new connection may reach either): wait until every worker has it.
    until(lambda: ready_everywhere(srv, "add"))
    assert y(srv) == 2.0
    add_model(models_dir / "add" / "1" / "model.onnx", amount=5)
    until(lambda: y(srv) == 5.0)


def test_a_symlinked_plugins_dir_swapped_to_a_new_release_is_rescanned(
    tmp_path: Path, server: Callable[..., ServerProcess]
) -> None:
    """issue 12, finding 17 (its class): ``ln -sfn releases/2 plugins``, the atomic swap."""
    one, two = tmp_path / "releases" / "1", tmp_path / "releases" / "2"
    write_tagger(one, "1.0.0", "one")
    write_tagger(two, "1.0.0", "two")
    link = tmp_path / "current"
    link.symlink_to(one)
    srv = server("--plugins-dir", str(link), "--models-dir", str(tmp_path / "models"))
    assert tag(srv) == (200, "one")
    swap = tmp_path / ".current.tmp"
    swap.symlink_to(two)
    swap.replace(link)
    until(lambda: tag(srv) == (200, "two"))
    drop(link, "2.0.0", "two-later")
    until(lambda: tag(srv) == (200, "two-later"))
    assert readiness(srv)[0] == 200
