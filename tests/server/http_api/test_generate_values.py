"""What generate sends of the values a runner may yield (attack16): numpy text arrays as lists of
texts, and a value JSON cannot hold as an error naming the runner, never a cut stream."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import ServerProcess, write_plugin
from tests.server.http_api.test_generate import sse

pytestmark = pytest.mark.slow

ODD_VALUES = """
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Odd:
        def metadata(self):
            return {"inputs": [{"name": "n", "datatype": "INT64", "shape": [1]}]}

        def infer(self, inputs):
            yield {"words": np.array(["a", "bc"]), "raw": np.array([b"x", b"yz"])}
            if int(inputs["n"][0]) == 2:
                yield {"z": np.array([1 + 2j, 3j])}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Odd()
"""


def test_text_arrays_are_lists_and_a_value_json_cannot_hold_names_the_runner(
    plugins_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    write_plugin(plugins_dir, "runner", "odd", "1.0.0", files={"plugin.py": ODD_VALUES})
    proc = server("--plugins-dir", str(plugins_dir))
    status, _, body = proc.request("POST", "/v2/models/odd/generate_stream", {"n": [1]})
    assert status == 200 and sse(body) == [
        {"model_name": "odd", "model_version": "1.0.0", "words": ["a", "bc"], "raw": ["x", "yz"]}
    ]
    status, _, body = proc.request("POST", "/v2/models/odd/generate", {"n": [1]})
    assert status == 200 and json.loads(body)["words"] == ["a", "bc"], body
    # Complex numbers: the stream's last event is the error, naming the runner.
    status, _, body = proc.request("POST", "/v2/models/odd/generate_stream", {"n": [2]})
    events = sse(body)
    assert status == 200 and events[0]["words"] == ["a", "bc"]
    assert "runner/odd@1.0.0" in events[-1]["error"] and len(events) == 2, events
    status, _, body = proc.request("POST", "/v2/models/odd/generate", {"n": [2]})
    assert status == 500 and "runner/odd@1.0.0" in json.loads(body)["error"], body
