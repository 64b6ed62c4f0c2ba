"""The OpenAPI document stays true: it matches the router, and schemathesis finds no 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from plugserve.server.app import create_app
from plugserve.server.config import Settings
from plugserve.server.http_api.openapi import document
from plugserve.server.openai_api.requests import openapi_schemas
from tests.helpers import ServerProcess, write_add_runner, write_processor


def test_every_route_is_documented_and_every_documented_route_exists(tmp_path: Path) -> None:
    app = create_app(Settings(plugins_dir=tmp_path, models_dir=tmp_path, watch=False))
    served = {
        (route.method.lower(), route.resource.canonical)
        for route in app.router.routes()
        if route.method != "HEAD" and route.resource is not None
    }
    documented = {(method, path) for path, ops in document({})["paths"].items() for method in ops}
    assert served == documented


async def test_the_document_is_served(plugins_dir: Path, client) -> None:  # type: ignore[no-untyped-def]
    cli = await client()
    doc = await (await cli.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.")
    assert "/v2/models/{route}/infer" in doc["paths"]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("openapi")
    plugins, models = root / "plugins", root / "models"
    models.mkdir()
    write_processor(plugins, "preprocessor", "pre", "1.0.0", 1)
    write_add_runner(plugins, "add", "1.0.0", route='[route]\npreprocess = ["pre"]\n')
    srv = ServerProcess(
        "--plugins-dir", str(plugins), "--models-dir", str(models), log=root / "server.log"
    )
    srv.wait_ready()
    yield srv
    srv.stop()


# The profiler sleeps for as long as it is asked to: it has its own test.
schema = schemathesis.openapi.from_dict(document(openapi_schemas())).exclude(path="/admin/profile")


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_server_error(
    case: schemathesis.Case, live: ServerProcess
) -> None:
    response = case.call(base_url=live.url, timeout=10)
    assert response.status_code < 500, (
        case.method,
        case.formatted_path,
        response.status_code,
        response.text[:300],
    )
