"""The control plane: token rules, plugin and route listings."""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from aiohttp.test_utils import make_mocked_request

from plugserve.registry.errors import Forbidden, Unauthorized
from plugserve.server.config import Settings
from plugserve.server.http.auth import check_admin, is_loopback
from tests.helpers import ServerProcess, write_add_runner, write_plugin


def mocked(remote: str, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda key, default=None: (
        (remote, 12345) if key == "peername" else default
    )
    return make_mocked_request("GET", "/admin/plugins", headers=headers or {}, transport=transport)


@pytest.mark.parametrize(
    ("remote", "expected"),
    [("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("10.0.0.1", False),
     ("192.168.1.2", False), ("::ffff:8.8.8.8", False), ("", False), ("junk", False)],
)  # fmt: skip
def test_loopback_detection(remote: str, expected: bool) -> None:
    assert is_loopback(remote) is expected


def test_without_a_token_only_loopback_is_let_in() -> None:
    settings = Settings(admin_token=None)
    check_admin(mocked("127.0.0.1"), settings)
    with pytest.raises(Forbidden):
        check_admin(mocked("10.1.2.3"), settings)


def test_with_a_token_it_is_required_from_everywhere() -> None:
    settings = Settings(admin_token="s3cret")
    for remote in ("127.0.0.1", "10.1.2.3"):
        with pytest.raises(Unauthorized):
            check_admin(mocked(remote), settings)
        with pytest.raises(Unauthorized):
            check_admin(mocked(remote, {"Authorization": "Bearer wrong"}), settings)
        with pytest.raises(Unauthorized):
            check_admin(mocked(remote, {"Authorization": "Basic s3cret"}), settings)
        check_admin(mocked(remote, {"Authorization": "Bearer s3cret"}), settings)


async def test_admin_endpoints_answer_401_without_the_token(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    cli = await client(admin_token="tok")
    for path in ("/admin/plugins", "/admin/routes"):
        resp = await cli.get(path)
        assert resp.status == 401 and "Bearer" in (await resp.json())["error"]
        resp = await cli.get(path, headers={"Authorization": "Bearer nope"})
        assert resp.status == 401
        resp = await cli.get(path, headers={"Authorization": "Bearer tok"})
        assert resp.status == 200
    assert (await cli.get("/v2/health/live")).status == 200  # the data plane needs no token


def write_listed(plugins_dir: Path) -> None:
    """A good runner in two versions, a broken preprocessor, and a pinned route."""
    write_add_runner(plugins_dir, "add", "1.0.0")
    write_add_runner(plugins_dir, "add", "1.1.0")
    write_plugin(plugins_dir, "preprocessor", "bad", "0.1.0", files={"plugin.py": "1/0"})
    (plugins_dir / "routes.toml").write_text('[routes.old]\nrunner = "add@1.0.0"\n')


def check_plugins(doc: dict[str, Any]) -> None:
    rows = {(p["type"], p["name"], p["version"]): p for p in doc["plugins"]}
    assert len(rows) == len(doc["plugins"])  # each version once
    assert set(rows) == {
        ("runner", "add", "1.0.0"),
        ("runner", "add", "1.1.0"),
        ("preprocessor", "bad", "0.1.0"),
    }
    good, bad = rows[("runner", "add", "1.0.0")], rows[("preprocessor", "bad", "0.1.0")]
    assert good["state"] == "ready" and good["last_error"] is None and good["in_flight"] == 0
    assert good["loaded_at"].endswith("+00:00") and good["backend"] == "onnxruntime"
    assert good["device"] == "cpu"
    assert good["providers"] == ["CPUExecutionProvider"]
    assert (good["executions"], good["queued"]) == (0, 0)
    assert bad["state"] == "failed" and "ZeroDivisionError" in bad["last_error"]
    assert bad["loaded_at"] is None


def check_routes(doc: dict[str, Any]) -> None:
    routes = {r["name"]: r for r in doc["routes"]}
    assert routes["add"]["serving"]["runner"] == "runner/add@1.1.0"
    assert routes["add"]["source"] == "runner/add" and routes["add"]["versions"] == [
        "1.1.0",
        "1.0.0",
    ]
    assert routes["old"]["serving"]["runner"] == "runner/add@1.0.0"
    assert routes["old"]["source"] == "routes.toml"
    assert doc["routes_file"]["error"] is None


async def test_plugins_listing_shows_states_and_errors(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_listed(plugins_dir)
    cli = await client()
    check_plugins(await (await cli.get("/admin/plugins")).json())


async def test_routes_listing_shows_what_serves(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_listed(plugins_dir)
    cli = await client()
    check_routes(await (await cli.get("/admin/routes")).json())


@pytest.mark.slow
@pytest.mark.workers(1, 2)
def test_a_real_server_answers_the_listings_and_token_rules_as_one(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess], workers: int
) -> None:
    """The three tests above against a real server; with workers, whichever answers."""
    write_listed(plugins_dir)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 env={"PLUGSERVE_ADMIN_TOKEN": "tok"})  # fmt: skip
    auth = {"Authorization": "Bearer tok"}
    for path in ("/admin/plugins", "/admin/routes"):
        status, _, body = srv.request("GET", path)
        assert status == 401 and "Bearer" in json.loads(body)["error"]
        assert srv.request("GET", path, headers={"Authorization": "Bearer nope"})[0] == 401
        assert srv.request("GET", path, headers=auth)[0] == 200
    for _ in range(4):  # each on a new connection, wherever the kernel hands it
        check_plugins(json.loads(srv.request("GET", "/admin/plugins", headers=auth)[2]))
        check_routes(json.loads(srv.request("GET", "/admin/routes", headers=auth)[2]))
    # The ONNX Runtime threads the server chose for the runner, and from what.
    doc = json.loads(srv.request("GET", "/admin/plugins", headers=auth)[2])
    row = next(p for p in doc["plugins"] if (p["name"], p["version"]) == ("add", "1.0.0"))
    loops = "1 event loop" if workers == 1 else f"{workers} event loops"
    assert loops in row["threads"]["reason"], row
    assert row["threads"]["intra_op"] >= 1


SLOW_PREPROCESSOR = """
    import time
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    def spend_a_millisecond():
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass

    class Slow:
        def process(self, data, ctx):
            spend_a_millisecond()
            return data

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Slow()
"""


async def test_profile_of_the_live_server(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    import asyncio
    import json

    # A preprocessor that spends a millisecond in the event loop per request, so the
    # request path surely holds samples (with a fast path and one client the loop is
    # mostly idle). The speedscope export keeps every sample; with pyinstrument's
    # default pruning of frames under 1 % this test failed about two runs in three.
    write_plugin(
        plugins_dir, "preprocessor", "slow", "1.0.0", files={"plugin.py": SLOW_PREPROCESSOR}
    )
    write_add_runner(plugins_dir, "add", "1.0.0", route='[route]\npreprocess = ["slow"]\n')
    cli = await client()
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}]}

    done = asyncio.Event()

    async def traffic() -> None:
        while not done.is_set():  # for the whole profile, however the two interleave
            await cli.post("/v2/models/add/infer", json=body)

    load = asyncio.create_task(traffic())
    resp = await cli.post("/admin/profile?seconds=0.5&format=speedscope")
    done.set()
    await load
    assert resp.status == 200
    profile = json.loads(await resp.text())
    assert "speedscope" in profile["$schema"]
    frames = {f["name"] for f in profile["shared"]["frames"]}
    assert {"infer", "_infer", "run"} <= frames, sorted(frames)  # the request path
    html = await cli.post("/admin/profile?seconds=0.1")
    assert html.content_type == "text/html"
    assert "<html" in (await html.text()).lower()
    assert (await cli.post("/admin/profile?seconds=999")).status == 400
