"""Memory across reloads: a runner that leaks natively at every load, in the worker and isolated.

    python -m tests.benchmarks.leak [--reloads 200] [--leak-mib 16] [--workers 1]

The runner's component ``malloc``s and touches ``--leak-mib`` MiB that it never
frees (a native leak, as a C extension or a framework's allocator has). One
server runs it in the worker (``isolation = "none"``), one in a process of its
own (``isolation = "process"``); each is reloaded ``--reloads`` times through
the admin API, alternately, a request served after each reload. Prints the
resident memory of each server's whole process tree after the first load and
after the last reload, and the time a reload took (median). Not run by CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from tests.helpers import ServerProcess, tree_rss_mib, write_plugin

LEAKY = """
    import ctypes
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Leaky:
        def __init__(self, mib):
            libc = ctypes.CDLL(None)
            libc.malloc.restype = ctypes.c_void_p
            block = libc.malloc(mib << 20)  # never freed
            ctypes.memset(block, 1, mib << 20)  # touched: resident

        def infer(self, inputs):
            return {"y": inputs["x"]}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Leaky(config["mib"])
"""
BODY = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reloads", type=int, default=200)
    parser.add_argument("--leak-mib", type=int, default=16)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plugserve-leak-"))
    servers: dict[str, ServerProcess] = {}
    try:
        for mode in ("none", "process"):
            plugins = work / mode / "plugins"
            manifest = f'[config]\nmib = {args.leak_mib}\n[runner]\nisolation = "{mode}"\n'
            write_plugin(plugins, "runner", "leaky", "1.0.0", manifest, {"plugin.py": LEAKY})
            extra = ["--workers", str(args.workers)] if args.workers > 1 else []
            servers[mode] = ServerProcess(
                "--plugins-dir", str(plugins), "--models-dir", str(work / mode / "models"),
                "--log-level", "warning", *extra, log=work / f"{mode}.log",
            ).wait_ready(60)  # fmt: skip
        first: dict[str, float] = {}
        took: dict[str, list[float]] = {mode: [] for mode in servers}
        for mode, srv in servers.items():
            assert srv.request("POST", "/v2/models/leaky/infer", BODY)[0] == 200
            first[mode] = tree_rss_mib(srv.proc.pid)
        for n in range(args.reloads):
            for mode, srv in servers.items():
                started = time.perf_counter()
                code, _, body = srv.request("POST", "/admin/plugins/runner/leaky/1.0.0/reload")
                took[mode].append(time.perf_counter() - started)
                if code != 200:
                    raise SystemExit(f"{mode}: reload {n} answered {code}: {body[:300]!r}")
                assert srv.request("POST", "/v2/models/leaky/infer", BODY)[0] == 200
        print(f"{args.reloads} reloads of a runner leaking {args.leak_mib} MiB at each load "
              f"(workers {args.workers}):")  # fmt: skip
        for mode, srv in servers.items():
            last = tree_rss_mib(srv.proc.pid)
            _, _, raw = srv.request("GET", "/admin/plugins")
            row = json.loads(raw)["plugins"][0]
            print(f"  isolation = {mode!r:10} RSS of the tree after the first load {first[mode]:7.0f} MiB, "
                  f"after {args.reloads} reloads {last:7.0f} MiB ({last - first[mode]:+.0f} MiB); "
                  f"reload p50 {statistics.median(took[mode]) * 1000:.0f} ms; "
                  f"processes now {len(row.get('pids', [])) or 'in the worker'}")  # fmt: skip
    finally:
        for srv in servers.values():
            srv.stop()


if __name__ == "__main__":
    main()
