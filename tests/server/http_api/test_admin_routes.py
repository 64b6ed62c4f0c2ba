"""Runtime route changes through the admin API (local mode): validated, atomic, layered."""

from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import write_add_runner

X = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]}
CANARY = {"runner": {"add@1.0.0": 80, "add@2.0.0": 20}, "sticky": "x-user-id"}


def two_versions(plugins_dir: Path) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    write_add_runner(plugins_dir, "add", "2.0.0", amount=2)


async def infer(cli, route: str = "add", user: str | None = None) -> tuple[str, float]:  # type: ignore[no-untyped-def]
    headers = {"X-User-ID": user} if user else {}
    resp = await cli.post(f"/v2/models/{route}/infer", json=X, headers=headers)
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    return resp.headers["X-Plugserve-Variant"], body["outputs"][0]["data"][0]


async def test_put_splits_traffic_and_the_variant_is_in_the_header_and_metrics(
    plugins_dir: Path,
    client,  # type: ignore[no-untyped-def]
) -> None:
    two_versions(plugins_dir)
    cli = await client()
    assert await infer(cli) == ("add@2.0.0", 2.0)  # floating: the highest version
    resp = await cli.put("/admin/routes/add", json=CANARY)
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["entry"] == CANARY and body["route"]["source"] == "admin"
    assert resp.headers["ETag"] == f'"{body["revision"]}"'
    picks = Counter()
    for i in range(400):
        variant, value = await infer(cli, user=f"u{i}")
        assert value == {"add@1.0.0": 1.0, "add@2.0.0": 2.0}[variant]  # the header tells the truth
        picks[variant] += 1
    assert 0.12 < picks["add@2.0.0"] / 400 < 0.28
    assert {(await infer(cli, user="u7"))[0] for _ in range(10)} == {
        (await infer(cli, user="u7"))[0]
    }
    metrics = await (await cli.get("/metrics")).text()
    assert 'status="200",variant="add@2.0.0"} ' in metrics
    assert 'status="200",variant="add@1.0.0"} ' in metrics


