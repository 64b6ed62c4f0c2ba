"""Rollouts that decide themselves, on a real server under real requests: a failing or
slow canary rolled back within its first step, a good one promoted, shadow traffic
stopping a canary whose answers differ, an operator's pause, resume and abort, a
restart resuming a rollout where it stood in a window of its own, and a client choosing
its variant with a sticky header unable to change the outcome."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ServerProcess, metric
from tests.server.rollout_helpers import (
    CRASHING,
    REFUSED,
    Client,
    Load,
    key_on,
    put_rollout,
    rollout,
    until,
    write_config,
    write_model,
)

STABLE, CANARY = "m@1.0.0", "m@2.0.0"

pytestmark = pytest.mark.workers(1, 2)


def start(server: Callable[..., ServerProcess], tmp_path: Path, models_dir: Path,
          **settings: Any) -> ServerProcess:  # fmt: skip
    config = write_config(tmp_path / "plugserve.toml", rollout_interval_s=0.2, **settings)
    return server("--plugins-dir", str(tmp_path / "plugins"), "--models-dir", str(models_dir),
                  "--config", str(config))  # fmt: skip


def entry(sticky: str | None = None, **policy: Any) -> dict[str, Any]:
    route = {"runner": STABLE, "rollout": {"canary": CANARY, **policy}}
    return route if sticky is None else {**route, "sticky": sticky}


def decided(
    srv: ServerProcess, policy: dict[str, Any], timeout_s: float = 60
) -> tuple[dict[str, Any], Load]:
    """Start the rollout ``policy`` and load the server until it is decided: the rollout
    then, and the load's answers."""
    put_rollout(srv, policy)
    with Load([srv]) as load:
        until(lambda: rollout(srv)["status"]["state"] != "running", timeout_s, "a decision")
    return rollout(srv), load


def decisions(state: dict[str, Any]) -> list[tuple[str, int]]:
    return [(d["decision"], d["step"]) for d in state["status"]["history"]]


