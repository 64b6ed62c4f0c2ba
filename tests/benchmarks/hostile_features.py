"""The soak's routes and hostile mix for declared batching, images, sequences and rollouts.

:func:`write_plugins` adds four routes to the soak's plugins folder:

- ``padded``: a Python runner whose ``x`` (``[N, H, W]``) is padded on axes 1 and 2 as
  requests batch (``ragged = "pad"``), answering each row's mean over its own ``H x W``
  (``lengths``): the same alone and batched;
- ``vision``: the bundled ``image_decode`` (grey, 32 x 32, stretched) before a runner
  answering each image's mean brightness;
- ``counter``: a sequence runner in the worker (its running sum is the state the server
  keeps), holding a 64 MiB ballast per loaded version, so that a version a reload leaves
  alive shows in the server's RSS;
- ``tally``: two identical sequence versions, 2.0.0 a shadow canary of 1.0.0 under a
  rollout that copies every sequence it may.

Good traffic (:func:`good_clients`): padded requests of random sizes, small PNGs, whole
sequences on ``counter`` and ``tally``, each answer checked (a wrong one counts as a
failed good request). :func:`churn` edits ``counter``'s version every few seconds. The
hostile mix (:func:`start`): pairs of padded requests wide on different axes, sent
together (a padded batch of both would hold 144 M elements); GIF bombs (six 35-byte GIFs of
1 x 1 frames on 6000 x 6000 screens in one request; 120 tiny GIFs of 2000 x 2000 screens);
sequences started and dropped without their end. :func:`verdict` reads the rollout's state,
the shadow comparisons and the canary's statistics at the end.
"""

from __future__ import annotations

import http.client
import io
import json
import random
import shutil
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tests.benchmarks import hostile
from tests.helpers import ROOT, write_plugin

AddGood = Callable[[str, int, float], None]

PADDED = """
import numpy as np
import pluggy
hookimpl = pluggy.HookimplMarker("plugserve")

class MaskedMean:
    def infer(self, inputs):
        x, size = inputs["x"], inputs["size"]
        return {"y": np.array([x[i, :h, :w].mean() for i, (h, w) in enumerate(size)],
                              dtype=np.float32)}

@hookimpl
def plugserve_create_component(plugin, config):
    return MaskedMean()
"""

PADDED_MANIFEST = (
    "[runner]\nmax_batch_size = 8\nmax_queue_delay_ms = 2\n"
    '[runner.batching.inputs]\nx = { ragged = "pad", ragged_axes = [1, 2], lengths = "size" }\n'
)

BRIGHTNESS = """
import numpy as np
import pluggy
hookimpl = pluggy.HookimplMarker("plugserve")

class Brightness:
    def infer(self, inputs):
        images = inputs["images"]
        return {"y": images.reshape(len(images), -1).mean(axis=1).astype(np.float32)}

@hookimpl
def plugserve_create_component(plugin, config):
    return Brightness()
"""

IMAGE_CONFIG = {
    "input": "image", "output": "images", "mode": "L", "size": [32, 32], "resize": "stretch",
    "scale": 1 / 255, "mean": [], "std": [], "layout": "NCHW", "datatype": "FP32",
}  # fmt: skip

SUM = """
import numpy as np
import pluggy
hookimpl = pluggy.HookimplMarker("plugserve")

class RunningSum:
    def __init__(self, ballast_mib):
        self.ballast = np.ones(ballast_mib << 18, np.float32)  # touched: resident

    def infer(self, inputs):
        total = inputs["total"] + inputs["x"]
        return {"y": total, "total_out": total}

    def metadata(self):
        return {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 1]},
                       {"name": "total", "datatype": "FP32", "shape": [-1, 1]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 1]}],
        }

@hookimpl
def plugserve_create_component(plugin, config):
    return RunningSum(int(config["ballast_mib"]))
"""


def sum_manifest(ballast_mib: int, generation: int = 1, isolated: bool = False) -> str:
    """A sequence runner's manifest; ``isolated`` (with several workers, which reach one
    sequence's state only through runner processes): ``isolation = "process"``."""
    isolation = 'isolation = "process"\n' if isolated else ""
    return (
        f"[config]\nballast_mib = {ballast_mib}\ngeneration = {generation}\n"
        f"[runner]\nmax_batch_size = 8\nmax_queue_delay_ms = 1\n{isolation}"
        "[runner.sequence]\nidle_timeout_s = 10\n"
        '[[runner.sequence.state]]\ninput = "total"\noutput = "total_out"\n'
        'datatype = "FP32"\nshape = [1]\n'
    )


