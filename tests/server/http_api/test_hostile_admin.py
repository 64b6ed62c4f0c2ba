"""Property tests: hostile admin route bodies and config files never reach a 5xx or a traceback.

issue 12, "close the classes": ``PUT /admin/routes/{route}`` with any name and
any body answers 2xx or 4xx, and the server keeps serving a good request; a
config file holding anything is a :class:`ConfigError` or settings in bounds.
"""

from __future__ import annotations

import json
import math
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plugserve.registry.errors import ConfigError
from plugserve.server.config import Settings, load_settings
from tests.helpers import write_add_runner
from tests.hostile import nested, rate_limits, scalars, toml_document, values

FAST = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
X = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]}

route_names = st.one_of(
    st.sampled_from(["add", "canary", "add\n", "Add", "a" * 65, "\x00", "%", "..", "a/b"]),
    st.text(min_size=1, max_size=10),
).filter(lambda n: n != "good")
entries = st.dictionaries(
    st.sampled_from(["runner", "preprocess", "postprocess", "sticky", "rate_limit", "extra"]),
    st.one_of(
        values,
        rate_limits,
        st.sampled_from(["add", "add@1.0.0", "add@2.0.0", "good"]),
        st.dictionaries(st.sampled_from(["add@1.0.0", "add@2.0.0", "add"]), scalars, max_size=3),
    ),
    max_size=5,
)
bodies = st.one_of(
    entries.map(lambda e: json.dumps(e, allow_nan=True).encode("utf-8", "surrogatepass")),
    values.map(lambda v: json.dumps(v, allow_nan=True).encode("utf-8", "surrogatepass")),
    st.integers(min_value=1, max_value=3000).map(lambda d: nested(d).encode()),
    st.binary(max_size=64),
)


@pytest.fixture
def started() -> dict[str, Any]:
    """One test's app: started on its first example, kept for the others."""
    return {}


@FAST
@given(name=route_names, body=bodies, if_match=st.one_of(st.none(), st.text(max_size=8)))
async def test_hostile_route_puts_are_never_5xx_and_serving_goes_on(
    plugins_dir: Path,
    client,  # type: ignore[no-untyped-def]
    started: dict[str, Any],
    name: str,
    body: bytes,
    if_match: str | None,
) -> None:
    if "cli" not in started:
        write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
        write_add_runner(plugins_dir, "add", "2.0.0", amount=2)
        write_add_runner(plugins_dir, "good", "1.0.0", amount=1)
        started["cli"] = await client()
    cli = started["cli"]
    headers = {"Content-Type": "application/json"}
    if if_match is not None and if_match.isprintable() and if_match.isascii():
        headers["If-Match"] = if_match
    path = "/admin/routes/" + urllib.parse.quote(name, safe="")
    resp = await cli.put(path, data=body, headers=headers)
    assert resp.status < 500, await resp.text()
    if resp.status == 200:
        assert (await cli.delete(path)).status == 200
    for check in ("/admin/routes", "/admin/status", "/v2/models/add/ready"):
        assert (await cli.get(check)).status < 500, check
    good = await cli.post("/v2/models/good/infer", json=X)
    assert good.status == 200, await good.text()


@FAST
@given(
    config=st.dictionaries(
        st.sampled_from(["port", "host", "drain_timeout_s", "max_body_bytes", "reload_debounce_ms",
                         "max_inputs", "max_tensor_rank", "max_tensor_elements", "watch", "log_level",
                         "fleet_lease_ttl_s", "fleet_startup_wait_s", "plugins_dir", "models_dir",
                         "admin_port", "registry", "replica_id", "unknown"]),
        values,
        max_size=4,
    )
)  # fmt: skip
def test_hostile_config_files_are_config_errors_or_in_bounds(
    tmp_path: Path, config: dict[str, Any]
) -> None:
    path = tmp_path / "plugserve.toml"
    path.write_bytes(toml_document(config))
    try:
        loaded = load_settings(path, environ={})
    except ConfigError:
        return
    assert isinstance(loaded, Settings)
    for value in vars(loaded).values():
        if isinstance(value, float):
            assert math.isfinite(value)
        if isinstance(value, str):
            assert value.isprintable()
