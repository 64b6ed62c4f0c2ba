"""Hot reload, end to end: a real server subprocess, real files changed under it.

One test per promise of the contract's Hot reload section, plus the admin
calls, integrity checks, a no-failed-request run while versions churn, and a
memory check over many reloads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ServerProcess, add_model, metric, rss_mib, until, write_plugin

pytestmark = [pytest.mark.slow, pytest.mark.workers(1, 2)]


TAGGER = """
    import asyncio
    import numpy as np
    import pluggy
    from . import suffix

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Tagger:
        def __init__(self, tag):
            self.tag = tag
            self.closed = False

        async def infer(self, inputs):
            delay = float(np.asarray(inputs.get("delay", [0])).reshape(-1)[0])
            await asyncio.sleep(delay)
            return {"tag": np.array([self.tag + suffix.SUFFIX], dtype=object)}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Tagger(config["tag"])
"""


def write_tagger(
    plugins_dir: Path, version: str, tag: str, suffix: str = "", folder_name: str | None = None
) -> Path:
    """A runner answering ``{"tag": [tag + suffix]}``; ``folder_name`` writes it elsewhere first."""
    folder = write_plugin(
        plugins_dir,
        "runner",
        "tagger",
        folder_name or version,
        f'[config]\ntag = "{tag}"\n[runner]\ninstances = 4\n',
        {"plugin.py": TAGGER, "suffix.py": f"SUFFIX = {suffix!r}\n"},
    )
    if folder_name:
        text = (folder / "plugin.toml").read_text().replace(f'"{folder_name}"', f'"{version}"')
        (folder / "plugin.toml").write_text(text)
    return folder


def drop(plugins_dir: Path, version: str, tag: str, suffix: str = "") -> Path:
    """Write a version under a dot name, then rename it into place: the atomic drop."""
    tmp = write_tagger(plugins_dir, version, tag, suffix, folder_name=f".{version}.tmp")
    final = tmp.with_name(version)
    tmp.rename(final)
    return final


def tag(srv: ServerProcess, delay: float = 0, route: str = "tagger") -> tuple[int, str]:
    status, _, body = srv.request("POST", f"/predict/{route}", {"delay": [delay]})
    doc = json.loads(body)
    return status, doc["tag"][0] if status == 200 else doc["error"]


def plugins(srv: ServerProcess) -> dict[str, dict[str, Any]]:
    _, _, body = srv.request("GET", "/admin/plugins")
    return {f"{p['type']}/{p['name']}@{p['version']}": p for p in json.loads(body)["plugins"]}


@pytest.fixture
def serve(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> Callable[..., ServerProcess]:
    def start(*args: str) -> ServerProcess:
        return server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir), *args)

    return start


def test_new_version_loads_in_the_background_and_the_route_moves(
    plugins_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    write_tagger(plugins_dir, "1.0.0", "one")
    srv = serve()
    assert tag(srv) == (200, "one")
    drop(plugins_dir, "1.1.0", "one-one")
    until(lambda: tag(srv) == (200, "one-one"))
    assert plugins(srv)["runner/tagger@1.1.0"]["state"] == "ready"
    assert plugins(srv)["runner/tagger@1.0.0"]["state"] == "ready"  # still there, pinnable
    status, _, body = srv.request("POST", "/v2/models/tagger/versions/1.0.0/infer",
                                  {"inputs": [{"name": "delay", "datatype": "FP32", "shape": [1], "data": [0]}]})  # fmt: skip
    assert status == 200
    assert json.loads(body)["outputs"][0]["data"] == ["one"]


def test_in_place_edits_of_module_manifest_and_sibling_reload(
    plugins_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    folder = write_tagger(plugins_dir, "1.0.0", "a")
    srv = serve()
    assert tag(srv) == (200, "a")
    manifest = folder / "plugin.toml"
    manifest.write_text(manifest.read_text().replace('tag = "a"', 'tag = "b"'))
    until(lambda: tag(srv) == (200, "b"))
    (folder / "suffix.py").write_text("SUFFIX = '-sibling'\n")
    until(lambda: tag(srv) == (200, "b-sibling"))
    source = (folder / "plugin.py").read_text()
    (folder / "plugin.py").write_text(
        source.replace("self.tag + suffix.SUFFIX", "'mod:' + self.tag")
    )
    until(lambda: tag(srv) == (200, "mod:b"))


@pytest.mark.workers(1, 2)
def test_broken_new_version_keeps_the_old_serving_and_is_reported(
    plugins_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    write_tagger(plugins_dir, "1.0.0", "good")
    srv = serve()
    broken = write_tagger(plugins_dir, "2.0.0", "bad", folder_name=".2.0.0.tmp")
    (broken / "plugin.py").write_text("raise RuntimeError('broken on purpose')\n")
    broken.rename(broken.with_name("2.0.0"))

    def failed_everywhere() -> dict[str, Any] | None:
        # In every worker: ``states`` (by process) is there only while they differ.
        row = plugins(srv).get("runner/tagger@2.0.0", {})
        return row if row.get("state") == "failed" and "states" not in row else None

    row = until(failed_everywhere)
    assert "broken on purpose" in row["last_error"]
    assert tag(srv) == (200, "good")
    _, _, metrics = srv.request("GET", "/metrics")
    failed = {"outcome": "failed", "type": "runner"}
    assert metric(metrics, "plugserve_plugin_lifecycle_total", name="tagger", **failed) == 1
    assert metric(metrics, "plugserve_plugin_versions", state="failed", type="runner") == 1
    # The next change is tried again.
    (plugins_dir / "runner/tagger/2.0.0/plugin.py").write_text(TAGGER_SOURCE())
    until(lambda: tag(srv) == (200, "bad"))
    until(lambda: plugins(srv)["runner/tagger@2.0.0"]["last_error"] is None)  # every worker
    assert "plugin_load_failed" in srv.log()


def TAGGER_SOURCE() -> str:
    import textwrap

    return textwrap.dedent(TAGGER)


def test_broken_in_place_edit_keeps_the_serving_instance(
    plugins_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    folder = write_tagger(plugins_dir, "1.0.0", "stable")
    srv = serve()
    (folder / "suffix.py").write_text("SUFFIX = (\n")
    row = until(lambda: plugins(srv)["runner/tagger@1.0.0"]["last_error"] and plugins(srv)["runner/tagger@1.0.0"])  # fmt: skip
    assert row["state"] == "ready"
    assert "SyntaxError" in row["last_error"]
    assert tag(srv) == (200, "stable")
    (folder / "suffix.py").write_text("SUFFIX = '!'\n")
    until(lambda: tag(srv) == (200, "stable!"))
    # Each worker reloads on its own: the first answer may come from the first to switch,
    # and the error clears once the last one has (the final CI of session 8 caught it).
    until(lambda: plugins(srv)["runner/tagger@1.0.0"]["last_error"] is None)


def test_deleting_a_version_unloads_it_and_floating_routes_fall_back(
    plugins_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    write_tagger(plugins_dir, "1.0.0", "old")
    newest = write_tagger(plugins_dir, "2.0.0", "new")
    (plugins_dir / "routes.toml").write_text('[routes.pinned]\nrunner = "tagger@2.0.0"\n')
    srv = serve()
    assert tag(srv) == (200, "new")
    shutil.rmtree(newest)
    until(lambda: tag(srv) == (200, "old"))
    until(lambda: "runner/tagger@2.0.0" not in plugins(srv))
    status, message = tag(srv, route="pinned")
    assert status == 503
    assert "tagger has no version 2.0.0" in message
    shutil.rmtree(plugins_dir / "runner" / "tagger")
    until(lambda: tag(srv)[0] == 404)


def test_model_repository_changes_reload_the_runners_using_them(
    plugins_dir: Path, models_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    add_model(models_dir / "add" / "1" / "model.onnx", amount=1)
    write_plugin(plugins_dir, "runner", "add", "1.0.0",
                 '[runner]\nbackend = "onnxruntime"\nmodel = "models:add"\n', module=None)  # fmt: skip
    write_plugin(plugins_dir, "runner", "pinned", "1.0.0",
                 '[runner]\nbackend = "onnxruntime"\nmodel = "models:add/1"\n', module=None)  # fmt: skip
    srv = serve()

    def y(route: str) -> float:
        _, _, body = srv.request("POST", f"/predict/{route}", {"x": [[0, 0, 0, 0]]})
        return float(json.loads(body)["y"][0][0])

    assert (y("add"), y("pinned")) == (1.0, 1.0)
    staging = models_dir / "add" / ".2.tmp"
    add_model(staging / "model.onnx", amount=2)
    staging.rename(models_dir / "add" / "2")
    until(lambda: y("add") == 2.0)
    assert y("pinned") == 1.0
    add_model(models_dir / "add" / "1" / "model.onnx", amount=5)  # an in-place model edit
    until(lambda: y("pinned") == 5.0)
    assert y("add") == 2.0
    shutil.rmtree(models_dir / "add" / "2")  # back to the highest remaining version
    until(lambda: y("add") == 5.0)


def test_a_version_whose_model_failed_to_load_is_tried_again_when_the_model_changes(
    plugins_dir: Path, models_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    """No admin call: replacing the broken model file loads the version, and says so."""
    broken = models_dir / "add" / "1" / "model.onnx"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not an ONNX model")
    write_plugin(plugins_dir, "runner", "add", "1.0.0",
                 '[runner]\nbackend = "onnxruntime"\nmodel = "models:add"\n', module=None)  # fmt: skip
    srv = serve("--no-strict-readiness")
    assert srv.request("POST", "/predict/add", {"x": [[0, 0, 0, 0]]})[0] == 503
    fixed = add_model(plugins_dir.parent / "fixed.onnx", amount=3)
    os.replace(fixed, broken)  # one rename: the watcher never sees half a file

    def y() -> float | None:
        code, _, body = srv.request("POST", "/predict/add", {"x": [[0, 0, 0, 0]]})
        return float(json.loads(body)["y"][0][0]) if code == 200 else None

    assert until(y) == 3.0
    assert "retrying_failed_version" in srv.log()


def test_routes_file_changes_apply_and_invalid_ones_keep_the_table(
    plugins_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    write_tagger(plugins_dir, "1.0.0", "one")
    write_tagger(plugins_dir, "2.0.0", "two")
    srv = serve()
    assert tag(srv, route="stable")[0] == 404
    routes = plugins_dir / "routes.toml"
    routes.write_text('[routes.stable]\nrunner = "tagger@1.0.0"\n')
    # Every worker has the table before the next edit (each watches the file itself: one
    # still debouncing would read only the invalid edit). Each request is a connection of
    # its own, which the kernel gives to either worker: 20 in a row reach both.
    until(lambda: all(tag(srv, route="stable") == (200, "one") for _ in range(20)))
    routes.write_text("[routes.stable\nrunner = 'oops'\n")

    def error() -> Any:
        _, _, body = srv.request("GET", "/admin/routes")
        return json.loads(body)["routes_file"]["error"]

    assert "routes.toml" in until(error)
    assert tag(srv, route="stable") == (200, "one")
    routes.write_text('[routes.stable]\nrunner = "tagger@2.0.0"\n')
    until(lambda: tag(srv, route="stable") == (200, "two"))
    assert error() is None


def test_a_slow_multi_file_copy_is_never_loaded_half_written(
    plugins_dir: Path, serve: Callable[..., ServerProcess], workers: int
) -> None:
    write_tagger(plugins_dir, "1.0.0", "one")
    # A wide debounce, so that a stall of the test machine cannot pass for a finished copy.
    srv = serve("--config", str(write_config(plugins_dir.parent, reload_debounce_ms=1000)))
    # Every worker past its first scan: a worker still starting would load the copy as it is.
    until(lambda: workers == 1 or srv.log().count("worker_registered") >= workers)
    folder = plugins_dir / "runner" / "tagger" / "1.5.0"
    folder.mkdir()
    # Each piece arrives well inside the 1 s debounce; the whole copy takes ~1 s.
    pieces = [
        ("plugin.toml", '[plugin]\nname = "tagger"\nversion = "1.5.0"\ntype = "runner"\n'),
        ("plugin.toml", 'module = "plugin.py"\n'),
        ("plugin.toml", '[config]\ntag = "complete"\n[runner]\ninstances = 4\n'),
        ("suffix.py", "SUFFIX = ''\n"),
        *[("plugin.py", line + "\n") for line in TAGGER_SOURCE().splitlines()[:12]],
        ("plugin.py", "\n".join(TAGGER_SOURCE().splitlines()[12:]) + "\n"),
    ]
    for name, text in pieces:
        with (folder / name).open("a") as f:
            f.write(text)
        time.sleep(0.06)
    until(lambda: tag(srv) == (200, "complete"))
    # With several workers the first may answer while another still loads: wait for every
    # worker's line, then check that none loaded it twice (a half-written copy loaded first).
    until(lambda: srv.log().count("plugin=runner/tagger@1.5.0") >= workers)
    time.sleep(1.5)
    assert "plugin_load_failed" not in srv.log()
    # Loaded once, when complete: one line from each worker.
    assert srv.log().count("plugin=runner/tagger@1.5.0") == workers


def test_an_in_flight_request_finishes_on_its_version_while_new_ones_reach_the_new(
    plugins_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    folder = write_tagger(plugins_dir, "1.0.0", "old")
    srv = serve()
    slow: dict[str, tuple[int, str]] = {}
    thread = threading.Thread(target=lambda: slow.setdefault("r", tag(srv, delay=4.0)))
    thread.start()
    time.sleep(0.3)
    manifest = folder / "plugin.toml"
    manifest.write_text(manifest.read_text().replace('"old"', '"new"'))
    until(lambda: tag(srv) == (200, "new"))
    assert thread.is_alive(), slow  # the slow request is still running, on the old instance
    assert plugins(srv)["runner/tagger@1.0.0"]["in_flight"] == 1
    thread.join(10)
    assert slow["r"] == (200, "old")


def test_touches_and_junk_files_reload_nothing(
    plugins_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    folder = write_tagger(plugins_dir, "1.0.0", "one")
    srv = serve()
    loaded_at = plugins(srv)["runner/tagger@1.0.0"]["loaded_at"]
    (folder / "plugin.py").touch()
    (folder / ".plugin.py.swp").write_text("editor junk")
    (folder / "notes.txt~").write_text("backup")
    (folder / "__pycache__").mkdir()
    (folder / "__pycache__" / "x.pyc").write_bytes(b"junk")
    (folder / "plugin.toml").write_text((folder / "plugin.toml").read_text())  # same bytes
    time.sleep(0.8)
    assert plugins(srv)["runner/tagger@1.0.0"]["loaded_at"] == loaded_at
    assert "outcome=reloaded" not in srv.log()


def test_checksums_must_match_or_the_old_version_keeps_serving(
    plugins_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    folder = write_tagger(plugins_dir, "1.0.0", "signed")

    def sign() -> None:
        lines = [
            f"{hashlib.sha256((folder / n).read_bytes()).hexdigest()}  {n}"
            for n in ("plugin.toml", "plugin.py", "suffix.py")
        ]
        (folder / "SHA256SUMS").write_text("\n".join(lines) + "\n")

    sign()
    srv = serve()
    assert tag(srv) == (200, "signed")
    (folder / "suffix.py").write_text("SUFFIX = '-tampered'\n")
    row = until(lambda: plugins(srv)["runner/tagger@1.0.0"]["last_error"] and plugins(srv)["runner/tagger@1.0.0"])  # fmt: skip
    assert "SHA256SUMS: suffix.py does not match its checksum" in row["last_error"]
    assert tag(srv) == (200, "signed")
    sign()
    until(lambda: tag(srv) == (200, "signed-tampered"))


def test_admin_reload_and_unload(plugins_dir: Path, serve: Callable[..., ServerProcess]) -> None:
    write_tagger(plugins_dir, "1.0.0", "one")
    srv = serve("--config", str(write_config(plugins_dir.parent, watch=False)))
    drop(plugins_dir, "2.0.0", "two")
    bad = write_tagger(plugins_dir, "3.0.0", "x")
    (bad / "plugin.py").write_text("1/0\n")
    status, _, body = srv.request("POST", "/admin/reload")
    report = json.loads(body)
    assert status == 200
    assert report["loaded"] == ["runner/tagger@2.0.0"]
    assert report["failed"][0]["plugin"] == "runner/tagger@3.0.0"
    assert "ZeroDivisionError" in report["failed"][0]["error"]
    assert report["unchanged"] == 1
    # A second rescan finds nothing new: decided by content, not retried.
    report = json.loads(srv.request("POST", "/admin/reload")[2])
    assert (report["loaded"], report["reloaded"], report["failed"]) == ([], [], [])
    report = json.loads(srv.request("POST", "/admin/reload?force=true")[2])
    assert sorted(report["reloaded"]) == ["runner/tagger@1.0.0", "runner/tagger@2.0.0"]
    status, _, body = srv.request("POST", "/admin/plugins/runner/tagger/3.0.0/reload")
    assert status == 400
    assert "ZeroDivisionError" in json.loads(body)["error"]
    status, _, body = srv.request("POST", "/admin/plugins/runner/tagger/2.0.0/unload")
    assert status == 200
    assert json.loads(body)["plugin"]["state"] == "unloaded"
    assert tag(srv) == (200, "one")
    srv.request("POST", "/admin/reload")
    assert plugins(srv)["runner/tagger@2.0.0"]["state"] == "unloaded"  # held until asked
    status, _, body = srv.request("POST", "/admin/plugins/runner/tagger/2.0.0/reload")
    assert status == 200
    assert json.loads(body)["outcome"] == "loaded"
    assert tag(srv) == (200, "two")


@pytest.mark.workers(1, 2)
def test_admin_version_calls_on_unknown_or_bad_names(
    plugins_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    write_tagger(plugins_dir, "1.0.0", "one")
    srv = serve("--config", str(write_config(plugins_dir.parent, watch=False)))
    for path, code in [
        ("/admin/plugins/runner/tagger/9.0.0/reload", 404),
        ("/admin/plugins/runner/ghost/1.0.0/unload", 404),
        ("/admin/plugins/model/tagger/1.0.0/reload", 404),
        ("/admin/plugins/runner/tagger/1.0/reload", 400),
        ("/admin/plugins/runner/..%2F..%2Fetc/1.0.0/reload", 400),
        ("/admin/plugins/runner/tagger/..%2F1.0.0/reload", 400),
        ("/admin/plugins/runner/tagger/..%2F..%2F..%2F..%2Fadmin%2Freload%3F/reload", 400),
    ]:
        assert srv.request("POST", path)[0] == code, path
    assert "runner/tagger@1.0.0" in plugins(srv)


def write_config(folder: Path, **values: object) -> Path:
    config = folder / "plugserve.toml"
    config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    return config


def test_no_request_fails_while_versions_are_added_edited_and_replaced(
    plugins_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    write_tagger(plugins_dir, "1.0.0", "v1")
    srv = serve()
    stop = threading.Event()
    results: list[tuple[int, str]] = []

    def client() -> None:
        while not stop.is_set():
            results.append(tag(srv, delay=0.01))

    clients = [threading.Thread(target=client) for _ in range(4)]
    for t in clients:
        t.start()
    for i in range(2, 8):
        drop(plugins_dir, f"{i}.0.0", f"v{i}")  # a new version
        time.sleep(0.35)
        folder = plugins_dir / "runner" / "tagger" / f"{i}.0.0"
        (folder / "suffix.py").write_text(f"SUFFIX = '-edit{i}'\n")  # an in-place edit
        time.sleep(0.35)
        if i >= 4:
            shutil.rmtree(plugins_dir / "runner" / "tagger" / f"{i - 2}.0.0")  # replace old ones
    until(lambda: tag(srv) == (200, "v7-edit7"))
    stop.set()
    for t in clients:
        t.join(10)
    failures = [r for r in results if r[0] != 200]
    assert len(results) > 100
    assert failures == []
    assert {"v1", "v2-edit2", "v7-edit7"} <= {text for _, text in results}


BIG = """
    import numpy as np
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Big:
        def __init__(self, mib):
            self.weights = np.ones(mib * 1024 * 1024 // 8)  # touched pages: really resident
        def infer(self, inputs):
            return {"sum": np.array([self.weights[:4].sum()])}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Big(config["mib"])
"""


@pytest.mark.workers(1)  # reads the resident memory of the one process that serves
def test_memory_stays_flat_over_many_reloads_of_a_big_plugin(
    plugins_dir: Path, serve: Callable[..., ServerProcess]
) -> None:
    write_plugin(plugins_dir, "runner", "big", "1.0.0", "[config]\nmib = 40\n", {"plugin.py": BIG})
    srv = serve()

    def reload() -> None:
        status, _, body = srv.request("POST", "/admin/plugins/runner/big/1.0.0/reload")
        assert status == 200, body
        assert srv.request("POST", "/predict/big", {"x": [1]})[0] == 200

    for _ in range(5):
        reload()
    before = rss_mib(srv.proc.pid)
    reloads = 40
    for _ in range(reloads):
        reload()
    after = rss_mib(srv.proc.pid)
    growth_per_reload = (after - before) / reloads
    print(f"RSS {before:.1f} MiB -> {after:.1f} MiB over {reloads} reloads of a 40 MiB plugin")
    assert growth_per_reload < 1.0, (before, after)
    assert before < 400  # one copy of the 40 MiB plugin, not several