COUNTER_BALLAST_MIB = 64
SEQUENCE_STEPS = 6
ROLLOUT = {
    "canary": "tally@2.0.0", "steps": [0, 50, 100], "shadow": 1.0,
    "min_requests": 300, "min_seconds": 30,
}  # fmt: skip
"""``tally``'s rollout: shadow copies first (a step of 0), then half and all the traffic."""


def write_plugins(plugins: Path, workers: int = 1) -> None:
    write_plugin(plugins, "runner", "padded", "1.0.0", PADDED_MANIFEST, {"plugin.py": PADDED})
    shutil.copytree(ROOT / "plugins" / "preprocessor" / "image_decode" / "1.0.0",
                    plugins / "preprocessor" / "image_decode" / "1.0.0")  # fmt: skip
    decode = plugins / "preprocessor" / "image_decode" / "1.0.0" / "plugin.toml"
    text = decode.read_text()
    config = "".join(f"{k} = {json.dumps(v)}\n" for k, v in IMAGE_CONFIG.items())
    head, _, _ = text.partition("[config]")
    decode.write_text(head + "[config]\n" + config)
    write_plugin(plugins, "runner", "vision", "1.0.0",
                 '[runner]\nmax_batch_size = 8\n[route]\npreprocess = ["image_decode"]\n',
                 {"plugin.py": BRIGHTNESS})  # fmt: skip
    isolated = workers > 1
    write_plugin(plugins, "runner", "counter", "1.0.0",
                 sum_manifest(COUNTER_BALLAST_MIB, isolated=isolated), {"plugin.py": SUM})  # fmt: skip
    for version in ("1.0.0", "2.0.0"):
        write_plugin(plugins, "runner", "tally", version, sum_manifest(1, isolated=isolated),
                     {"plugin.py": SUM})  # fmt: skip


def start_rollout(port: int) -> None:
    """``tally``'s rollout: 2.0.0 (the same code) a shadow canary of 1.0.0."""
    body = json.dumps({"runner": "tally@1.0.0", "rollout": ROLLOUT}).encode()
    status, text = _call(port, "PUT", "/admin/routes/tally", body)
    if status != 200:
        raise RuntimeError(f"the rollout did not start: {status} {text}")


def churn(plugins: Path, stop: threading.Event, every: float, log: list[str]) -> None:
    """Edit ``counter``'s version in place (a reload) while its sequences run."""
    manifest = plugins / "runner" / "counter" / "1.0.0" / "plugin.toml"
    generation = 1
    while not stop.wait(every):
        generation += 1
        text = manifest.read_text()
        manifest.write_text(text.replace(f"generation = {generation - 1}\n",
                                         f"generation = {generation}\n"))  # fmt: skip
        log.append(f"counter reloaded (generation {generation})")


# -- requests -----------------------------------------------------------------------------


def _call(port: int, method: str, path: str, body: bytes | None = None,
          conn: http.client.HTTPConnection | None = None) -> tuple[int, str]:  # fmt: skip
    own = conn is None
    conn = conn or http.client.HTTPConnection(hostile.HOST, port, timeout=30)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode(errors="replace")
    finally:
        if own:
            conn.close()


def padded_body(h: int, w: int, value: float) -> bytes:
    raw = np.full((1, h, w), value, np.float32).tobytes()
    inputs = [{"name": "x", "datatype": "FP32", "shape": [1, h, w],
               "parameters": {"binary_data_size": len(raw)}}]  # fmt: skip
    header = json.dumps({"inputs": inputs}).encode()
    return header + raw


def png(width: int, height: int, grey: int) -> bytes:
    out = io.BytesIO()
    Image.new("L", (width, height), grey).save(out, "PNG")
    return out.getvalue()


def gif_on_screen(screen: int) -> bytes:
    """A GIF of one 1 x 1 frame on a ``screen`` x ``screen`` logical screen (35 bytes): a
    decoder that takes the screen as the picture paints ``screen**2`` pixels."""
    return (
        b"GIF89a" + struct.pack("<HHBBB", screen, screen, 0, 0, 0)
        + b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0x80) + b"\x00\x00\x00\xff\xff\xff"
        + b"\x02\x02\x44\x01\x00" + b"\x3b"
    )  # fmt: skip


def images_body(images: list[bytes]) -> tuple[bytes, dict[str, str]]:
    blob = hostile.bytes_elements(*images)
    inputs = [{"name": "image", "datatype": "BYTES", "shape": [len(images)],
               "parameters": {"binary_data_size": len(blob)}}]  # fmt: skip
    return hostile.binary_request(inputs, blob)


