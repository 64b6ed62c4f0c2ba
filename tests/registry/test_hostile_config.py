"""Property tests: hostile manifests and routes files are their source's error, never an escape.

issue 12, "close the classes": whatever a ``plugin.toml`` or ``routes.toml``
holds (inf, nan, huge and negative numbers, deep nesting, bytes that are not
UTF-8, control characters, wrong types), reading it raises the source's own
error or yields values inside their documented bounds.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plugserve.registry.backends.ort_options import RUNNER_KEYS as ORT_KEYS
from plugserve.registry.backends.ort_options import parse_options
from plugserve.registry.errors import ManifestError, PluginLoadError, RoutesFileError
from plugserve.registry.manifest import RUNNER_KEYS, Manifest, check_runner_keys, load_manifest
from plugserve.registry.ratelimit import MAX_BURST, MAX_RPS, MIN_RPS, RateLimit
from plugserve.registry.refs import is_valid_name
from plugserve.registry.routing.route_specs import RouteSpecError, load_routes_file, parse_route
from tests.hostile import names, nested, rate_limits, toml_document, values

FAST = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

PLUGIN = {"name": "iris", "version": "1.0.0", "type": "runner"}
runner_tables = st.dictionaries(
    st.sampled_from(sorted(RUNNER_KEYS | ORT_KEYS | {"max_batch_sise"})), values, max_size=5
)
route_tables = st.dictionaries(
    st.sampled_from(["name", "preprocess", "postprocess", "rate_limit", "other"]),
    st.one_of(values, rate_limits),
    max_size=4,
)
manifests = st.fixed_dictionaries(
    {"plugin": st.one_of(st.just(PLUGIN), st.dictionaries(st.sampled_from([*PLUGIN, "module", "description"]), values).map(lambda d: {**PLUGIN, **d}))},
    optional={"runner": st.one_of(runner_tables, values), "route": st.one_of(route_tables, values), "config": values},
)  # fmt: skip


def _rate_limit_in_bounds(limit: RateLimit | None) -> bool:
    return limit is None or (MIN_RPS <= limit.rps <= MAX_RPS and 1 <= limit.burst <= MAX_BURST)


def _sane(manifest: Manifest) -> None:
    """An accepted manifest's numbers are finite and its names whole."""
    runner = manifest.runner
    if runner is not None:
        for number in (
            runner.max_queue_delay_ms,
            runner.breaker_reset_s,
            *runner.tenant_weights.values(),
        ):
            assert math.isfinite(number) and number >= 0
        assert 1 <= runner.instances <= 1024 and 0 <= runner.max_batch_size <= 1_000_000
    assert _rate_limit_in_bounds(manifest.route.rate_limit)
    assert manifest.route.name is None or is_valid_name(manifest.route.name)


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "plugins" / "runner" / "iris" / "1.0.0"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@FAST
@given(raw=manifests)
def test_hostile_manifests_are_manifest_errors_or_sane(tmp_path: Path, raw: dict[str, Any]) -> None:
    folder = _folder(tmp_path)
    (folder / "plugin.toml").write_bytes(toml_document(raw))
    try:
        manifest = load_manifest(folder)
    except ManifestError:
        return
    _sane(manifest)
    with contextlib.suppress(PluginLoadError):  # what the onnxruntime backend is then handed
        check_runner_keys(manifest, "onnxruntime", ORT_KEYS)
        if manifest.runner is not None:
            parse_options(manifest.runner.table, manifest.label)


@FAST
@given(data=st.binary(max_size=200), at=st.integers(min_value=0, max_value=120))
def test_manifests_with_random_bytes_are_manifest_errors(
    tmp_path: Path, data: bytes, at: int
) -> None:
    folder = _folder(tmp_path)
    good = b'[plugin]\nname = "iris"\nversion = "1.0.0"\ntype = "runner"\n[runner]\nbackend = "onnxruntime"\n'
    (folder / "plugin.toml").write_bytes(good[:at] + data + good[at:])
    with contextlib.suppress(ManifestError):
        _sane(load_manifest(folder))


@pytest.mark.parametrize("depth", [31, 33, 100, 400, 500, 1000, 5000])
def test_deep_nesting_in_a_manifest_is_a_manifest_error(tmp_path: Path, depth: int) -> None:
    folder = _folder(tmp_path)
    head = '[plugin]\nname = "iris"\nversion = "1.0.0"\ntype = "runner"\nmodule = "p.py"\n'
    (folder / "plugin.toml").write_text(head + f"[config]\nx = {nested(depth)}\n")
    with pytest.raises(ManifestError, match="deeper than 32"):
        load_manifest(folder)


route_entries = st.one_of(
    st.dictionaries(
        st.sampled_from(["runner", "preprocess", "postprocess", "sticky", "rate_limit", "extra"]),
        st.one_of(values, rate_limits, st.sampled_from(["add", "add@1.0.0"]),
                  st.dictionaries(st.sampled_from(["add@1.0.0", "add@2.0.0", "add", "b@1.0.0"]), values, max_size=3)),
        max_size=5,
    ),
    values,
)  # fmt: skip


@FAST
@given(routes=st.dictionaries(names, route_entries, max_size=3), other=st.one_of(st.none(), values))
def test_hostile_routes_files_are_routes_file_errors_or_sane(
    tmp_path: Path, routes: dict[str, Any], other: Any
) -> None:
    path = tmp_path / "routes.toml"
    document: dict[str, Any] = {"routes": routes}
    if other is not None:
        document["extra"] = other
    path.write_bytes(toml_document(document))
    try:
        specs = load_routes_file(path)
    except RoutesFileError:
        return
    for name, spec in specs.items():
        assert is_valid_name(name) and spec.name == name
        assert _rate_limit_in_bounds(spec.rate_limit)
        assert all(0 <= v.weight <= 1_000_000 for v in spec.variants)


@pytest.mark.parametrize("depth", [33, 500, 5000])
def test_deep_nesting_in_a_routes_file_is_a_routes_file_error(tmp_path: Path, depth: int) -> None:
    path = tmp_path / "routes.toml"
    path.write_text(f'[routes.x]\nrunner = "add"\npreprocess = {nested(depth)}\n')
    with pytest.raises(RoutesFileError, match="deeper than 32"):
        load_routes_file(path)


@FAST
@given(name=names, entry=route_entries)
def test_parse_route_raises_route_spec_errors_only(name: str, entry: Any) -> None:
    """What the admin API and fleet mode hand it, straight from JSON or etcd."""
    try:
        spec = parse_route(name, entry, "admin")
    except RouteSpecError as exc:
        message = str(exc)  # it starts at the entry, for the caller to prefix
    else:
        assert is_valid_name(spec.name) and _rate_limit_in_bounds(spec.rate_limit)
        return
    assert message.startswith((":", ".")), message
