"""routes.toml's published JSON Schema is the declared one, takes the routes files there are
and refuses what the server refuses where a schema can say it."""

from __future__ import annotations

import json
import tomllib
from typing import Any

import jsonschema
import pytest

from plugserve.registry.routing.route_specs import RouteSpecError, parse_route, routes_file_schema
from tests.helpers import ROOT

SCHEMA = ROOT / "docs" / "schemas" / "routes.schema.json"


def validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))


def test_the_published_routes_schema_is_the_declared_one() -> None:
    """Regenerate with ``python -m plugserve.registry.routing.route_specs``."""
    assert json.loads(SCHEMA.read_text()) == routes_file_schema()


def test_the_schema_takes_the_routes_files_there_are() -> None:
    files = [p for p in ROOT.rglob("routes.toml") if ".venv" not in p.parts]
    assert files
    for path in files:
        errors = list(validator().iter_errors(tomllib.loads(path.read_text())))
        assert not errors, (path, errors[0].message)
    graph = {
        "steps": [
            {"runner": "det@1.0.0", "inputs": {"x": "image"}, "outputs": {"y": "boxes"}},
            {"processor": "crop", "inputs": ["image", "boxes"], "outputs": ["crops"]},
        ],
        "outputs": ["crops"],
    }
    weighted = {"runner": {"iris@1.0.0": 90, "iris@2.0.0": 10}, "sticky": "x-user-id"}
    assert validator().is_valid({"routes": {"ocr": graph, "iris": weighted}})


REFUSED: list[dict[str, Any]] = [
    {"runner": 3},
    {"runner": "add", "rate_limit": 5},
    {"runner": "add", "rate_limit": {"rps": 0}},
    {"runner": "add", "rate_limit": {"rps": 1, "burst": 0}},
    {"runner": {"add@1.0.0": -1}},
    {"runner": "add", "sticky": "x user"},
    {"runner": "add", "preprocess": ["a"] * 65},
    {"runner": "add", "unknown": 1},
    {"steps": []},
    {"steps": [{"runner": "a", "outputs": ["b"]}]},
    {"steps": [{"runner": "a", "inputs": ["a"], "outputs": ["b"], "unknown": 1}]},
    {"steps": [{"runner": "a", "inputs": [], "outputs": ["b"]}]},
]


@pytest.mark.parametrize("entry", REFUSED)
def test_the_schema_refuses_what_the_server_refuses(entry: dict[str, Any]) -> None:
    with pytest.raises(RouteSpecError):
        parse_route("r", entry, "admin")
    assert not validator().is_valid({"routes": {"r": entry}})
    assert not validator().is_valid({"routes": {"Bad Name": {"runner": "add"}}})
