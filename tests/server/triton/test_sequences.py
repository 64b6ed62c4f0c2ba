"""Sequences through Triton's own clients: each request sends only its data, the server
keeps every sequence's state (``registry/execution/sequences.py``)."""

import concurrent.futures
import http.client
import json
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.fixtures.triton_models.build import build
from tests.helpers import ServerProcess, write_sequence_runner

STEPS = 6


def chunks(seed: int, count: int = STEPS) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 4)).astype(np.float32) for _ in range(count)]


def send_sequence(
    client: Any, url: str, route: str, sequence_id: int | str, xs: list[np.ndarray]
) -> list:
    """``xs`` as one sequence through ``client`` (tritonclient's ``http`` or ``grpc``)."""
    connection = client.InferenceServerClient(url=url)
    try:
        answers = []
        for i, x in enumerate(xs):
            data = client.InferInput("x", [1, 4], "FP32")
            data.set_data_from_numpy(x)
            result = connection.infer(route, [data], sequence_id=sequence_id,
                                      sequence_start=i == 0, sequence_end=i == len(xs) - 1)  # fmt: skip
            answers.append(result.as_numpy("y"))
        return answers
    finally:
        connection.close()


@pytest.fixture(params=["in-worker", "isolated"])
def sequences(
    request: pytest.FixtureRequest, plugins_dir: Path, models_dir: Path,
    server: Callable[..., Any],
) -> ServerProcess:  # fmt: skip
    """One worker keeping the sequences, or two workers reaching one runner process that
    keeps them (every request of a sequence reaches its state, whichever worker took it)."""
    isolated = request.param == "isolated"
    write_sequence_runner(
        plugins_dir, "acc", runner='isolation = "process"' if isolated else "",
        sequence="idle_timeout_s = 1.0\nmax_sequences = 24",
    )  # fmt: skip
    workers = ("--workers", "2") if isolated else ()
    return server(*workers, "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))


def plugin_figures(srv: ServerProcess) -> dict[str, Any]:
    status, _, body = srv.request("GET", "/admin/plugins")
    assert status == 200, body
    (record,) = [p for p in json.loads(body)["plugins"] if p["name"] == "acc"]
    return record


def sequence_figures(srv: ServerProcess) -> dict[str, Any] | None:
    """The runner's sequence figures (an isolated runner's: its processes', summed)."""
    return plugin_figures(srv).get("sequences")


def test_sixteen_concurrent_sequences_answer_as_each_alone_over_http_and_grpc(
    sequences: ServerProcess,
) -> None:
    """The state lives in the server: each answer is the running sum of the sequence's
    inputs, the same bytes whether the sequence ran alone or beside 15 others, which
    batch together."""
    http_url = f"127.0.0.1:{sequences.port}"
    inputs = {i: chunks(i) for i in range(16)}
    alone = {i: send_sequence(httpclient, http_url, "acc", 1000 + i, xs)
             for i, xs in inputs.items()}  # fmt: skip
    for i, xs in inputs.items():
        expected = np.cumsum(np.concatenate(xs), axis=0, dtype=np.float32)
        np.testing.assert_allclose(np.concatenate(alone[i]), expected, rtol=1e-6)
    for client, url in ((httpclient, http_url), (grpcclient, sequences.grpc_url)):
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            # Integer ids and string ids, as tritonclient sends both.
            ids = {i: (i + 1 if i % 2 else f"stream-{i}") for i in inputs}
            futures = {i: pool.submit(send_sequence, client, url, "acc", ids[i], xs)
                       for i, xs in inputs.items()}  # fmt: skip
            together = {i: f.result() for i, f in futures.items()}
        for i in inputs:
            for got, want in zip(together[i], alone[i], strict=True):
                assert got.tobytes() == want.tobytes(), (client.__name__, i)
    stats = json.loads(sequences.request("GET", "/v2/models/acc/stats")[2])
    model = stats["model_stats"][0]
    assert model["inference_count"] == 3 * 16 * STEPS
    mean_batch = model["inference_count"] / model["execution_count"]
    print(f"mean batch {mean_batch:.2f} rows over {model['execution_count']} executions")
    assert mean_batch > 1.0, model  # sequences batched together
    figures = sequence_figures(sequences)
    assert figures is not None and figures["live"] == 0 and figures["ended"] == 3 * 16, figures


def test_the_state_is_the_servers_to_keep(sequences: ServerProcess) -> None:
    """The model's state tensors are neither shown to clients nor asked of them."""
    status, _, body = sequences.request("GET", "/v2/models/acc")
    assert status == 200, body
    metadata = json.loads(body)
    assert [t["name"] for t in metadata["inputs"]] == ["x"]
    assert [t["name"] for t in metadata["outputs"]] == ["y"]


def infer(srv: ServerProcess, parameters: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
            "parameters": parameters}  # fmt: skip
    status, _, raw = srv.request("POST", "/v2/models/acc/infer", body)
    return status, json.loads(raw)


def test_requests_outside_a_running_sequence_are_refused_clearly(sequences: ServerProcess) -> None:
    status, answer = infer(sequences, {})
    assert status == 400 and "sequence_id" in answer["error"], answer
    status, answer = infer(sequences, {"sequence_id": 7})
    assert status == 400 and "not running" in answer["error"], answer
    for bad in ({"sequence_id": 1.5}, {"sequence_id": 7, "sequence_start": "yes"}):
        status, answer = infer(sequences, bad)
        assert status == 400, answer
    # A start, a step, an end; then the sequence is gone.
    assert infer(sequences, {"sequence_id": 7, "sequence_start": True})[1]["outputs"][0][
        "data"] == [1, 2, 3, 4]  # fmt: skip
    assert infer(sequences, {"sequence_id": 7})[1]["outputs"][0]["data"] == [2, 4, 6, 8]
    # A second start begins again from the initial state, as Triton does.
    assert infer(sequences, {"sequence_id": 7, "sequence_start": True})[1]["outputs"][0][
        "data"] == [1, 2, 3, 4]  # fmt: skip
    status, answer = infer(sequences, {"sequence_id": 7, "sequence_end": True})
    assert status == 200 and answer["outputs"][0]["data"] == [2, 4, 6, 8]
    status, answer = infer(sequences, {"sequence_id": 7})
    assert status == 400 and "not running" in answer["error"], answer


def test_max_sequences_is_a_429_and_idle_sequences_expire(sequences: ServerProcess) -> None:
    for i in range(24):
        assert infer(sequences, {"sequence_id": f"s{i}", "sequence_start": True})[0] == 200
    status, answer = infer(sequences, {"sequence_id": "s24", "sequence_start": True})
    assert status == 429 and "max_sequences" in answer["error"], answer
    figures = sequence_figures(sequences)
    assert figures is not None and figures["live"] == 24, figures
    time.sleep(2.5)  # idle_timeout_s = 1: every one expires, no request needed
    figures = sequence_figures(sequences)
    assert figures is not None and figures["live"] == 0 and figures["expired"] == 24, figures
    status, answer = infer(sequences, {"sequence_id": "s0"})
    assert status == 400 and "idle" in answer["error"], answer
    assert infer(sequences, {"sequence_id": "s24", "sequence_start": True})[0] == 200


def test_a_request_that_fails_changes_no_sequence(sequences: ServerProcess) -> None:
    """A start or a restart past its deadline (504) starts nothing and resets nothing."""
    late = {"timeout": 1}  # microseconds: past before the runner gets it
    assert infer(sequences, {"sequence_id": "f", "sequence_start": True})[0] == 200
    assert infer(sequences, {"sequence_id": "f"})[1]["outputs"][0]["data"] == [2, 4, 6, 8]
    assert infer(sequences, {"sequence_id": "f", "sequence_start": True, **late})[0] == 504
    assert infer(sequences, {"sequence_id": "f"})[1]["outputs"][0]["data"] == [3, 6, 9, 12]
    assert infer(sequences, {"sequence_id": "g", "sequence_start": True, **late})[0] == 504
    status, answer = infer(sequences, {"sequence_id": "g"})
    assert status == 400 and "is not running" in answer["error"], answer


def test_sequences_kept_in_one_of_several_workers_are_refused_at_load(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """Another worker's requests would miss their state: the version fails to load, with
    the way out, and the server goes on."""
    write_sequence_runner(plugins_dir, "acc")
    srv = server("--workers", "2", "--plugins-dir", str(plugins_dir), "--models-dir",
                 str(models_dir), ready=False)  # fmt: skip
    deadline = time.monotonic() + 60
    record: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            record = plugin_figures(srv)
        except (OSError, ValueError, AssertionError):
            record = {}
        if record.get("state") == "failed":
            break
        time.sleep(0.2)
    assert record.get("state") == "failed", record
    assert 'isolation = "process"' in record["last_error"] and "--workers 1" in record["last_error"]
    assert srv.request("GET", "/v2/health/live")[0] == 200


def step(srv: ServerProcess, parameters: dict[str, Any], x: float) -> tuple[str, list[float]]:
    """One request of a sequence: the version that served it, and its answer."""
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [x] * 4}],
            "parameters": parameters}  # fmt: skip
    status, headers, raw = srv.request("POST", "/v2/models/acc/infer", body)
    assert status == 200, raw
    return headers["X-Plugserve-Variant"], json.loads(raw)["outputs"][0]["data"]


