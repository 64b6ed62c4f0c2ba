"""The backend threads a server chooses from its cores: the rule, and the real session it sets."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from plugserve.registry.backends import cpu_share
from plugserve.registry.backends.cpu_share import CpuShare
from plugserve.registry.backends.onnxruntime import SPINNING, create_runner
from plugserve.registry.types import PluginInfo
from tests.helpers import add_model


@pytest.fixture(autouse=True)
def no_share() -> Iterator[None]:
    """Each test starts without a share and leaves none behind for the tests after it."""
    cpu_share.assign(None)
    yield
    cpu_share.assign(None)


@pytest.mark.parametrize(
    ("cores", "loops", "sessions", "threads", "spinning"),
    [
        (2, 1, 1, 1, False),  # one core for the loop, one for the model
        (2, 2, 1, 1, False),  # a worker per core: the model runs beside its loop
        (1, 1, 1, 1, False),
        (16, 1, 1, 15, True),  # every thread and the loop on a core of its own
        (16, 2, 1, 7, True),
        (16, 2, 2, 3, True),  # two instances run at once in each worker
        (16, 16, 1, 1, False),
        (8, 3, 1, 1, False),  # 5 spare cores for 3 loops: one thread each
        (4, 1, 2, 1, False),
    ],
)
def test_threads_divide_the_cores_the_loops_leave(
    cores: int, loops: int, sessions: int, threads: int, spinning: bool
) -> None:
    choice = cpu_share.choose(CpuShare(cores, loops), sessions)
    assert (choice.threads, choice.spinning) == (threads, spinning)
    assert choice.reason.startswith(f"{cores} usable core{'s' if cores > 1 else ''}, ")


def test_spinning_stays_off_where_threads_would_share_a_loops_core() -> None:
    # 6 cores, 2 loops: 2 threads each, and 2 x (2 + 1) = 6 cores: every one its own.
    assert cpu_share.choose(CpuShare(6, 2)).spinning
    # 5 cores: (5 - 2) // 2 = 1 thread each: nothing to spin.
    assert not cpu_share.choose(CpuShare(5, 2)).spinning
    # 7 cores, 1 loop, 2 instances: 3 threads each, 3 x 2 + 1 = 7.
    assert cpu_share.choose(CpuShare(7, 1), 2).spinning


def test_the_share_reaches_child_processes_through_the_environment() -> None:
    assert cpu_share.current() is None
    cpu_share.assign(CpuShare(4, 2))
    code = "from plugserve.registry.backends import cpu_share; print(cpu_share.current())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    ).stdout
    assert out.strip() == "CpuShare(cores=4, loops=2)"
    assert CpuShare.parse("nonsense") is None
    assert CpuShare.parse("0/1") is None  # no cores: not a share
    assert CpuShare.parse("4/2") == CpuShare(4, 2)


@pytest.mark.parametrize("text", ["1_000/1", "٢/1", " 2/1", "2/1/1", "-1/2", "2/", "99999/1"])
def test_a_share_the_server_did_not_write_is_ignored(text: str) -> None:
    """Only ``cores/loops`` in ASCII digits, up to MAX_CORES cores: a hand-set 99999 would
    give a session 99,998 threads."""
    assert CpuShare.parse(text) is None
    with pytest.raises(ValueError):
        CpuShare(2, 0)


def _runner(tmp_path: Path, **table: object):  # type: ignore[no-untyped-def]
    plugin = PluginInfo("m", "1.0.0", "runner", tmp_path, structlog.get_logger())
    return create_runner(plugin, table, add_model(tmp_path / "a.onnx"))


def test_a_session_gets_the_chosen_threads_and_no_spinning(tmp_path: Path) -> None:
    cpu_share.assign(CpuShare(2, 1))
    r = _runner(tmp_path)
    options = r._session.get_session_options()
    assert options.intra_op_num_threads == 1
    assert options.get_session_config_entry(SPINNING) == "0"
    assert r.metadata()["threads"] == {
        "intra_op": 1,
        "spinning": False,
        "reason": "2 usable cores, 1 event loop, 1 concurrent execution per loop",
    }
    r.close()


def test_instances_divide_the_threads(tmp_path: Path) -> None:
    cpu_share.assign(CpuShare(16, 1))
    r = _runner(tmp_path, instances=3)
    assert r._session.get_session_options().intra_op_num_threads == 5
    assert r.metadata()["threads"]["spinning"] is True
    r.close()


def test_a_runners_own_setting_wins(tmp_path: Path) -> None:
    cpu_share.assign(CpuShare(2, 2))
    r = _runner(tmp_path, intra_op_threads=2, session_config={SPINNING: "1"})
    options = r._session.get_session_options()
    assert options.intra_op_num_threads == 2
    assert options.get_session_config_entry(SPINNING) == "1"
    assert r.metadata()["threads"] == {
        "intra_op": 2, "spinning": True, "reason": "runner.intra_op_threads"
    }  # fmt: skip
    r.close()


def test_without_a_server_onnx_runtime_keeps_its_defaults(tmp_path: Path) -> None:
    r = _runner(tmp_path)
    assert r._session.get_session_options().intra_op_num_threads == 0  # ORT: one per core
    assert "threads" not in r.metadata()
    r.close()
