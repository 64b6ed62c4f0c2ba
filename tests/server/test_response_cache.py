"""The response cache end to end: a real server, tritonclient.http unchanged, a runner that
counts its executions into a file."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.helpers import ServerProcess, metric, until, write_plugin, write_processor

pytestmark = pytest.mark.slow

COUNTING_RUNNER = """
    from pathlib import Path

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Counting:
        def __init__(self, calls, scale):
            self.calls = Path(calls)
            self.scale = scale

        def infer(self, inputs):
            with self.calls.open("a") as out:
                out.write("call\\n")
            return {"y": np.asarray(inputs["x"], dtype=np.float32) * self.scale}

        def metadata(self):
            spec = {"datatype": "FP32", "shape": [-1, 2]}
            return {"inputs": [{"name": "x", **spec}], "outputs": [{"name": "y", **spec}]}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Counting(config["calls"], config["scale"])
"""


def write_counter(
    plugins_dir: Path,
    name: str,
    calls: Path,
    scale: float = 2,
    cache: bool = True,
    runner: str = "",
) -> Path:
    """A runner ``y = (x + shift) * scale`` writing a line to ``calls`` per execution."""
    return write_plugin(
        plugins_dir,
        "runner",
        name,
        "1.0.0",
        f'[config]\ncalls = "{calls}"\nscale = {scale}\n'
        f"[runner]\nresponse_cache = {'true' if cache else 'false'}\n{runner}"
        '[route]\npreprocess = ["shift"]\n',
        {"plugin.py": COUNTING_RUNNER},
    )


@pytest.fixture
def srv(
    tmp_path: Path, plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> ServerProcess:
    write_processor(plugins_dir, "preprocessor", "shift", "1.0.0", amount=0)
    write_counter(plugins_dir, "count", tmp_path / "count.calls")
    write_counter(plugins_dir, "plain", tmp_path / "plain.calls", cache=False)
    return server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))


@pytest.fixture
def triton(srv: ServerProcess) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{srv.port}")
    yield client
    client.close()


def calls(tmp_path: Path, route: str = "count") -> int:
    path = tmp_path / f"{route}.calls"
    return len(path.read_text().splitlines()) if path.exists() else 0


def infer(srv: ServerProcess, values: list[float], route: str = "count", **kw: Any) -> np.ndarray:
    """One request on a connection of its own (with workers, any of them may answer)."""
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{srv.port}")
    try:
        inp = httpclient.InferInput("x", [1, len(values)], "FP32")
        inp.set_data_from_numpy(np.array([values], dtype=np.float32), **kw)
        return client.infer(route, [inp]).as_numpy("y")  # type: ignore[no-any-return]
    finally:
        client.close()


def cache_stats(triton: httpclient.InferenceServerClient, route: str = "count") -> dict[str, Any]:
    (entry,) = triton.get_inference_statistics(route)["model_stats"]
    return entry  # type: ignore[no-any-return]


def loaded_at(srv: ServerProcess, label: str) -> str:
    _, _, body = srv.request("GET", "/admin/plugins")
    rows = json.loads(body)["plugins"]
    (row,) = [r for r in rows if f"{r['type']}/{r['name']}@{r['version']}" == label]
    return str(row["loaded_at"])


@pytest.mark.workers(1, 2)
def test_a_repeated_request_is_a_hit_counted_in_statistics_and_metrics(
    tmp_path: Path, srv: ServerProcess, triton: httpclient.InferenceServerClient, workers: int
) -> None:
    for binary in (True, False, True, False, True, False):  # encoding is per request
        np.testing.assert_array_equal(infer(srv, [1, 2], binary_data=binary), [[2, 4]])
    misses = calls(tmp_path)
    assert 1 <= misses <= workers  # each worker's cache misses once at most
    entry = cache_stats(triton)
    stats = entry["inference_stats"]
    assert stats["cache_miss"]["count"] == misses
    assert stats["cache_hit"]["count"] == 6 - misses
    assert stats["cache_hit"]["ns"] > 0
    assert stats["success"]["count"] == 6 and entry["inference_count"] == 6
    assert entry["execution_count"] == misses  # a hit executes nothing
    assert metric(srv, "plugserve_response_cache_hits_total", route="count") == 6 - misses
    assert metric(srv, "plugserve_response_cache_misses_total", route="count") == misses
    assert metric(srv, "plugserve_response_cache_entries") == misses
    assert metric(srv, "plugserve_response_cache_bytes") > 0
    # A different input is a miss: computed, then kept.
    np.testing.assert_array_equal(infer(srv, [1, 3]), [[2, 6]])
    assert calls(tmp_path) == misses + 1
    assert cache_stats(triton)["inference_stats"]["cache_miss"]["count"] == misses + 1


def test_predict_is_cached_too(tmp_path: Path, srv: ServerProcess) -> None:
    for _ in range(3):
        status, _, body = srv.request("POST", "/predict/count", {"x": [[1, 2]]})
        assert status == 200 and json.loads(body) == {"y": [[2.0, 4.0]]}
    assert calls(tmp_path) == 1
    status, _, body = srv.request("POST", "/predict/count", {"x": [[2, 2]]})
    assert json.loads(body) == {"y": [[4.0, 4.0]]} and calls(tmp_path) == 2


def test_a_reload_of_the_runner_invalidates_even_at_the_same_version(
    tmp_path: Path, plugins_dir: Path, srv: ServerProcess
) -> None:
    label = "runner/count@1.0.0"
    infer(srv, [1, 2])
    infer(srv, [1, 2])
    assert calls(tmp_path) == 1
    before = loaded_at(srv, label)
    source = plugins_dir / "runner" / "count" / "1.0.0" / "plugin.py"
    source.write_text(source.read_text() + "\n# edited: the same answer, a new load\n")
    until(lambda: loaded_at(srv, label) != before, 15)
    np.testing.assert_array_equal(infer(srv, [1, 2]), [[2, 4]])
    assert calls(tmp_path) == 2  # computed again by the new load
    infer(srv, [1, 2])
    assert calls(tmp_path) == 2  # and kept
    before = loaded_at(srv, label)
    write_counter(plugins_dir, "count", tmp_path / "count.calls", scale=3)
    until(lambda: loaded_at(srv, label) != before, 15)
    np.testing.assert_array_equal(infer(srv, [1, 2]), [[3, 6]])


def test_a_reload_of_a_preprocessor_in_the_chain_invalidates(
    tmp_path: Path, plugins_dir: Path, srv: ServerProcess
) -> None:
    label = "preprocessor/shift@1.0.0"
    infer(srv, [1, 2])
    infer(srv, [1, 2])
    assert calls(tmp_path) == 1
    before = loaded_at(srv, label)
    write_processor(plugins_dir, "preprocessor", "shift", "1.0.0", amount=10)
    until(lambda: loaded_at(srv, label) != before, 15)
    np.testing.assert_array_equal(infer(srv, [1, 2]), [[22, 24]])
    assert calls(tmp_path) == 2


def test_a_route_without_response_cache_never_caches(
    tmp_path: Path, srv: ServerProcess, triton: httpclient.InferenceServerClient
) -> None:
    for _ in range(3):
        np.testing.assert_array_equal(infer(srv, [1, 2], route="plain"), [[2, 4]])
    assert calls(tmp_path, "plain") == 3
    stats = cache_stats(triton, "plain")["inference_stats"]
    assert stats["cache_hit"]["count"] == 0 and stats["cache_miss"]["count"] == 0
    _, _, body = srv.request("GET", "/metrics")
    assert 'route="plain"' not in "\n".join(
        line for line in body.decode().splitlines() if "response_cache" in line
    )


def test_response_cache_bytes_0_turns_it_off(
    tmp_path: Path, plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_processor(plugins_dir, "preprocessor", "shift", "1.0.0", amount=0)
    write_counter(plugins_dir, "count", tmp_path / "count.calls")
    config = tmp_path / "plugserve.toml"
    config.write_text("response_cache_bytes = 0\n")
    srv = server(
        "--config", str(config), "--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir)
    )
    for _ in range(2):
        infer(srv, [1, 2])
    assert calls(tmp_path) == 2


def test_an_isolated_runner_is_cached_in_the_worker(
    tmp_path: Path, plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_processor(plugins_dir, "preprocessor", "shift", "1.0.0", amount=0)
    write_counter(plugins_dir, "count", tmp_path / "count.calls", runner='isolation = "process"\n')
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    for _ in range(3):
        np.testing.assert_array_equal(infer(srv, [1, 2]), [[2, 4]])
    assert calls(tmp_path) == 1
    _, _, body = srv.request("GET", "/v2/models/count/stats")
    (entry,) = json.loads(body)["model_stats"]
    assert entry["inference_stats"]["cache_hit"]["count"] == 2
    assert entry["execution_count"] == 1