def test_a_canary_failing_one_request_in_20_is_rolled_back_within_its_first_step(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_model(tmp_path / "plugins", "1.0.0")
    write_model(tmp_path / "plugins", "2.0.0", fail_every=20)
    srv = start(server, tmp_path, models_dir)
    state, load = decided(srv, entry(steps=[10, 50, 100], min_requests=60, min_seconds=600))
    assert state["status"]["state"] == "rolled_back", state
    assert decisions(state) == [("roll_back", 0)]  # within the first step's window
    assert "error rate" in state["status"]["reason"], state["status"]["reason"]
    figures = state["status"]["history"][0]["figures"]
    # Each worker's canary fails its own every 20th request: with two, the window may hold
    # two failures in up to 79 requests (2.5 %).
    assert figures["canary"]["requests"] >= 60 and figures["canary"]["error_rate"] > 0.02
    assert figures["stable"]["errors"] == 0
    # The only failures are the canary's own: none because the weight moved.
    assert set(load.failures()) == {(500, CANARY)}, load.failures()
    served = load.served()
    assert sum(load.failures().values()) <= served[CANARY] / 19 + 1
    with Load([srv]) as after:
        until(lambda: len(after.answers) >= 100, 30)
    assert set(after.served()) == {STABLE} and not after.failures()
    _, _, metrics = srv.request("GET", "/metrics")
    text = metrics.decode()
    assert metric(text, "plugserve_rollout_decisions_total", decision="roll_back", route="m") == 1
    assert metric(text, "plugserve_rollout_state", route="m", state="rolled_back") == 1
    assert "rollout_roll_back" in srv.log()


def test_a_canary_three_times_slower_is_rolled_back(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_model(tmp_path / "plugins", "1.0.0", delay_s=0.01)
    write_model(tmp_path / "plugins", "2.0.0", delay_s=0.03)
    srv = start(server, tmp_path, models_dir)
    state, load = decided(srv, entry(steps=[20, 50, 100], min_requests=50, min_seconds=600))
    assert state["status"]["state"] == "rolled_back", state
    assert decisions(state) == [("roll_back", 0)]
    assert "latency" in state["status"]["reason"], state["status"]["reason"]
    assert not load.failures()


def test_a_canary_refusing_what_the_stable_version_takes_holds_its_first_step(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """A 400 is the request's fault, never counted as a version's: a canary refusing every
    request never has a request counted, so it never passes a step; its window shows the
    refusals for the operator to abort it."""
    write_model(tmp_path / "plugins", "1.0.0")
    write_model(tmp_path / "plugins", "2.0.0", strict=1)
    srv = start(server, tmp_path, models_dir)
    put_rollout(srv, entry(steps=[10, 50, 100], min_requests=50, min_seconds=5))

    def refused() -> int:
        window = rollout(srv)["window"] or {"variants": {}}
        return int(window["variants"].get(CANARY, {}).get("refused", 0))

    with Load([srv]) as load:
        until(lambda: refused() >= 100, 60, "the canary's refusals in the window")
        time.sleep(6)  # past min_seconds
    state = rollout(srv)
    assert state["status"]["state"] == "running" and state["status"]["step"] == 0, state
    assert state["window"]["variants"][CANARY]["requests"] == 0
    assert set(load.failures()) == {(400, CANARY)}


def test_a_good_canary_reaches_100_percent_and_becomes_the_stable_version(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_model(tmp_path / "plugins", "1.0.0")
    write_model(tmp_path / "plugins", "2.0.0")
    srv = start(server, tmp_path, models_dir)
    state, load = decided(
        srv, entry(steps=[10, 50, 100], min_requests=50, min_seconds=5), timeout_s=90
    )
    assert state["status"]["state"] == "promoted", state
    # At 100 % the stable version takes no traffic: the step below it decides.
    assert decisions(state) == [("advance", 0), ("promote", 1)]
    assert not load.failures()  # no request failed because of a step
    with Load([srv]) as after:
        until(lambda: len(after.answers) >= 100, 30)
    assert set(after.served()) == {CANARY} and not after.failures()
    _, _, body = srv.request("GET", "/admin/routes")
    (route,) = [r for r in json.loads(body)["routes"] if r["name"] == "m"]
    assert route["runner"] == {STABLE: 0, CANARY: 100}


def test_shadow_traffic_stops_a_canary_whose_answers_differ_before_it_serves_anyone(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_model(tmp_path / "plugins", "1.0.0")
    write_model(tmp_path / "plugins", "2.0.0", offset=0.5)
    srv = start(server, tmp_path, models_dir)
    state, load = decided(
        srv, entry(steps=[0, 10, 100], shadow=0.5, min_requests=50, min_seconds=600)
    )
    assert state["status"]["state"] == "rolled_back", state
    assert decisions(state) == [("roll_back", 0)]
    reason = state["status"]["reason"]
    assert "shadow traffic: 0 of" in reason and "y 0.5" in reason, reason
    assert set(load.served()) == {STABLE} and not load.failures()  # never answered by it
    shadow = state["status"]["history"][0]["figures"]["shadow"]
    assert shadow["compared"] >= 50 and shadow["agreed"] == 0
    assert shadow["largest_difference"] == {"y": 0.5}
    _, _, metrics = srv.request("GET", "/metrics")
    assert 'plugserve_shadow_requests_total{outcome="differed",route="m"}' in metrics.decode()


def test_shadow_traffic_agrees_with_a_canary_that_answers_the_same(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_model(tmp_path / "plugins", "1.0.0")
    write_model(tmp_path / "plugins", "2.0.0")
    srv = start(server, tmp_path, models_dir)
    state, load = decided(srv, entry(steps=[0, 100], shadow=0.5, min_requests=50, min_seconds=5))
    assert decisions(state) == [("promote", 0)], state
    shadow = state["status"]["history"][0]["figures"]["shadow"]
    assert shadow["compared"] >= 50 and shadow["agreed"] == shadow["compared"]
    assert shadow["largest_difference"] == {"y": 0.0}
    assert not load.failures()


def test_an_operator_pauses_resumes_and_aborts_a_rollout(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_model(tmp_path / "plugins", "1.0.0")
    write_model(tmp_path / "plugins", "2.0.0")
    srv = start(server, tmp_path, models_dir)
    put_rollout(srv, entry(steps=[10, 50, 90], min_requests=50, min_seconds=5))
    status, _, body = srv.request("POST", "/admin/routes/m/rollout/pause",
                                  {"reason": "holding for the release"})  # fmt: skip
    assert status == 200, body
    with Load([srv]) as load:
        until(lambda: len(load.answers) >= 200, 30)
        assert rollout(srv)["status"]["step"] == 0  # paused: no step however many requests
        assert rollout(srv)["status"]["reason"] == "holding for the release"
        status, _, body = srv.request("POST", "/admin/routes/m/rollout/pause")
        assert status == 409, body
        assert srv.request("POST", "/admin/routes/m/rollout/resume")[0] == 200
        until(lambda: rollout(srv)["status"]["step"] >= 1, 30, "a step after resume")
        status, _, body = srv.request("POST", "/admin/routes/m/rollout/abort")
        assert status == 200, body
    state = rollout(srv)
    assert state["status"]["state"] == "aborted"
    assert [d for d, _ in decisions(state)][:3] == ["pause", "resume", "advance"]
    assert decisions(state)[-1][0] == "abort"
    assert not load.failures()
    with Load([srv]) as after:
        until(lambda: len(after.answers) >= 50, 30)
    assert set(after.served()) == {STABLE}
    assert srv.request("POST", "/admin/routes/m/rollout/resume")[0] == 409
    assert srv.request("POST", "/admin/routes/m/rollout/jump")[0] == 404
    assert srv.request("POST", "/admin/routes/other/rollout/pause")[0] == 404
    assert srv.request("POST", "/admin/routes/m/rollout/pause", {"why": 1})[0] == 400
    escape = {"reason": "\u001b[31m"}
    assert srv.request("POST", "/admin/routes/m/rollout/pause", escape)[0] == 400
    metrics = srv.request("GET", "/metrics")[2].decode()
    for action in ("pause", "resume", "abort"):
        assert metric(metrics, "plugserve_rollout_decisions_total", decision=action, route="m") == 1
    assert metrics.count("# TYPE plugserve_rollout_decisions_total counter") == 1


@pytest.mark.workers(2)  # the gates and the controller are one code in both modes
def test_a_restart_resumes_a_rollout_at_its_step_in_a_window_of_its_own(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """The figures counted before a restart are lost with it: the step's window and its
    clock begin again together, so ``min_seconds`` runs from the restart."""
    write_model(tmp_path / "plugins", "1.0.0")
    write_model(tmp_path / "plugins", "2.0.0")
    saved = str(tmp_path / "routes.json")
    srv = start(server, tmp_path, models_dir, runtime_routes_file=saved)
    put_rollout(srv, entry(steps=[10, 50, 90], min_requests=50, min_seconds=5))
    with Load([srv]):
        until(lambda: rollout(srv)["status"]["step"] >= 1, 60, "one step")
    srv.stop()  # well within the step's 5 s
    (saved_entry,) = json.loads(Path(saved).read_text())["routes"].values()
    stood = saved_entry["entry"]["rollout"]["status"]  # as the file holds it once stopped
    time.sleep(max(0.0, stood["since"] + 5.5 - time.time()))  # the stored window's 5 s gone
    restarted = time.time()
    again = start(server, tmp_path, models_dir, runtime_routes_file=saved)
    with Load([again]) as load:
        until(lambda: rollout(again)["status"]["step"] >= 2, 60, "the next step")
    assert not load.failures()
    state = rollout(again)
    assert state["status"]["state"] == "running"
    assert state["status"]["history"][: len(stood["history"])] == stood["history"]
    after = state["status"]["history"][len(stood["history"]) :]
    assert [(d["decision"], d["step"]) for d in after] == [("restart", 1), ("advance", 1)], after
    assert after[1]["at"] - restarted >= 5, (after, restarted)
    assert after[1]["at"] - after[0]["at"] >= 5


def test_versions_that_load_on_demand_are_loaded_and_compared(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_model(tmp_path / "plugins", "1.0.0", on_demand=True)
    write_model(tmp_path / "plugins", "2.0.0", on_demand=True)
    srv = start(server, tmp_path, models_dir)
    put_rollout(srv, entry(steps=[10, 100], min_requests=50, min_seconds=600))
    with Load([srv]) as load:
        until(lambda: rollout(srv).get("window") is not None, 30, "a window")
        until(lambda: load.served()[STABLE] > 200, 60, "the stable version serving")
    served = load.served()
    assert served[CANARY] < served[STABLE] / 3, served  # 10 %, not all of it
    assert rollout(srv)["status"]["state"] == "running"


def test_a_put_carrying_a_status_keeps_the_rollout_only_where_it_stands(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_model(tmp_path / "plugins", "1.0.0")
    write_model(tmp_path / "plugins", "2.0.0")
    srv = start(server, tmp_path, models_dir)
    put_rollout(srv, entry(steps=[10, 50, 90], min_requests=50, min_seconds=5))
    read = json.loads(srv.request("GET", "/admin/routes")[2])["routes"]
    (entry_read,) = [{"runner": STABLE, "rollout": r["rollout"]} for r in read if r["name"] == "m"]
    for key in ("decided_here", "window"):
        entry_read["rollout"].pop(key, None)
    with Load([srv]):
        until(lambda: rollout(srv)["status"]["step"] >= 1, 60, "a step")
    status, _, body = srv.request("PUT", "/admin/routes/m", entry_read)  # a stale status
    assert status == 409 and b"moved on" in body, body
    now = rollout(srv)
    for key in ("decided_here", "window"):
        now.pop(key, None)
    other = {"runner": STABLE, "rollout": {**now, "canary": "m@3.0.0"}}
    status, _, body = srv.request("PUT", "/admin/routes/m", other)
    assert status == 409 and b"new rollout" in body, body
    longer = {"runner": STABLE, "rollout": {**now, "min_seconds": 3600}}
    put_rollout(srv, longer)
    kept = rollout(srv)
    assert kept["status"] == now["status"] and kept["min_seconds"] == 3600


def test_bad_rollouts_are_refused_with_the_field_named(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_model(tmp_path / "plugins", "1.0.0")
    write_model(tmp_path / "plugins", "2.0.0")
    srv = start(server, tmp_path, models_dir)
    bad = {
        ".rollout.steps": entry(steps=[50, 10]),
        ".rollout.canary": entry(steps=[10], canary="other@2.0.0"),
        ".rollout.shadow": entry(steps=[10], shadow=2),
        ".rollout.min_requests": entry(steps=[10], min_requests=0),
        ".rollout.min_seconds: must be from 5": entry(steps=[10], min_seconds=0),
        ".rollout: unknown key": entry(steps=[10], speed=1),
        ".rollout.steps: a step of 0": entry(steps=[0, 100]),
        ".runner": {
            "runner": {STABLE: 90, "m@3.0.0": 10},
            "rollout": {"canary": CANARY, "stable": STABLE, "steps": [10]},
        },
    }
    for field, body in bad.items():
        status, _, answer = srv.request("PUT", "/admin/routes/m", body)
        assert status == 400, (field, answer)
        assert field in json.loads(answer)["error"], (field, answer)
    status, _, answer = srv.request("PUT", "/admin/routes/m", entry(steps=[10]))
    assert status == 200, answer


@pytest.mark.workers(2)  # the gates and the controller are one code in both modes
def test_a_client_choosing_the_canary_by_its_sticky_key_cannot_roll_it_back(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """One client finds a header value the canary serves and sends with it input every
    version refuses (400) or fails (500): neither counts against the canary (a 400 is the
    request's fault; one key's requests are one cohort, which the gates leave out)."""
    write_model(tmp_path / "plugins", "1.0.0")
    write_model(tmp_path / "plugins", "2.0.0")
    srv = start(server, tmp_path, models_dir)
    put_rollout(srv, entry(sticky="x-user", steps=[25, 50, 100], min_requests=50, min_seconds=5))
    attacker = key_on(srv, CANARY)
    with Client(srv, attacker, [REFUSED, CRASHING]) as client, Load([srv]):
        until(lambda: rollout(srv)["status"]["state"] != "running", 60, "a decision")
    state = rollout(srv)
    history = [(h["decision"], h["reason"]) for h in state["status"]["history"]]
    assert decisions(state) == [("advance", 0), ("promote", 1)], history
    # (Its 500s open the canary's circuit breaker now and then: its share, the attacker's
    # requests with it, goes to the stable version meanwhile.)
    assert client.statuses[400, CANARY] > 50 and client.statuses[500, CANARY] > 5, client.statuses


def test_bad_input_on_the_stable_versions_key_does_not_pass_a_failing_canary(
    tmp_path: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """The mirror: 400s sent on a key the stable version serves do not raise its error
    rate to the level of a canary failing one request in five."""
    write_model(tmp_path / "plugins", "1.0.0")
    write_model(tmp_path / "plugins", "2.0.0", fail_every=5)
    srv = start(server, tmp_path, models_dir)
    put_rollout(srv, entry(sticky="x-user", steps=[25, 50, 100], min_requests=50, min_seconds=5))
    mirror = key_on(srv, STABLE)
    with Client(srv, mirror, [REFUSED]) as client, Load([srv]):
        until(lambda: rollout(srv)["status"]["state"] != "running", 60, "a decision")
    state = rollout(srv)
    assert decisions(state) == [("roll_back", 0)], state
    assert client.statuses[400, STABLE] > 50, client.statuses