def _binary_post(conn: http.client.HTTPConnection, path: str, body: bytes,
                 headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:  # fmt: skip
    conn.request("POST", path, body, headers)
    response = conn.getresponse()
    return response.status, response.read(), dict(response.getheaders())


def _first_output(raw: bytes, headers: dict[str, str]) -> np.ndarray:
    """The first output of a v2 answer, JSON or binary."""
    length = headers.get("Inference-Header-Content-Length")
    if length is None:
        doc = json.loads(raw)
        return np.asarray(doc["outputs"][0]["data"], np.float32)
    head = json.loads(raw[: int(length)])
    size = head["outputs"][0].get("parameters", {}).get("binary_data_size")
    if size is None:
        return np.asarray(head["outputs"][0]["data"], np.float32)
    return np.frombuffer(raw[int(length) : int(length) + size], np.float32)


def _checked(status: int, got: np.ndarray | None, want: float) -> int:
    """An answer's status as the soak counts it: 200 only when the value is right too (a
    wrong value counts as 299)."""
    if status != 200 or got is None:
        return status
    return 200 if got.size and np.allclose(got, want, atol=1e-3) else 299


def good_padded(port: int, stop: threading.Event, seed: int, add: AddGood) -> None:
    rng = random.Random(seed)
    conn = http.client.HTTPConnection(hostile.HOST, port, timeout=30)
    while not stop.wait(0.02):
        h, w, value = rng.randint(1, 24), rng.randint(1, 24), rng.random()
        body = padded_body(h, w, value)
        header = len(body) - h * w * 4
        started = time.perf_counter()
        try:
            status, raw, headers = _binary_post(conn, "/v2/models/padded/infer", body, {
                "Content-Type": "application/octet-stream",
                "Inference-Header-Content-Length": str(header)})  # fmt: skip
            got = _first_output(raw, headers) if status == 200 else None
        except (OSError, http.client.HTTPException):
            status, got = -1, None
            conn.close()
            conn = http.client.HTTPConnection(hostile.HOST, port, timeout=30)
        add("padded", _checked(status, got, value), time.perf_counter() - started)


def good_images(port: int, stop: threading.Event, seed: int, add: AddGood) -> None:
    rng = random.Random(seed)
    conn = http.client.HTTPConnection(hostile.HOST, port, timeout=30)
    while not stop.wait(0.05):
        grey = rng.randint(0, 255)
        body, headers = images_body([png(rng.randint(8, 96), rng.randint(8, 96), grey)])
        started = time.perf_counter()
        try:
            status, raw, answer = _binary_post(conn, "/v2/models/vision/infer", body, headers)
            got = _first_output(raw, answer) if status == 200 else None
        except (OSError, http.client.HTTPException):
            status, got = -1, None
            conn.close()
            conn = http.client.HTTPConnection(hostile.HOST, port, timeout=30)
        add("image PNG", _checked(status, got, grey / 255), time.perf_counter() - started)


def good_sequences(port: int, stop: threading.Event, seed: int, add: AddGood,
                   route: str) -> None:  # fmt: skip
    """Whole sequences of ``SEQUENCE_STEPS`` requests; each answer is the running sum."""
    rng = random.Random(seed)
    conn = http.client.HTTPConnection(hostile.HOST, port, timeout=30)
    kind = f"sequence {route}"
    while not stop.is_set():
        sid = f"{seed}-{rng.getrandbits(48):x}"
        total = 0.0
        for step in range(SEQUENCE_STEPS):
            x = float(rng.randint(1, 9))
            total += x
            doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [x]}],
                   "parameters": {"sequence_id": sid, "sequence_start": step == 0,
                                  "sequence_end": step == SEQUENCE_STEPS - 1}}  # fmt: skip
            started = time.perf_counter()
            try:
                status, raw, headers = _binary_post(conn, f"/v2/models/{route}/infer",
                                                    json.dumps(doc).encode(),
                                                    {"Content-Type": "application/json"})  # fmt: skip
                got = _first_output(raw, headers) if status == 200 else None
            except (OSError, http.client.HTTPException):
                status, got = -1, None
                conn.close()
                conn = http.client.HTTPConnection(hostile.HOST, port, timeout=30)
            add(kind, _checked(status, got, total), time.perf_counter() - started)
            if status != 200:
                break
        stop.wait(0.01)


def good_clients(port: int, stop: threading.Event, add: AddGood) -> list[threading.Thread]:
    targets: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (good_padded, (port, stop, 301, add)),
        (good_images, (port, stop, 302, add)),
        (good_sequences, (port, stop, 303, add, "counter")),
        (good_sequences, (port, stop, 304, add, "counter")),
        (good_sequences, (port, stop, 305, add, "tally")),
        (good_sequences, (port, stop, 306, add, "tally")),
    ]
    threads = [threading.Thread(target=t, args=a, daemon=True, name=t.__name__)
               for t, a in targets]  # fmt: skip
    for thread in threads:
        thread.start()
    return threads