async def test_an_invalid_entry_is_400_and_changes_nothing(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    two_versions(plugins_dir)
    cli = await client()
    for body, message in [
        ({"runner": {"add@1.0.0": 50, "other@1.0.0": 50}}, "split one runner"),
        ({"runner": "add", "sticky": 3}, "sticky"),
        ({"runner": "add", "extra": 1}, "unknown key"),
        ({"preprocess": []}, "runner: is required"),
        ([1, 2], "must be a table"),
    ]:
        resp = await cli.put("/admin/routes/add", json=body)
        assert resp.status == 400 and message in (await resp.json())["error"], body
    resp = await cli.put(
        "/admin/routes/add", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert resp.status == 400
    assert (await cli.put("/admin/routes/Bad!", json={"runner": "add"})).status in (400, 404)
    assert await infer(cli) == ("add@2.0.0", 2.0)
    routes = (await (await cli.get("/admin/routes")).json())["routes"]
    assert [r["source"] for r in routes] == ["runner/add"]


async def test_runtime_entries_win_over_routes_toml_until_deleted(
    plugins_dir: Path,
    client,  # type: ignore[no-untyped-def]
) -> None:
    two_versions(plugins_dir)
    (plugins_dir / "routes.toml").write_text('[routes.add]\nrunner = "add@1.0.0"\n')
    cli = await client()
    assert await infer(cli) == ("add@1.0.0", 1.0)
    assert (await cli.put("/admin/routes/add", json={"runner": "add@2.0.0"})).status == 200
    assert await infer(cli) == ("add@2.0.0", 2.0)
    # routes.toml changes and is reloaded: the runtime entry still wins.
    (plugins_dir / "routes.toml").write_text(
        '[routes.add]\nrunner = "add@1.0.0"\npostprocess = []\n'
    )
    report = await (await cli.post("/admin/reload")).json()
    assert report["routes_file"] == "applied"
    assert await infer(cli) == ("add@2.0.0", 2.0)
    # Deleting it brings the file's entry back.
    resp = await cli.delete("/admin/routes/add")
    assert resp.status == 200
    assert (await resp.json())["route"]["source"] == "routes.toml"
    assert await infer(cli) == ("add@1.0.0", 1.0)
    assert (await cli.delete("/admin/routes/add")).status == 404  # nothing left to delete


async def test_a_route_only_the_api_made_disappears_when_deleted(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    two_versions(plugins_dir)
    cli = await client()
    assert (await cli.put("/admin/routes/beta", json={"runner": "add@1.0.0"})).status == 200
    assert await infer(cli, "beta") == ("add@1.0.0", 1.0)
    assert (await (await cli.delete("/admin/routes/beta")).json())["route"] is None
    assert (await cli.post("/v2/models/beta/infer", json=X)).status == 404


async def test_if_match_is_a_compare_and_swap_on_the_revision(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    two_versions(plugins_dir)
    cli = await client()
    first = await cli.put(
        "/admin/routes/add", json={"runner": "add@1.0.0"}, headers={"If-Match": "0"}
    )
    assert first.status == 200
    revision = (await first.json())["revision"]
    again = await cli.put(
        "/admin/routes/add", json={"runner": "add@2.0.0"}, headers={"If-Match": "0"}
    )
    assert again.status == 409 and (await again.json())["revision"] == revision
    assert await infer(cli) == ("add@1.0.0", 1.0)  # the refused write changed nothing
    ok = await cli.put("/admin/routes/add", json=CANARY, headers={"If-Match": f'"{revision}"'})
    assert ok.status == 200
    stale = await cli.delete("/admin/routes/add", headers={"If-Match": str(revision)})
    assert stale.status == 409
    assert (
        await cli.put("/admin/routes/add", json=CANARY, headers={"If-Match": "x"})
    ).status == 400


async def test_a_route_to_a_version_not_here_is_accepted_but_not_ready(
    plugins_dir: Path, client
) -> None:  # type: ignore[no-untyped-def]
    two_versions(plugins_dir)
    cli = await client()
    resp = await cli.put("/admin/routes/add", json={"runner": {"add@1.0.0": 50, "add@9.0.0": 50}})
    assert resp.status == 200
    variants = (await resp.json())["route"]["variants"]
    assert [(v["runner"], v["ready"], v["share"]) for v in variants] == [
        ("add@9.0.0", False, 0.0),
        ("add@1.0.0", True, 1.0),
    ]
    assert {(await infer(cli))[0] for _ in range(50)} == {"add@1.0.0"}


async def test_fleet_in_local_mode_is_this_server(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    two_versions(plugins_dir)
    cli = await client()
    await cli.put("/admin/routes/add", json={"runner": "add@1.0.0"})
    fleet = await (await cli.get("/admin/fleet")).json()
    assert fleet["mode"] == "local"
    [me] = fleet["replicas"]
    assert me["self"] and me["ready"] == ["runner/add@1.0.0", "runner/add@2.0.0"]
    assert fleet["routes"]["add"]["entry"] == {"runner": "add@1.0.0"}
    ready = await (await cli.get("/v2/health/ready")).json()
    assert ready == {"ready": True}


@pytest.mark.workers(1, 2)
def test_runtime_routes_survive_a_restart_with_a_state_file(
    plugins_dir: Path,
    models_dir: Path,
    tmp_path: Path,
    server,  # type: ignore[no-untyped-def]
) -> None:
    two_versions(plugins_dir)
    args = ["--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir)]
    args += ["--runtime-routes-file", str(tmp_path / "runtime-routes.json")]
    first = server(*args)
    assert first.request("PUT", "/admin/routes/add", {"runner": "add@1.0.0"})[0] == 200
    first.stop()
    second = server(*args)
    status, headers, _ = second.request("POST", "/v2/models/add/infer", X)
    assert status == 200 and headers["X-Plugserve-Variant"] == "add@1.0.0"


async def test_hostile_route_bodies_are_400_naming_the_field(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 1: ``rps: 1e999`` was a 500 and ``rps: NaN`` a 400 saying "cannot
    convert float NaN to integer"; both now name the field. Deep nesting and bad bytes: 400."""
    two_versions(plugins_dir)
    cli = await client()
    json_headers = {"Content-Type": "application/json"}
    for raw, message in [
        (b'{"runner": "add", "rate_limit": {"rps": 1e999}}', "rate_limit.rps: must be a finite"),
        (b'{"runner": "add", "rate_limit": {"rps": NaN}}', "rate_limit.rps: must be a finite"),
        (b'{"runner": "add", "rate_limit": {"rps": -Infinity}}', "rate_limit.rps"),
        (b'{"runner": "add", "rate_limit": {"rps": 1e-300}}', ">= 0.001"),
        (b'{"runner": "add", "rate_limit": {"rps": 1, "burst": 1e999}}', "rate_limit.burst"),
        (b'{"runner": {"add@1.0.0": 1e999}}', "weight must be an integer"),
        (b'{"runner": "add\\u0000"}', "control characters"),
        (b'{"runner": "add", "sticky": "x-user\\n"}', "sticky"),
        (b'{"runner": "add", "preprocess": ' + b"[" * 500 + b"]" * 500 + b"}", "deeper than"),
        (b"[" * 100_000, "deeper than"),
        (b'{"runner": "\xff"}', "JSON"),
    ]:
        resp = await cli.put("/admin/routes/add", data=raw, headers=json_headers)
        assert resp.status == 400, (raw[:60], await resp.text())
        assert message in (await resp.json())["error"], raw[:60]
    assert await infer(cli) == ("add@2.0.0", 2.0)


async def test_route_names_with_control_characters_are_400(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    """issue 12, finding 16: ``PUT /admin/routes/iris%0a`` created a route named "iris\\n"."""
    two_versions(plugins_dir)
    cli = await client()
    for quoted in ("add%0a", "add%0d", "add%00", "add%0a%0a", "%0aadd"):
        resp = await cli.put(f"/admin/routes/{quoted}", json={"runner": "add"})
        assert resp.status == 400, quoted
        assert "must match" in (await resp.json())["error"]
        assert (await cli.delete(f"/admin/routes/{quoted}")).status == 400
    names = [r["name"] for r in (await (await cli.get("/admin/routes")).json())["routes"]]
    assert names == ["add"]


async def test_if_match_revisions_are_bounded(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    two_versions(plugins_dir)
    cli = await client()
    for value in ('"99999999999999999999999"', '"-1"', '"x"', '"1e3"'):
        resp = await cli.put(
            "/admin/routes/add", json={"runner": "add"}, headers={"If-Match": value}
        )
        assert resp.status == 400, value


async def test_the_smallest_rate_answers_429_with_a_bounded_retry_after(
    plugins_dir: Path,
    client,  # type: ignore[no-untyped-def]
) -> None:
    """issue 12, finding 18: Retry-After is whole seconds, at most 3600, for the slowest rate."""
    two_versions(plugins_dir)
    cli = await client()
    entry = {"runner": "add", "rate_limit": {"rps": 0.001}}
    assert (await cli.put("/admin/routes/add", json=entry)).status == 200
    assert (await cli.post("/v2/models/add/infer", json=X)).status == 200
    resp = await cli.post("/v2/models/add/infer", json=X)
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "1000"
