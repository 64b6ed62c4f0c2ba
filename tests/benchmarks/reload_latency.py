"""Reload latency: from the atomic rename of a new version to the first request it answers.

    python -m tests.benchmarks.reload_latency [--rounds 30] [--debounce-ms 200] [--workers 2]
                                              [--isolated]

Starts ``plugserve serve`` as a subprocess on a temporary plugins folder holding
a small runner, then, round after round, writes a new version under a dot name,
renames it into place and polls ``/predict`` over one keep-alive connection
until the new version answers. With ``--workers N`` it also times, from the same
rename, until ``/admin/plugins`` shows the version ready on every worker. Prints
the median, p90 and max. ``--isolated``: the runner in processes of its own
(``isolation = "process"``; every version stays loaded, each in its process).
Not run by CI.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import time
from pathlib import Path

from tests.helpers import ServerProcess, write_plugin

RUNNER = """
import numpy as np
import pluggy

hookimpl = pluggy.HookimplMarker("plugserve")

class Tag:
    def __init__(self, tag):
        self.tag = tag
    def infer(self, inputs):
        return {"tag": np.array([self.tag], dtype=object)}

@hookimpl
def plugserve_create_component(plugin, config):
    return Tag(config["tag"])
"""


def drop(plugins: Path, version: str, runner: str = "") -> float:
    folder = write_plugin(plugins, "runner", "tag", f".{version}.tmp",
                          f'[config]\ntag = "{version}"\n{runner}', {"plugin.py": RUNNER})  # fmt: skip
    manifest = folder / "plugin.toml"
    manifest.write_text(manifest.read_text().replace(f'"{folder.name}"', f'"{version}"'))
    started = time.perf_counter()
    folder.rename(folder.with_name(version))
    return started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--debounce-ms", type=int, default=200)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--isolated", action="store_true")
    args = parser.parse_args()
    runner = '[runner]\nisolation = "process"\n' if args.isolated else ""
    extra = ["--workers", str(args.workers)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plugins, models = root / "plugins", root / "models"
        models.mkdir()
        write_plugin(
            plugins,
            "runner",
            "tag",
            "1.0.0",
            f'[config]\ntag = "1.0.0"\n{runner}',
            {"plugin.py": RUNNER},
        )
        (root / "plugserve.toml").write_text(
            f"reload_debounce_ms = {args.debounce_ms}\nlog_level = 'warning'\n"
        )
        server = ServerProcess("--plugins-dir", str(plugins), "--models-dir", str(models),
                               "--config", str(root / "plugserve.toml"), *extra, log=root / "server.log")  # fmt: skip
        server.wait_ready()
        conn = http.client.HTTPConnection("127.0.0.1", server.port)
        body = json.dumps({"x": [1]})
        latencies, everywhere = [], []
        try:
            for i in range(args.rounds):
                version = f"1.{i + 1}.0"
                started = drop(plugins, version, runner)
                while True:
                    conn.request("POST", "/predict/tag", body, {"Content-Type": "application/json"})
                    answer = json.loads(conn.getresponse().read())
                    if answer["tag"] == [version]:
                        latencies.append(time.perf_counter() - started)
                        break
                    if time.perf_counter() - started > 10:
                        raise SystemExit(f"version {version} never answered:\n{server.log()}")
                if args.workers > 1:
                    while not ready_everywhere(conn, version):
                        if time.perf_counter() - started > 10:
                            raise SystemExit(f"{version} not ready everywhere:\n{server.log()}")
                    everywhere.append(time.perf_counter() - started)
        finally:
            server.stop()
    print(f"reload latency, workers {args.workers}, debounce {args.debounce_ms} ms, "
          f"isolation {'process' if args.isolated else 'none'}, "
          f"{len(latencies)} rounds")  # fmt: skip
    show("rename -> first answer by the new version", latencies)
    if everywhere:
        show("rename -> ready on every worker", everywhere)


def ready_everywhere(conn: http.client.HTTPConnection, version: str) -> bool:
    conn.request("GET", "/admin/plugins")
    rows = json.loads(conn.getresponse().read())["plugins"]
    row = next((r for r in rows if r["version"] == version), None)
    return row is not None and row["state"] == "ready" and "states" not in row


def show(what: str, seconds: list[float]) -> None:
    ms = sorted(x * 1000 for x in seconds)
    p90 = ms[int(0.9 * (len(ms) - 1))]
    print(f"  {what}: p50 {statistics.median(ms):7.1f} ms   p90 {p90:7.1f} ms   "
          f"min {ms[0]:7.1f} ms   max {ms[-1]:7.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
