"""One memory budget for a server of several workers: the supervisor keeps the accounts of
every worker's versions and of the runner processes they share, and evicts across them."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from plugserve.registry.errors import Conflict, PluginLoadError
from plugserve.server.processes.control import errors
from plugserve.server.processes.pool import Worker, WorkerPool
from plugserve.server.processes.tree_budget import Entry, TreeBudget
from plugserve.server.processes.unix import UnixClient
from tests.helpers import ServerProcess, metric, until
from tests.server.test_on_demand import infer, record, write_big

MIB = 2**20


def budget_for_two(isolated: bool) -> str:
    """A budget that holds two versions and not three: 64 MiB of weights each, in the
    worker; in a runner process of its own, those and the process (~80 MiB more)."""
    return "330MiB" if isolated else "150MiB"


def memory(srv: ServerProcess) -> dict[str, Any]:
    status, _, body = srv.request("GET", "/admin/status")
    assert status == 200, body
    state = json.loads(body)["memory"]
    assert state is not None
    return state


@pytest.mark.workers(2)
@pytest.mark.parametrize("isolated", [False, True], ids=["in-worker", "isolated"])
def test_the_supervisor_keeps_one_budget_for_every_worker(
    isolated: bool, plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """Three versions, a budget that holds two, requests spread over both workers: the
    tree's measured memory never passes the budget. In the worker each worker's copy
    counts; in runner processes one copy serves both workers and counts once."""
    write_big(plugins_dir, "abc", 64, 'isolation = "process"\n' if isolated else "")
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--memory-budget", budget_for_two(isolated))  # fmt: skip
    assert memory(srv)["resident"] == []
    for _ in range(3):
        for name in "abc":
            status, _, answer = infer(srv, name)
            assert status == 200, answer
            state = memory(srv)
            assert state["resident_bytes"] <= state["budget_bytes"], state
            assert 1 <= len(state["resident"]) <= 2, state
            # what was held for its first use is given back at the next report
            until(lambda: memory(srv)["reserved_bytes"] == 0, 5, "reserved_bytes back to 0")
    for row in state["resident"]:
        assert 64 * MIB < row["bytes"] < (200 if isolated else 80) * MIB, row
        if isolated:  # the processes every worker shares
            assert row["where"] == "runners", row
        else:
            assert re.fullmatch(r"worker [01]", row["where"]) and len(row["workers"]) == 1, row
    status, _, body = srv.request("GET", "/metrics")
    text = body.decode()
    assert metric(text, "plugserve_memory_budget_bytes") == state["budget_bytes"]
    assert metric(text, "plugserve_memory_resident_versions") == len(state["resident"])
    assert metric(text, "plugserve_plugin_loads_total", reason="demand") >= 3
    evictions = metric(text, "plugserve_plugin_evictions_total")
    assert srv.log().count("plugin_evicted") == evictions >= 1


@pytest.mark.parametrize(
    ("isolated", "workers"), [(False, 1), (True, 2)], ids=["in-worker-w1", "isolated-w2"]
)
def test_a_version_in_use_is_never_evicted_even_when_least_recently_used(
    isolated: bool, plugins_dir: Path, models_dir: Path, server: Callable[..., Any]
) -> None:
    """``a`` is used first and is still answering a slow request when ``c`` needs room:
    ``b``, used later but idle, goes instead; the slow request is answered."""
    write_big(plugins_dir, "abc", 64, 'isolation = "process"\n' if isolated else "")
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir),
                 "--memory-budget", budget_for_two(isolated))  # fmt: skip
    assert infer(srv, "a")[0] == 200
    slow: list[int] = []
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [-1, 0, 0, 0]}]}
    thread = threading.Thread(
        target=lambda: slow.append(srv.request("POST", "/v2/models/a/infer", body)[0])
    )
    thread.start()
    try:
        until(lambda: record(srv, "a")["in_flight"] >= 1, 10, "a's request in flight")
        assert infer(srv, "b")[0] == 200  # a and b fit
        assert infer(srv, "c")[0] == 200  # room: a is older but busy, so b goes
        states = {name: record(srv, name)["state"] for name in "abc"}
        assert states == {"a": "ready", "b": "available", "c": "ready"}, states
    finally:
        thread.join(30)
    assert slow == [200]


# -- the supervisor's accounts, called as workers call them -------------------------------


def tree(tmp_path: Path, limit: int = 1000) -> TreeBudget:
    """A budget over a pool of two registered workers (pids ``W0`` and ``W1``, above any
    pid the kernel gives, so no process is read for them). Nothing here needs room, so no
    call reaches them."""
    pool = WorkerPool(tmp_path, tmp_path)
    for index, pid in ((0, W0), (1, W1)):
        pool.workers[index] = Worker(index, pid, 0.0, UnixClient(tmp_path / f"w{index}.sock"))
    return TreeBudget(limit, 0, pool, evict_timeout_s=5)


W0, W1 = 2**22 + 101, 2**22 + 102
KEY = ("runner", "a", "1.0.0")
SHARED_A = Entry(KEY, "runners")


async def test_a_shared_version_stays_counted_while_a_worker_loads_into_it(
    tmp_path: Path,
) -> None:
    """Worker 1 holds the shared processes of a; worker 0 begins to load (join) them
    (nothing more to reserve), worker 1 lets go meanwhile: a is still counted, and once
    worker 0 has measured it, held by worker 0."""
    budget = tree(tmp_path)
    first = await budget.admit(1, W1, KEY, isolated=True)
    await budget.measured(first, {"memory": 300}, {})
    joining = await budget.admit(0, W0, KEY, isolated=True)
    assert budget.ledger.reserved[joining] == {}  # counted already
    budget.gone(1, W1, KEY)
    assert budget.ledger.cost[SHARED_A] == {"memory": 300}  # a load into it is under way
    await budget.measured(joining, {"memory": 310}, {})
    assert budget.holders[SHARED_A] == {W0}
    assert budget.ledger.cost[SHARED_A] == {"memory": 310}
    budget.gone(0, W0, KEY)
    assert SHARED_A not in budget.ledger.cost and budget.holders == {}


async def test_two_workers_loading_one_shared_version_reserve_it_once(tmp_path: Path) -> None:
    budget = tree(tmp_path)
    budget.ledger.known[KEY] = {"memory": 300}
    one = await budget.admit(0, W0, KEY, isolated=True)
    two = await budget.admit(1, W1, KEY, isolated=True)
    assert budget.ledger.reserved == {one: {"memory": 300}, two: {}}
    in_worker = await budget.admit(1, W1, KEY, isolated=False)  # each worker's own copy
    assert budget.ledger.reserved[in_worker] == {"memory": 300}


async def test_a_worker_that_ends_takes_its_loads_and_holds_with_it(tmp_path: Path) -> None:
    budget = tree(tmp_path)
    budget.ledger.known[KEY] = {"memory": 300}
    held = await budget.admit(1, W1, KEY, isolated=False)
    await budget.measured(held, {"memory": 300}, {})
    loading = await budget.admit(1, W1, ("runner", "b", "1.0.0"), isolated=False)
    assert budget.ledger.held("memory") == 600
    budget.worker_gone(W1)
    assert budget.ledger.held("memory") == 0 and budget.tickets == {} and budget.holders == {}
    await budget.measured(loading, {"memory": 300}, {})  # too late: nothing is counted
    assert budget.ledger.held("memory") == 0
    with pytest.raises(Conflict):  # a worker not (or no longer) in the pool
        await budget.admit(1, 999, KEY, isolated=False)


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("admit", b"not json", 400),
        ("admit", b"[]", 400),
        ("admit", b"{}", 400),
        (
            "admit",
            json.dumps({"worker": "x", "pid": W0, "key": list(KEY), "isolated": True}).encode(),
            400,
        ),
        (
            "admit",
            json.dumps({"worker": 0, "pid": W0, "key": list(KEY), "isolated": "false"}).encode(),
            400,
        ),
        (
            "admit",
            json.dumps({"worker": 0, "pid": 999, "key": list(KEY), "isolated": False}).encode(),
            409,
        ),
        (
            "admit",
            json.dumps({"worker": 0, "pid": W0, "key": list(KEY), "isolated": False}).encode(),
            200,
        ),
        (
            "measured",
            json.dumps({"ticket": 1, "cost": {"memory": 1e400}, "totals": {}}).encode(),
            400,
        ),
        ("measured", json.dumps({"ticket": 1, "cost": {"disk": 5}, "totals": {}}).encode(), 400),
        (
            "measured",
            json.dumps({"ticket": 1, "cost": {"cuda:0": -1}, "totals": {}}).encode(),
            400,
        ),
        (
            "measured",
            json.dumps({"ticket": 7, "cost": {"memory": 5}, "totals": {}}).encode(),
            200,
        ),
        ("gone", json.dumps({"worker": 1}).encode(), 400),
        ("cancel", json.dumps({"ticket": True}).encode(), 400),
    ],
)
async def test_the_budget_calls_answer_bad_input_with_400(
    tmp_path: Path, path: str, body: bytes, status: int
) -> None:
    budget = tree(tmp_path)
    app = web.Application(middlewares=[errors])
    budget.add_routes(app)
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        url = server.make_url(f"/_supervisor/budget/{path}")
        async with session.post(url, data=body) as reply:
            assert reply.status == status, await reply.text()


async def test_an_estimate_whose_load_never_reports_lapses(tmp_path: Path) -> None:
    """A worker that never answers for its load (its admit timed out on its side) holds
    the estimate no longer than the load's bound: the next reading lets it go."""
    budget = tree(tmp_path)
    budget.hold_s = 0.0
    budget.ledger.known[KEY] = {"memory": 300}
    await budget.admit(0, W0, KEY, isolated=False)
    assert budget.ledger.held("memory") == 300
    await budget.sample()
    assert budget.ledger.reserved == {} and budget.tickets == {}
    assert budget.ledger.held("memory") == 0


