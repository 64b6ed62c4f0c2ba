from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import write_add_runner

X = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}]}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_requests_are_counted_and_timed_per_route(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    write_add_runner(plugins_dir, "add", "1.0.0")
    cli = await client()
    for _ in range(3):
        assert (await cli.post("/v2/models/add/infer", json=X)).status == 200
    assert (await cli.post("/predict/add", json={"x": [[1, 2, 3, 4]]})).status == 200
    assert (await cli.post("/v2/models/add/infer", json={"inputs": []})).status == 400
    for i in range(5):
        assert (await cli.post(f"/v2/models/ghost{i}/infer", json=X)).status == 404
    resp = await cli.get("/metrics")
    assert resp.status == 200 and resp.content_type == "text/plain"
    got = samples(await resp.text())
    ok = (("protocol", "v2"), ("route", "add"), ("status", "200"), ("variant", "add@1.0.0"))
    assert got[("plugserve_requests_total", ok)] == 3
    # Refused before a variant was chosen: the variant label is empty.
    bad = (("protocol", "v2"), ("route", "add"), ("status", "400"), ("variant", ""))
    assert got[("plugserve_requests_total", bad)] == 1
    assert got[("plugserve_requests_total", (("protocol", "predict"), ("route", "add"), ("status", "200"), ("variant", "add@1.0.0")))] == 1  # fmt: skip
    # Unknown routes share one label value: a client cannot grow the series.
    assert got[("plugserve_requests_total", (("protocol", "v2"), ("route", "_unknown"), ("status", "404"), ("variant", "")))] == 5  # fmt: skip
    assert not any("ghost" in str(k) for k in got)
    timed = (("protocol", "v2"), ("route", "add"))
    assert got[("plugserve_request_duration_seconds_count", timed)] == 4
    inf = (("le", "+Inf"), *timed)
    assert got[("plugserve_request_duration_seconds_bucket", inf)] == 4


async def test_stage_batch_and_execution_series_follow_traffic_and_vanish_on_unload(
    plugins_dir: Path,
    client,  # type: ignore[no-untyped-def]
) -> None:
    from tests.helpers import write_processor

    write_processor(plugins_dir, "preprocessor", "pre", "1.0.0", 1)
    write_add_runner(plugins_dir, "add", "1.0.0", route='[route]\npreprocess = ["pre"]\n')
    cli = await client()
    for _ in range(4):
        assert (await cli.post("/v2/models/add/infer", json=X)).status == 200
    got = samples(await (await cli.get("/metrics")).text())
    runner = (("name", "add"), ("type", "runner"), ("version", "1.0.0"))
    assert got[("plugserve_executions_total", runner)] == 4
    success = tuple(sorted((*runner, ("outcome", "success"))))
    fail = tuple(sorted((*runner, ("outcome", "fail"))))
    assert got[("plugserve_inferences_total", success)] == 4
    assert got[("plugserve_inferences_total", fail)] == 0
    assert got[("plugserve_batch_size_count", runner)] == 4
    assert got[("plugserve_batch_size_bucket", (("le", "1.0"), *runner))] == 4
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        key = tuple(sorted((*runner, ("stage", stage))))
        assert got[("plugserve_stage_duration_seconds_count", key)] == 4, stage
    assert (
        got[
            (
                "plugserve_stage_duration_seconds_sum",
                tuple(sorted((*runner, ("stage", "compute_infer")))),
            )
        ]
        > 0
    )
    assert (await cli.post("/admin/plugins/runner/add/1.0.0/unload")).status == 200
    text = await (await cli.get("/metrics")).text()
    assert 'name="add"' not in text.replace('plugserve_plugin_lifecycle_total{name="add"', "")
