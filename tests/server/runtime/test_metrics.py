import json
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import ServerProcess, write_add_runner, write_processor

X = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}]}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def requests_to(route: str) -> list[tuple[str, dict[str, object], int]]:
    """The traffic of the request-series tests: path, body and the status each answers."""
    return [
        *[(f"/v2/models/{route}/infer", X, 200)] * 3,
        (f"/predict/{route}", {"x": [[1, 2, 3, 4]]}, 200),
        (f"/v2/models/{route}/infer", {"inputs": []}, 400),
        *[(f"/v2/models/ghost{i}/infer", X, 404) for i in range(5)],
    ]


def check_request_series(got: Samples, route: str) -> None:
    ok = (("protocol", "v2"), ("route", route), ("status", "200"), ("variant", f"{route}@1.0.0"))
    assert got[("plugserve_requests_total", ok)] == 3
    # Refused before a variant was chosen: the variant label is empty.
    bad = (("protocol", "v2"), ("route", route), ("status", "400"), ("variant", ""))
    assert got[("plugserve_requests_total", bad)] == 1
    assert got[("plugserve_requests_total", (("protocol", "predict"), ("route", route), ("status", "200"), ("variant", f"{route}@1.0.0")))] == 1  # fmt: skip
    # Unknown routes share one label value: a client cannot grow the series.
    assert got[("plugserve_requests_total", (("protocol", "v2"), ("route", "_unknown"), ("status", "404"), ("variant", "")))] == 5  # fmt: skip
    assert not any("ghost" in str(k) for k in got)
    timed = (("protocol", "v2"), ("route", route))
    assert got[("plugserve_request_duration_seconds_count", timed)] == 4
    inf = (("le", "+Inf"), *timed)
    assert got[("plugserve_request_duration_seconds_bucket", inf)] == 4


def write_stage_chain(plugins_dir: Path) -> None:
    write_processor(plugins_dir, "preprocessor", "pre", "1.0.0", 1)
    write_add_runner(plugins_dir, "add", "1.0.0", route='[route]\npreprocess = ["pre"]\n')


def check_stage_series(got: Samples, requests: int) -> None:
    runner = (("name", "add"), ("type", "runner"), ("version", "1.0.0"))
    assert got[("plugserve_executions_total", runner)] == requests
    success = tuple(sorted((*runner, ("outcome", "success"))))
    fail = tuple(sorted((*runner, ("outcome", "fail"))))
    assert got[("plugserve_inferences_total", success)] == requests
    assert got[("plugserve_inferences_total", fail)] == 0
    assert got[("plugserve_batch_size_count", runner)] == requests
    assert got[("plugserve_batch_size_bucket", (("le", "1.0"), *runner))] == requests
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        key = tuple(sorted((*runner, ("stage", stage))))
        assert got[("plugserve_stage_duration_seconds_count", key)] == requests, stage
    compute = tuple(sorted((*runner, ("stage", "compute_infer"))))
    assert got[("plugserve_stage_duration_seconds_sum", compute)] > 0


def check_unloaded(text: str) -> None:
    assert 'name="add"' not in text.replace('plugserve_plugin_lifecycle_total{name="add"', "")


async def test_requests_are_counted_and_timed_per_route(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client()
    for path, body, status in requests_to("add"):
        assert (await cli.post(path, json=body)).status == status, path
    resp = await cli.get("/metrics")
    assert resp.status == 200 and resp.content_type == "text/plain"
    check_request_series(samples(await resp.text()), "add")


async def test_stage_batch_and_execution_series_follow_traffic_and_vanish_on_unload(
    plugins_dir: Path,
    client,  # type: ignore[no-untyped-def]
) -> None:
    write_stage_chain(plugins_dir)
    cli = await client()
    for _ in range(4):
        assert (await cli.post("/v2/models/add/infer", json=X)).status == 200
    check_stage_series(samples(await (await cli.get("/metrics")).text()), 4)
    assert (await cli.post("/admin/plugins/runner/add/1.0.0/unload")).status == 200
    check_unloaded(await (await cli.get("/metrics")).text())


@pytest.mark.slow
@pytest.mark.workers(1, 2)
def test_a_real_server_counts_every_request_once_whichever_process_served_it(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess], workers: int
) -> None:
    """The two tests above against a real server: with workers, the sums over all of them."""
    write_stage_chain(plugins_dir)
    write_add_runner(plugins_dir, "other", "1.0.0")
    config = plugins_dir.parent / "access.toml"
    config.write_text("access_log = true\n")
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--config", str(config))  # fmt: skip

    def served_by() -> set[str]:
        lines = [line for line in srv.log().splitlines() if "path=/v2/models/add/infer" in line]
        return {line.split("worker=")[1].split()[0] for line in lines if "worker=" in line}

    # Each on a new connection: spread over the workers. At least 20, and with workers on
    # until every one has served some (the kernel may hand a run of connections to one).
    sent = 0
    while sent < 20 or (workers > 1 and len(served_by()) < workers and sent < 400):
        assert srv.request("POST", "/v2/models/add/infer", X)[0] == 200
        sent += 1
    if workers > 1:  # the sums below add up what several processes counted
        assert len(served_by()) == workers
    status, headers, text = srv.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    check_stage_series(samples(text.decode()), sent)
    assert srv.request("POST", "/admin/plugins/runner/add/1.0.0/unload")[0] == 200
    check_unloaded(srv.request("GET", "/metrics")[2].decode())
    for path, body, code in requests_to("other"):
        assert srv.request("POST", path, body)[0] == code, path
    check_request_series(samples(srv.request("GET", "/metrics")[2].decode()), "other")


@pytest.mark.slow
@pytest.mark.workers(1, 2)
def test_a_real_server_sums_the_statistics_extension_over_whichever_process_served(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0")
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    for _ in range(20):  # each on a new connection: spread over the workers
        assert srv.request("POST", "/v2/models/add/infer", X)[0] == 200
    status, _, body = srv.request("GET", "/v2/models/add/stats")
    assert status == 200, body
    [stats] = json.loads(body)["model_stats"]
    assert (stats["name"], stats["version"]) == ("add", "1.0.0")
    assert (stats["inference_count"], stats["execution_count"]) == (20, 20)
    assert stats["inference_stats"]["success"]["count"] == 20
    [batches] = stats["batch_stats"]  # one row each: all batches of one
    assert batches["batch_size"] == 1
    assert batches["compute_infer"]["count"] == 20
