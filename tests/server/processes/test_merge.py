"""Merging the workers' answers into one server's: counts add up, state is taken once."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from plugserve.server.processes import merge


def _worker_metrics(requests: int, in_flight: int, latencies: list[float]) -> str:
    registry = CollectorRegistry()
    counter = Counter("plugserve_requests", "Requests.", ["route"], registry=registry)
    counter.labels("iris").inc(requests)
    gauge = Gauge("plugserve_in_flight", "In flight.", ["name"], registry=registry)
    gauge.labels("iris").set(in_flight)
    lifecycle = Counter("plugserve_plugin_lifecycle", "Loads.", ["outcome"], registry=registry)
    lifecycle.labels("loaded").inc()  # every worker loads each version: one server event
    versions = Gauge("plugserve_plugin_versions", "Versions.", ["state"], registry=registry)
    versions.labels("ready").set(3)
    histogram = Histogram("plugserve_request_duration_seconds", "Latency.", registry=registry)
    for seconds in latencies:
        histogram.observe(seconds)
    return generate_latest(registry).decode()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_add_up_over_workers_and_state_gauges_do_not() -> None:
    text = merge.metrics(
        [("0", _worker_metrics(5, 2, [0.01, 0.2])), ("1", _worker_metrics(7, 1, [3.0]))]
    )
    samples = _samples(text)  # the merged text parses as Prometheus text
    assert samples[("plugserve_requests_total", (("route", "iris"),))] == 12
    assert samples[("plugserve_in_flight", (("name", "iris"),))] == 3
    assert samples[("plugserve_plugin_versions", (("state", "ready"),))] == 3  # not 6
    assert samples[("plugserve_plugin_lifecycle_total", (("outcome", "loaded"),))] == 1
    assert samples[("plugserve_request_duration_seconds_count", ())] == 3
    assert samples[("plugserve_request_duration_seconds_bucket", (("le", "0.25"),))] == 2
    assert samples[("plugserve_request_duration_seconds_bucket", (("le", "+Inf"),))] == 3
    assert samples[("plugserve_worker_in_flight", (("worker", "0"),))] == 2
    assert samples[("plugserve_worker_in_flight", (("worker", "1"),))] == 1
    assert "# TYPE plugserve_requests_total counter" in text


def test_plugins_once_each_with_counts_summed_and_disagreement_shown() -> None:
    row = {"type": "runner", "name": "iris", "version": "1.0.0", "last_error": None}
    merged = merge.plugins(
        [
            (11, [{**row, "state": "ready", "in_flight": 2, "executions": 5}]),
            (
                12,
                [{**row, "state": "failed", "in_flight": 1, "executions": 4, "last_error": "boom"}],
            ),
        ]
    )
    assert len(merged) == 1
    assert merged[0]["in_flight"] == 3 and merged[0]["executions"] == 9
    assert merged[0]["state"] == "failed" and merged[0]["states"] == {"11": "ready", "12": "failed"}
    assert merged[0]["last_error"] == "boom"
    agreed = merge.plugins([(11, [{**row, "state": "ready"}]), (12, [{**row, "state": "ready"}])])
    assert agreed[0]["state"] == "ready" and "states" not in agreed[0]
    # A version only one worker has (the other has not loaded it yet) is not shown as settled.
    partial = merge.plugins([(11, [{**row, "state": "ready"}]), (12, [])])
    assert partial[0]["states"] == {"11": "ready"}


def test_what_a_runner_version_waits_for_in_any_worker_is_listed() -> None:
    """A runner version waiting for a stage of its chain in one worker only (the other has
    loaded the stage already) shows ``waiting_for``, whichever worker answers first."""
    row = {"type": "runner", "name": "ocr", "version": "2.0.0", "state": "ready"}
    waits = {**row, "waiting_for": ["preprocessor addone@1.0.0 is not installed"]}
    for answers in ([(11, [row]), (12, [waits])], [(11, [waits]), (12, [row])]):
        assert merge.plugins(answers)[0]["waiting_for"] == waits["waiting_for"]
    assert "waiting_for" not in merge.plugins([(11, [row]), (12, [row])])[0]


def test_triton_statistics_add_up_per_route_version_and_batch_size() -> None:
    def stats(count: int, ns: int, last: int, batches: dict[int, int]) -> dict:  # type: ignore[type-arg]
        return {
            "model_stats": [
                {
                    "name": "iris",
                    "version": "1.0.0",
                    "last_inference": last,
                    "inference_count": count,
                    "inference_stats": {"success": {"count": count, "ns": ns}},
                    "batch_stats": [
                        {"batch_size": size, "compute_infer": {"count": n, "ns": n * 10}}
                        for size, n in batches.items()
                    ],
                }
            ]
        }

    merged = merge.model_stats([stats(3, 300, 1000, {1: 3}), stats(5, 500, 2000, {1: 1, 4: 1})])
    [entry] = merged["model_stats"]
    assert entry["inference_count"] == 8
    assert entry["inference_stats"]["success"] == {"count": 8, "ns": 800}
    assert entry["last_inference"] == 2000
    assert entry["batch_stats"] == [
        {"batch_size": 1, "compute_infer": {"count": 4, "ns": 40}},
        {"batch_size": 4, "compute_infer": {"count": 1, "ns": 10}},
    ]


def test_reload_reports_list_each_version_once() -> None:
    first = {"loaded": ["a"], "reloaded": [], "unloaded": [], "failed": [], "unchanged": 2,
             "routes_file": "unchanged"}  # fmt: skip
    second = {**first, "failed": [{"plugin": "b", "error": "boom"}]}
    merged = merge.sync_reports([first, second])
    assert merged["loaded"] == ["a"]
    assert merged["failed"] == [{"plugin": "b", "error": "boom"}]


def test_a_replaced_workers_counts_stay_in_the_totals() -> None:
    """A worker that ended keeps its last counts in the sums; its gauges go with it."""
    retired = merge.counts_only(_worker_metrics(5, 2, [0.01]))
    assert "plugserve_in_flight" not in retired and "plugserve_plugin_versions" not in retired
    text = merge.metrics([("1", _worker_metrics(7, 1, [3.0]))], [retired])
    samples = _samples(text)
    assert samples[("plugserve_requests_total", (("route", "iris"),))] == 12
    assert samples[("plugserve_request_duration_seconds_count", ())] == 2
    assert samples[("plugserve_in_flight", (("name", "iris"),))] == 1
    assert samples[("plugserve_plugin_lifecycle_total", (("outcome", "loaded"),))] == 1
    assert ("plugserve_worker_in_flight", (("worker", ""),)) not in samples


def test_a_version_failed_on_one_worker_is_not_listed_as_reloaded() -> None:
    ok = {"loaded": [], "reloaded": ["a"], "unloaded": [], "failed": [], "unchanged": 3}
    bad = {**ok, "reloaded": [], "failed": [{"plugin": "a", "error": "boom"}], "unchanged": 2}
    merged = merge.sync_reports([ok, bad])
    assert merged["reloaded"] == [] and merged["failed"] == [{"plugin": "a", "error": "boom"}]
    assert merged["unchanged"] == 2
