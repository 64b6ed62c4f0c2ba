"""A rollout's entry: parsed and checked whole, its weights following its status, and each
decision a new status with a new window."""

from __future__ import annotations

from typing import Any

import pytest

from plugserve.registry.routing.rollout import MAX_HISTORY, parse_rollout
from plugserve.registry.routing.route_specs import RouteSpecError, parse_route, with_rollout


def spec(**policy: Any) -> Any:
    entry = {"runner": "m@1.0.0", "rollout": {"canary": "m@2.0.0", "steps": [5, 25, 100], **policy}}
    return parse_route("m", entry, "admin")


def test_the_weights_follow_the_status_whatever_the_entry_said() -> None:
    route = spec()
    assert {v.label: v.weight for v in route.variants} == {"m@1.0.0": 95, "m@2.0.0": 5}
    entry = route.as_entry()
    entry["runner"] = {"m@1.0.0": 10, "m@2.0.0": 90}  # written by hand: the status decides
    again = parse_route("m", entry, "admin")
    assert again.rollout == route.rollout
    assert {v.label: v.weight for v in again.variants} == {"m@1.0.0": 95, "m@2.0.0": 5}


def test_each_decision_moves_the_status_and_opens_a_new_window() -> None:
    rollout = spec().rollout
    first = rollout.key
    moved = rollout.decided("advance", "passed", {"canary": {}}, "r0")
    assert (moved.status.step, moved.weight, moved.key != first) == (1, 25, True)
    paused = moved.decided("pause", "hold", None, "operator")
    assert paused.key == moved.key and paused.status.state == "paused" and paused.weight == 25
    resumed = paused.decided("resume", "go", None, "operator")
    assert resumed.status.state == "running" and resumed.key != paused.key
    back = resumed.decided("roll_back", "errors", None, "r1")
    assert (back.status.state, back.weight, back.active) == ("rolled_back", 0, False)
    assert back.weights() == {"m@1.0.0": 100, "m@2.0.0": 0}
    promoted = resumed.decided("promote", "ok", None, "r1")
    assert promoted.weights() == {"m@1.0.0": 0, "m@2.0.0": 100}
    assert [h["decision"] for h in back.status.history] == [
        "advance",
        "pause",
        "resume",
        "roll_back",
    ]
    route = with_rollout(spec(), back)
    assert parse_route("m", route.as_entry(), "etcd").rollout == back  # round trip


def test_the_history_keeps_the_last_decisions_only() -> None:
    rollout = spec().rollout
    for _ in range(MAX_HISTORY + 5):
        rollout = rollout.decided("pause", "p", None, "o").decided("resume", "r", None, "o")
    assert len(rollout.status.history) == MAX_HISTORY


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        ({"steps": []}, ".steps"),
        ({"steps": [10, 10]}, ".steps"),
        ({"steps": [101]}, ".steps"),
        ({"steps": [True]}, ".steps"),
        ({"steps": [0, 50]}, ".steps: a step of 0"),
        ({"canary": "m"}, ".canary: names a version"),
        ({"canary": "m@1.0.0"}, ".canary: is the stable version"),
        ({"canary": "n@2.0.0"}, ".canary"),
        ({"min_requests": 1.5}, ".min_requests"),
        ({"min_requests": 10}, r".min_requests: must be from 50 to 10000000 \(fewer tell"),
        ({"min_seconds": 0}, r".min_seconds: must be from 5 to 604800 \(a shorter step"),
        ({"min_seconds": 4.9}, ".min_seconds"),
        ({"max_latency_ratio": 1.0}, ".max_latency_ratio"),
        ({"latency_floor_ms": 0}, ".latency_floor_ms"),
        ({"steps": [100]}, ".steps: at 100 % the stable version takes no traffic"),
        ({"shadow": -0.1}, ".shadow"),
        ({"min_seconds": float("nan")}, ".min_seconds"),
        ({"status": {"id": "x", "step": 7}}, ".status.step"),
        ({"status": {"id": "x", "state": "done"}}, ".status.state"),
        ({"status": {"state": "running"}}, ".status.id"),
        ({"status": {"id": "x", "history": [1]}}, ".status.history"),
        ({"colour": "red"}, ": unknown key"),
    ],
)
def test_a_bad_rollout_names_its_field(policy: dict[str, Any], field: str) -> None:
    with pytest.raises(RouteSpecError, match=rf"^\.rollout{field}"):
        spec(**policy)


def test_the_stable_version_is_the_runner_or_the_other_variant() -> None:
    two = {"m@1.0.0": 90, "m@2.0.0": 10}
    assert str(parse_rollout({"canary": "m@2.0.0", "steps": [5]}, two).stable) == "m@1.0.0"
    with pytest.raises(ValueError, match="stable: is required"):
        parse_rollout({"canary": "m@2.0.0", "steps": [5]}, {"m@1.0.0": 1, "m@3.0.0": 1})
    with pytest.raises(RouteSpecError, match=r"^\.runner: a rollout's route"):
        parse_route("m", {"runner": {"m@1.0.0": 90, "m@3.0.0": 10},
                          "rollout": {"canary": "m@2.0.0", "stable": "m@1.0.0", "steps": [5]}},
                    "admin")  # fmt: skip
    with pytest.raises(RouteSpecError, match="graph route"):
        parse_route("g", {"steps": [{"runner": "m", "inputs": ["x"], "outputs": ["y"]}],
                          "rollout": {"canary": "m@2.0.0", "stable": "m@1.0.0", "steps": [5]}},
                    "admin")  # fmt: skip


def test_a_rollout_in_the_routes_file_is_refused(tmp_path: Any) -> None:
    from plugserve.registry.errors import RoutesFileError
    from plugserve.registry.routing.route_specs import load_routes_file

    path = tmp_path / "routes.toml"
    path.write_text(
        '[routes.m]\nrunner = "m@1.0.0"\nrollout = { canary = "m@2.0.0", steps = [5] }\n'
    )
    with pytest.raises(RoutesFileError, match=r"routes\.m\.rollout: a rollout is a runtime entry"):
        load_routes_file(path)


def test_shadow_copies_are_taken_only_while_the_rollout_runs() -> None:
    rollout = spec(steps=[0, 100], shadow=0.1).rollout
    paused = rollout.decided("pause", "hold", None, "operator")
    resumed = paused.decided("resume", "go", None, "operator")
    aborted = resumed.decided("abort", "stop", None, "operator")
    assert [r.shadowing for r in (rollout, paused, resumed, aborted)] == [True, False, True, False]
    assert not spec().rollout.shadowing  # no shadow share
