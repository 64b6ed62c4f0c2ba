"""Shadow traffic on a real server whose route serves sequences: whole sequences are
copied to the canary or none of each, and the copies count in no version's statistics."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tritonclient.grpc as grpcclient

from tests.helpers import ServerProcess, metric, write_sequence_runner
from tests.server.rollout_helpers import put_rollout, rollout, until, write_config

STABLE, CANARY = "acc@1.0.0", "acc@2.0.0"
STEPS = 4


def start(server: Callable[..., ServerProcess], tmp_path: Path, models_dir: Path) -> ServerProcess:
    """Two identical versions of a runner keeping sequences; ``acc`` served by 1.0.0."""
    plugins = tmp_path / "plugins"
    for version in ("1.0.0", "2.0.0"):
        write_sequence_runner(plugins, "acc", version, sequence="idle_timeout_s = 30")
    (plugins / "routes.toml").write_text(f'[routes.acc]\nrunner = "{STABLE}"\n')
    config = write_config(tmp_path / "plugserve.toml", rollout_interval_s=0.2, drain_timeout_s=1)
    return server("--plugins-dir", str(plugins), "--models-dir", str(models_dir),
                  "--config", str(config))  # fmt: skip


class Sequences:
    """Clients sending whole sequences of ``STEPS`` requests until stopped, each step
    checked against the running sum its sequence should have."""

    def __init__(self, srv: ServerProcess, clients: int = 4) -> None:
        self.srv = srv
        self.ids = itertools.count()
        self.sent = 0
        self.wrong: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client) for _ in range(clients)]

    def __enter__(self) -> Sequences:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _client(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                sequence_id = f"s{next(self.ids)}"
            for i in range(STEPS):
                parameters = {"sequence_id": sequence_id, "sequence_start": i == 0,
                              "sequence_end": i == STEPS - 1}  # fmt: skip
                body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                    "data": [1, 2, 3, 4]}], "parameters": parameters}  # fmt: skip
                status, _, raw = self.srv.request("POST", "/v2/models/acc/infer", body)
                with self._lock:
                    self.sent += 1
                    if status != 200 or json.loads(raw)["outputs"][0]["data"][0] != i + 1:
                        self.wrong.append(raw.decode()[:200])


def shadowed(srv: ServerProcess, outcome: str) -> float:
    """The copies counted with ``outcome`` (``plugserve_shadow_requests_total``)."""
    return metric(srv, "plugserve_shadow_requests_total", outcome=outcome, route="acc")


def test_a_canary_identical_to_the_stable_version_agrees_on_every_copied_sequence(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """Half the sequences are copied, each whole: every copy of a step finds its sequence
    on the canary with the same state, so every copy agrees and the canary is promoted."""
    srv = start(server, tmp_path, models_dir)
    policy = {"steps": [0, 100], "shadow": 0.5, "min_requests": 50, "min_seconds": 5}
    put_rollout(srv, {"runner": STABLE, "rollout": {"canary": CANARY, **policy}}, route="acc")
    with Sequences(srv) as load:
        until(lambda: rollout(srv, "acc")["status"]["state"] != "running", 90, "a decision")
    state = rollout(srv, "acc")
    shadow = state["status"]["history"][0]["figures"]["shadow"]
    assert shadow["compared"] >= 50 and shadow["agreed"] == shadow["compared"], shadow
    assert state["status"]["state"] == "promoted", state
    assert not load.wrong, load.wrong[:3]


def test_shadow_copies_count_in_no_versions_triton_statistics(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """A shadow-only step: the canary answers copies, but its statistics (HTTP and gRPC)
    count no inference, since it served none; the stable version counts what it served."""
    srv = start(server, tmp_path, models_dir)
    policy = {"steps": [0, 100], "shadow": 1.0, "min_requests": 10_000, "min_seconds": 600}
    put_rollout(srv, {"runner": STABLE, "rollout": {"canary": CANARY, **policy}}, route="acc")
    with Sequences(srv, clients=2) as load:
        until(lambda: shadowed(srv, "agreed") >= 40, 60, "40 copies compared")
    assert shadowed(srv, "failed") == 0 and shadowed(srv, "differed") == 0
    sent = load.sent
    status, _, body = srv.request("GET", "/v2/models/acc/versions/2.0.0/stats")
    assert status == 200, body
    (canary,) = json.loads(body)["model_stats"]
    assert canary["inference_count"] == 0, canary
    assert canary["inference_stats"]["success"]["count"] == 0, canary
    status, _, body = srv.request("GET", "/v2/models/acc/versions/1.0.0/stats")
    (stable,) = json.loads(body)["model_stats"]
    assert stable["inference_count"] == sent, (stable["inference_count"], sent)
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        answer: dict[str, Any] = client.get_inference_statistics("acc", "2.0.0", as_json=True)
    finally:
        client.close()
    (canary,) = answer["model_stats"]
    assert int(canary.get("inference_count", 0)) == 0, canary
    assert int(canary["inference_stats"]["success"].get("count", 0)) == 0, canary