# -- the hostile mix ----------------------------------------------------------------------

WIDE = 12_000
"""A padded request ``[1, 1, WIDE]`` beside ``[1, WIDE, 1]``: 48 KB each, a padded batch of
both ``WIDE**2`` (144 M) elements."""


def padded_pairs(port: int, stop: threading.Event, outcomes: hostile.Outcomes,
                 mix: hostile.Mix) -> None:  # fmt: skip
    """Two requests wide on different axes, sent together, over and over."""
    bodies = [padded_body(1, WIDE, 1.0), padded_body(WIDE, 1, 1.0)]

    def send(i: int, results: list[str]) -> None:
        body = bodies[i]
        headers = {"Content-Type": "application/octet-stream",
                   "Inference-Header-Content-Length": str(len(body) - WIDE * 4)}  # fmt: skip
        results[i] = hostile.post(port, "/v2/models/padded/infer", body, headers, 30)

    for _ in hostile.paced(stop, 0.5, mix):
        results = ["", ""]
        pair = [threading.Thread(target=send, args=(i, results)) for i in range(2)]
        for thread in pair:
            thread.start()
        for thread in pair:
            thread.join()
        for outcome in results:
            outcomes.add(f"padded pair [1,1,{WIDE}] + [1,{WIDE},1]", outcome)


def image_bombs(port: int, stop: threading.Event, outcomes: hostile.Outcomes,
                mix: hostile.Mix) -> None:  # fmt: skip
    """GIFs whose screens are far larger than their bytes, many to a request."""
    kinds = {
        "six 35-byte GIFs on 6000x6000 screens": [gif_on_screen(6000)] * 6,
        "120 tiny GIFs on 2000x2000 screens": [gif_on_screen(2000)] * 120,
    }
    prepared = {kind: images_body(images) for kind, images in kinds.items()}
    for attempt in hostile.paced(stop, 0.5, mix):
        kind = list(prepared)[attempt % len(prepared)]
        body, headers = prepared[kind]
        outcomes.add(f"image bomb: {kind}", hostile.post(port, "/v2/models/vision/infer",
                                                        body, headers, 30))  # fmt: skip


def dropped_sequences(port: int, stop: threading.Event, outcomes: hostile.Outcomes,
                      mix: hostile.Mix) -> None:  # fmt: skip
    """Sequences started on ``counter`` and left without their end (they expire)."""
    for attempt in hostile.paced(stop, 0.05, mix):
        doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}],
               "parameters": {"sequence_id": f"dropped-{attempt}", "sequence_start": True}}  # fmt: skip
        outcome = hostile.post(port, "/v2/models/counter/infer", json.dumps(doc).encode(),
                               {"Content-Type": "application/json"}, 30)  # fmt: skip
        outcomes.add("sequence started and dropped", outcome)


def start(port: int, stop: threading.Event, outcomes: hostile.Outcomes,
          mix: hostile.Mix) -> list[threading.Thread]:  # fmt: skip
    kinds = [padded_pairs, image_bombs, dropped_sequences]
    threads = [threading.Thread(target=k, args=(port, stop, outcomes, mix), daemon=True,
                                name=k.__name__) for k in kinds]  # fmt: skip
    for thread in threads:
        thread.start()
    return threads


# -- the verdict --------------------------------------------------------------------------


def verdict(port: int) -> tuple[list[str], bool]:
    """What the rollout of ``tally`` came to, its shadow comparisons and the canary's
    statistics: lines to print, and whether they are as they should be (not rolled back;
    no copy failed or differed; the canary's statistics count only what it served)."""
    lines: list[str] = []
    _, text = _call(port, "GET", "/admin/routes/tally/rollout")
    status = json.loads(text)["rollout"]["status"]
    lines.append(f"tally rollout: {status['state']} at step {status['step']}: "
                 f"{status.get('reason') or ''}")  # fmt: skip
    _, metrics = _call(port, "GET", "/metrics")
    shadow = {}
    for line in metrics.splitlines():
        if line.startswith("plugserve_shadow_requests_total{") and 'route="tally"' in line:
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            shadow[outcome] = int(float(line.rsplit(" ", 1)[1]))
    lines.append(f"tally shadow copies by outcome: {shadow}")
    _, stats = _call(port, "GET", "/v2/models/tally/versions/2.0.0/stats")
    served = sum(m.get("inference_count", 0) for m in json.loads(stats).get("model_stats", []))
    lines.append(f"tally@2.0.0 inference_count (Triton statistics): {served}")
    ok = (
        status["state"] != "rolled_back"
        and shadow.get("agreed", 0) > 0
        and not shadow.get("differed")
        and not shadow.get("failed")
    )
    return lines, ok