def test_a_new_version_or_a_reload_mid_sequence_moves_new_sequences_only(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """A running sequence keeps the instance it started on, its state intact: past a new
    version taking the route, and past a reload of its own version's files (the old
    instance drains until its sequence ends). New sequences start on what serves now."""
    folder = write_sequence_runner(plugins_dir, "acc", "1.0.0", sequence="idle_timeout_s = 30")
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    assert step(srv, {"sequence_id": "a", "sequence_start": True}, 1.0) == ("acc@1.0.0", [1.0] * 4)
    assert step(srv, {"sequence_id": "a"}, 1.0) == ("acc@1.0.0", [2.0] * 4)
    write_sequence_runner(plugins_dir, "acc", "2.0.0", sequence="idle_timeout_s = 30")
    deadline = time.monotonic() + 30
    while step(srv, {"sequence_id": "probe", "sequence_start": True, "sequence_end": True},
               5.0)[0] != "acc@2.0.0":  # fmt: skip
        assert time.monotonic() < deadline, "2.0.0 never took the route"
        time.sleep(0.1)
    assert step(srv, {"sequence_id": "b", "sequence_start": True}, 5.0) == ("acc@2.0.0", [5.0] * 4)
    assert step(srv, {"sequence_id": "a"}, 1.0) == ("acc@1.0.0", [3.0] * 4)
    assert step(srv, {"sequence_id": "b"}, 5.0) == ("acc@2.0.0", [10.0] * 4)
    # A reload of 2.0.0's files: "b" goes on in the instance it started on.
    loaded_at = plugin_record(srv, "2.0.0")["loaded_at"]
    manifest = folder.parent / "2.0.0" / "plugin.toml"
    manifest.write_text(manifest.read_text() + "\n# edited\n")
    deadline = time.monotonic() + 30
    while plugin_record(srv, "2.0.0")["loaded_at"] == loaded_at:
        assert time.monotonic() < deadline, "2.0.0 was never reloaded"
        time.sleep(0.1)
    assert step(srv, {"sequence_id": "b"}, 5.0) == ("acc@2.0.0", [15.0] * 4)
    assert step(srv, {"sequence_id": "a"}, 1.0) == ("acc@1.0.0", [4.0] * 4)
    assert step(srv, {"sequence_id": "b", "sequence_end": True}, 5.0) == ("acc@2.0.0", [20.0] * 4)
    assert step(srv, {"sequence_id": "a", "sequence_end": True}, 1.0) == ("acc@1.0.0", [5.0] * 4)
    # Started anew, each takes the route's version now, in its new instance.
    assert step(srv, {"sequence_id": "a", "sequence_start": True}, 1.0) == ("acc@2.0.0", [1.0] * 4)
    assert step(srv, {"sequence_id": "a", "sequence_end": True}, 1.0) == ("acc@2.0.0", [2.0] * 4)


def plugin_record(srv: ServerProcess, version: str) -> dict[str, Any]:
    status, _, body = srv.request("GET", "/admin/plugins")
    assert status == 200, body
    (record,) = [p for p in json.loads(body)["plugins"] if p["version"] == version]
    return record


def test_a_canary_places_sequences_by_id_and_a_weight_change_moves_new_ones_only(
    plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """On a weighted route a sequence starts on the variant its id hashes to (the same
    variant again for the same id), and keeps it to its end past a change of weights;
    new sequences follow the new weights."""
    for version in ("1.0.0", "2.0.0"):
        write_sequence_runner(plugins_dir, "acc", version, sequence="idle_timeout_s = 30")
    routes = plugins_dir / "routes.toml"
    routes.write_text('[routes.acc]\nrunner = { "acc@1.0.0" = 50, "acc@2.0.0" = 50 }\n')
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    ids = [f"s{i}" for i in range(12)]
    started = {i: step(srv, {"sequence_id": i, "sequence_start": True}, 1.0)[0] for i in ids}
    assert set(started.values()) == {"acc@1.0.0", "acc@2.0.0"}, started
    for i in ids:  # keyed on the id, not drawn at random: each step stays, whatever worker
        assert step(srv, {"sequence_id": i}, 1.0) == (started[i], [2.0] * 4)
    # The same ids started again land where they did.
    again = {i: step(srv, {"sequence_id": i, "sequence_start": True}, 1.0)[0] for i in ids}
    assert again == started
    # A one-step sequence whose id the weights send to 1.0.0: it tells when they changed.
    probe = next(
        p for p in (f"p{n}" for n in range(64))
        if step(srv, {"sequence_id": p, "sequence_start": True, "sequence_end": True}, 1.0)[0]
        == "acc@1.0.0"
    )  # fmt: skip
    routes.write_text('[routes.acc]\nrunner = "acc@2.0.0"\n')
    deadline = time.monotonic() + 30
    while step(srv, {"sequence_id": probe, "sequence_start": True, "sequence_end": True},
               1.0)[0] != "acc@2.0.0":  # fmt: skip
        assert time.monotonic() < deadline, "the weights never changed"
        time.sleep(0.1)
    for i in ids:  # mid-sequence: each keeps its variant and its state
        assert step(srv, {"sequence_id": i}, 1.0) == (started[i], [2.0] * 4)
        assert step(srv, {"sequence_id": i, "sequence_end": True}, 1.0) == (started[i], [3.0] * 4)
    for i in ids:  # started anew (and ended): the route's one variant now
        assert step(srv, {"sequence_id": i, "sequence_start": True, "sequence_end": True},
                    1.0)[0] == "acc@2.0.0"  # fmt: skip


STEPS_PIPELINED = 8


@pytest.mark.workers(1, 2)
def test_a_stream_pipelining_sequences_is_answered_in_each_sequences_order(
    workers: int, tmp_path: Path, server: Callable[..., Any]
) -> None:
    """Triton's dyna-sequence model, its running sum kept by the server and its END and
    CORRID controls fed by it: eight sequences sent on one gRPC stream without waiting
    for answers (as Triton's stream examples do) each get their sums, in order."""
    plugins, models = build(tmp_path / "fixtures", ["simple_string_dyna_sequence"])
    srv = server("--workers", str(workers), "--plugins-dir", str(plugins),
                 "--models-dir", str(models))  # fmt: skip
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    rng = np.random.default_rng(0)
    values = {str(2000 + i): rng.integers(-50, 50, STEPS_PIPELINED).tolist() for i in range(8)}
    last = STEPS_PIPELINED - 1
    try:
        for step in range(STEPS_PIPELINED):
            for sequence_id, xs in values.items():
                data = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                data.set_data_from_numpy(np.array([[xs[step]]], np.int32))
                client.async_stream_infer(
                    "simple_string_dyna_sequence", [data], request_id=f"{sequence_id}_{step}",
                    sequence_id=sequence_id, sequence_start=step == 0, sequence_end=step == last,
                )  # fmt: skip
        got: dict[str, list[int]] = {}
        for _ in range(8 * STEPS_PIPELINED):
            result, error = answers.get(timeout=15)
            assert error is None, error
            sequence_id = result.get_response().id.split("_")[0]
            got.setdefault(sequence_id, []).append(int(result.as_numpy("OUTPUT")[0, 0]))
    finally:
        client.stop_stream()
        client.close()
    for sequence_id, xs in values.items():
        sums = list(np.cumsum(xs))
        sums[-1] += int(sequence_id)  # the model adds the correlation id at the end
        assert got[sequence_id] == sums, (sequence_id, got)


@pytest.mark.workers(1, 2)
def test_an_isolated_runners_sequence_keeps_its_version_past_a_new_one_and_a_reload(
    workers: int, plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """As for a runner in the worker, with the state in runner processes: a sequence
    started on 1.0.0 goes on there after 2.0.0 takes the route and after 1.0.0's files
    reload (its old processes end once its sequences have), through one connection (one
    worker) as a streaming client sends them."""
    isolated = 'isolation = "process"'
    folder = write_sequence_runner(plugins_dir, "acc", "1.0.0", runner=isolated,
                                   sequence="idle_timeout_s = 30")  # fmt: skip
    srv = server("--workers", str(workers), "--plugins-dir", str(plugins_dir),
                 "--models-dir", str(models_dir))  # fmt: skip
    connection = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)

    def kept_step(parameters: dict[str, Any], x: float) -> tuple[str, list[float]]:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [x] * 4}],
                "parameters": parameters}  # fmt: skip
        connection.request("POST", "/v2/models/acc/infer", json.dumps(body),
                           {"Content-Type": "application/json"})  # fmt: skip
        response = connection.getresponse()
        raw = response.read()
        assert response.status == 200, raw
        return response.headers["X-Plugserve-Variant"], json.loads(raw)["outputs"][0]["data"]

    try:
        assert kept_step({"sequence_id": "a", "sequence_start": True}, 1.0) == (
            "acc@1.0.0",
            [1.0] * 4,
        )
        write_sequence_runner(plugins_dir, "acc", "2.0.0", runner=isolated,
                              sequence="idle_timeout_s = 30")  # fmt: skip
        deadline = time.monotonic() + 60
        while step(srv, {"sequence_id": "probe", "sequence_start": True,
                         "sequence_end": True}, 1.0)[0] != "acc@2.0.0":  # fmt: skip
            assert time.monotonic() < deadline, "2.0.0 never took the route"
            time.sleep(0.1)
        time.sleep(1.0)  # every worker has the new table
        assert kept_step({"sequence_id": "a"}, 1.0) == ("acc@1.0.0", [2.0] * 4)
        loaded_at = plugin_record(srv, "1.0.0")["loaded_at"]
        manifest = folder / "plugin.toml"
        manifest.write_text(manifest.read_text() + "\n# edited\n")
        deadline = time.monotonic() + 60
        while plugin_record(srv, "1.0.0")["loaded_at"] == loaded_at:
            assert time.monotonic() < deadline, "1.0.0 was never reloaded"
            time.sleep(0.1)
        assert kept_step({"sequence_id": "a"}, 1.0) == ("acc@1.0.0", [3.0] * 4)
        assert kept_step({"sequence_id": "a", "sequence_end": True}, 1.0) == (
            "acc@1.0.0",
            [4.0] * 4,
        )
        # Ended too: nothing is left for the server's shutdown to drain.
        assert kept_step({"sequence_id": "a", "sequence_start": True, "sequence_end": True},
                         1.0) == ("acc@2.0.0", [1.0] * 4)  # fmt: skip
    finally:
        connection.close()