class FakeWorker:
    """A worker's ``/_control/budget/usage`` on its socket, answering ``rows``."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        async def usage(request: web.Request) -> web.Response:
            return web.json_response({"versions": self.rows})

        app = web.Application()
        app.router.add_get("/_control/budget/usage", usage)
        return app


async def test_the_accounts_follow_what_workers_report_holding(tmp_path: Path) -> None:
    """A version worker 0 holds that the accounts miss (its measure was lost on the way)
    is counted, at its estimate, and evictable; one the accounts hold for it that it no
    longer reports (its gone was lost) is let go: each once two readings agree."""
    budget = tree(tmp_path)
    budget.ledger.known[KEY] = {"memory": 300}
    worker = FakeWorker()
    runner = web.AppRunner(worker.app())
    await runner.setup()
    await web.UnixSite(runner, str(tmp_path / "w0.sock")).start()
    try:
        worker.rows = [{"key": list(KEY), "last_use": 1.0, "busy": False, "evictable": True,
                        "isolated": False, "bytes": None}]  # fmt: skip
        entry = Entry(KEY, "worker 0")
        await budget.sample()
        assert entry not in budget.ledger.cost  # one reading: it may be on its way
        await budget.sample()
        assert budget.ledger.cost[entry] == {"memory": 300} and budget.holders[entry] == {W0}
        worker.rows = []
        await budget.sample()
        assert entry in budget.ledger.cost
        await budget.sample()
        assert entry not in budget.ledger.cost and budget.holders == {}
    finally:
        for each in budget.pool.workers.values():
            await each.client.close()
        await runner.cleanup()


async def test_a_measure_over_the_whole_budget_is_refused_and_counts_nothing(
    tmp_path: Path,
) -> None:
    budget = tree(tmp_path, limit=1000)
    ticket = await budget.admit(0, W0, KEY, isolated=False)
    with pytest.raises(PluginLoadError, match="memory_budget"):
        await budget.measured(ticket, {"memory": 5000}, {})
    assert KEY not in budget.ledger.cost and ticket in budget.tickets  # until let go
    budget.cancel(ticket)
    assert budget.ledger.held("memory") == 0 and budget.tickets == {}
    with pytest.raises(PluginLoadError, match="memory_budget"):  # known now: refused first
        await budget.admit(1, W1, KEY, isolated=False)
    assert budget.ledger.reserved == {}


async def test_room_held_for_a_first_use_is_given_back_once_the_worker_reports_it_served(
    tmp_path: Path,
) -> None:
    """a served at 450 in worker 1 (its peak): its load into worker 0 is admitted at 450;
    measured at 300, 150 stay held for its first use while worker 0 reports it not yet
    served, and are given back at the first report once it has."""
    budget = tree(tmp_path)
    budget.ledger.peak[KEY] = {"memory": 450}
    ticket = await budget.admit(0, W0, KEY, isolated=False)
    assert budget.ledger.reserved == {ticket: {"memory": 450}}
    await budget.measured(ticket, {"memory": 300}, {})
    assert budget.ledger.reserved == {ticket: {"memory": 150}}
    worker = FakeWorker()
    runner = web.AppRunner(worker.app())
    await runner.setup()
    await web.UnixSite(runner, str(tmp_path / "w0.sock")).start()
    try:
        row = {"key": list(KEY), "last_use": 1.0, "busy": False, "evictable": True,
               "isolated": False, "bytes": None, "served": False}  # fmt: skip
        worker.rows = [row]
        await budget.sample()
        assert budget.ledger.held("memory") == 450
        row["served"] = True
        await budget.sample()
        assert budget.ledger.reserved == {} and budget.ledger.held("memory") == 300
    finally:
        for each in budget.pool.workers.values():
            await each.client.close()
        await runner.cleanup()
