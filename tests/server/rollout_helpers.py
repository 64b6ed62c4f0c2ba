"""What the rollout tests share: a runner whose versions can fail, be slow or answer
differently, a load that drives real requests while a rollout moves, and reads of it."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests import helpers
from tests.helpers import ServerProcess, write_plugin

MODEL = """
    import threading
    import time

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Model:
        def __init__(self, config, invalid):
            self.invalid = invalid
            self.delay_s = config.get("delay_s", 0.0)
            self.fail_every = config.get("fail_every", 0)
            self.offset = config.get("offset", 0.0)
            self.count = 0
            self.lock = threading.Lock()

        def infer(self, inputs):
            with self.lock:
                self.count += 1
                n = self.count
            if self.delay_s:
                time.sleep(self.delay_s)
            first = float(np.asarray(inputs["x"]).flat[0])
            if first == 0:
                raise self.invalid("x starts with 0: every version refuses it")
            if first < 0:
                raise RuntimeError("x starts below 0: every version fails it")
            if self.fail_every and n % self.fail_every == 0:
                raise RuntimeError(f"request {n} fails: one in {self.fail_every}")
            return {"y": np.asarray(inputs["x"]) * 2 + self.offset}

    class Strict(Model):  # declares 5 columns: refuses (400) what the others take
        def metadata(self):
            return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 5]}]}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return (Strict if config.get("strict") else Model)(config, plugin.InvalidInput)
"""

X = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
REFUSED = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0, 2, 3, 4]}]}
"""Refused by every version, once placed on one (400): the model refuses an ``x`` starting
with 0."""
CRASHING = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [-1, 2, 3, 4]}]}
"""Failed by every version (500): the model raises on a negative ``x``."""


def write_model(plugins_dir: Path, version: str, on_demand: bool = False, **config: float) -> None:
    """Version ``version`` of runner ``m``: ``y = 2x + offset``, after ``delay_s``,
    failing every ``fail_every``-th request (``strict``: refusing the inputs others take)."""
    lines = "".join(f"{k} = {v}\n" for k, v in config.items())
    load = 'load = "on_demand"\n' if on_demand else ""
    write_plugin(
        plugins_dir, "runner", "m", version,
        f"[config]\n{lines}[runner]\nmax_batch_size = 0\n{load}",
        files={"plugin.py": MODEL},
    )  # fmt: skip


def write_config(path: Path, **settings: Any) -> Path:
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))
    return path


def rollout(server: ServerProcess, route: str = "m") -> dict[str, Any]:
    status, _, body = server.request("GET", f"/admin/routes/{route}/rollout")
    assert status == 200, body
    return json.loads(body)["rollout"]  # type: ignore[no-any-return]


def put_rollout(server: ServerProcess, entry: dict[str, Any], route: str = "m") -> dict[str, Any]:
    status, _, body = server.request("PUT", f"/admin/routes/{route}", entry)
    assert status == 200, body
    return json.loads(body)  # type: ignore[no-any-return]


class Load:
    """Clients sending requests to ``servers`` (in turn) until stopped; every answer kept
    with the variant that served it."""

    def __init__(self, servers: Sequence[ServerProcess], clients: int = 4, route: str = "m"):
        self.servers = list(servers)
        self.route = route
        self.answers: list[tuple[int, str, float, int]] = []
        """(status, variant, when, the server's port) of every request."""
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]
        self._lock = threading.Lock()

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _client(self, index: int) -> None:
        turn = index
        while not self._stop.is_set():
            servers = self.servers
            server = servers[turn % len(servers)]
            turn += 1
            try:
                status, headers, _ = server.request("POST", f"/v2/models/{self.route}/infer", X)
            except OSError:
                status, headers = 0, {}
            with self._lock:
                self.answers.append(
                    (status, headers.get("X-Plugserve-Variant", ""), time.monotonic(), server.port)
                )

    def failures(self, but: ServerProcess | None = None) -> Counter[tuple[int, str]]:
        """Failed requests by (status, variant); ``but``: leaving out those sent to it."""
        with self._lock:
            return Counter(
                (s, v)
                for s, v, _, port in self.answers
                if s != 200 and (but is None or port != but.port)
            )

    def served(self) -> Counter[str]:
        with self._lock:
            return Counter(v for s, v, _, _ in self.answers if s == 200)

    def by_server(self, variant: str) -> Counter[int]:
        """Requests (answered or failed) ``variant`` served, by server port."""
        with self._lock:
            return Counter(port for _, v, _, port in self.answers if v == variant)


class Client:
    """One client sending ``bodies`` in turn with one sticky header value until stopped: the
    statuses it got, by variant."""

    def __init__(
        self, server: ServerProcess, header: dict[str, str], bodies: Sequence[dict[str, Any]]
    ) -> None:
        self.server, self.header, self.bodies = server, header, list(bodies)
        self.statuses: Counter[tuple[int, str]] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send) for _ in range(2)]

    def __enter__(self) -> Client:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _send(self) -> None:
        turn = 0
        while not self._stop.is_set():
            body = self.bodies[turn % len(self.bodies)]
            turn += 1
            status, headers, _ = self.server.request(
                "POST", "/v2/models/m/infer", body, self.header
            )
            with self._lock:
                self.statuses[status, headers.get("X-Plugserve-Variant", "")] += 1


def key_on(server: ServerProcess, variant: str, header: str = "x-user") -> dict[str, str]:
    """A sticky header value the route places on ``variant``, found as a client would: by
    asking."""
    for i in range(1000):
        value = {header: f"probe-{i}"}
        status, headers, _ = server.request("POST", "/v2/models/m/infer", X, value)
        if status == 200 and headers.get("X-Plugserve-Variant") == variant:
            return value
    raise AssertionError(f"no key lands on {variant}")


def until(check: Callable[[], object], within: float, what: str = "") -> None:
    """``tests.helpers.until``, an assertion failing in ``check`` counting as not yet (a
    replica that has not applied the fleet's change)."""
    helpers.until(check, within, what, ignoring=(AssertionError,))
