"""What a whole-server answer costs with many workers: ``/metrics`` and ``/admin/plugins``.

    python -m tests.benchmarks.scrape [--workers 1 2 8] [--versions 20] [--calls 50]

Starts ``plugserve serve --workers N`` for each N on a plugins folder of
``--versions`` runner versions, sends traffic so every series exists, then
times ``GET /metrics`` and ``GET /admin/plugins`` one after another (the
supervisor asks every worker and merges). Prints the median and p90 per N.
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

class Echo:
    def infer(self, inputs):
        return {"y": np.asarray(inputs["x"])}

@hookimpl
def plugserve_create_component(plugin, config):
    return Echo()
"""


def timed(conn: http.client.HTTPConnection, path: str, calls: int) -> tuple[list[float], int]:
    seconds, size = [], 0
    for _ in range(calls):
        started = time.perf_counter()
        conn.request("GET", path)
        response = conn.getresponse()
        size = len(response.read())
        seconds.append(time.perf_counter() - started)
        assert response.status == 200, path
    return seconds, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plugins, models = root / "plugins", root / "models"
        models.mkdir()
        for i in range(args.versions):
            write_plugin(plugins, "runner", f"echo{i}", "1.0.0", "", {"plugin.py": RUNNER})
        print(f"{args.versions} runner versions; medians of {args.calls} calls")
        for workers in args.workers:
            extra = ["--workers", str(workers)] if workers > 1 else []
            server = ServerProcess("--plugins-dir", str(plugins), "--models-dir", str(models),
                                   "--log-level", "warning", *extra,
                                   log=root / f"server{workers}.log")  # fmt: skip
            try:
                server.wait_ready(120)
                conn = http.client.HTTPConnection("127.0.0.1", server.port)
                deadline = time.monotonic() + 120
                while workers > 1 and time.monotonic() < deadline:
                    conn.request("GET", "/admin/status")
                    if len(json.loads(conn.getresponse().read())["workers"]) == workers:
                        break
                    time.sleep(0.2)
                for i in range(args.versions):  # every series exists, in every worker
                    for _ in range(workers * 4):
                        fresh = http.client.HTTPConnection("127.0.0.1", server.port)
                        fresh.request("POST", f"/predict/echo{i}", json.dumps({"x": [1.0]}),
                                      {"Content-Type": "application/json"})  # fmt: skip
                        fresh.getresponse().read()
                        fresh.close()
                for path in ("/metrics", "/admin/plugins"):
                    seconds, size = timed(conn, path, args.calls)
                    ms = sorted(s * 1000 for s in seconds)
                    print(f"  workers {workers:2}  {path:15} p50 {statistics.median(ms):6.1f} ms"
                          f"  p90 {ms[int(0.9 * (len(ms) - 1))]:6.1f} ms  {size / 1024:6.1f} KiB")  # fmt: skip
            finally:
                server.stop()


if __name__ == "__main__":
    main()
