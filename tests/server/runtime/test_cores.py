"""The cores a process may use: affinity, bounded by the cgroup CPU quota (real files,
laid out under a temporary root as Linux lays them out in containers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from plugserve.server import config
from plugserve.server.config import Settings
from plugserve.server.runtime.cores import cpu_quota, usable_cores

AFFINITY = len(os.sched_getaffinity(0))

V2_MOUNT = "30 23 0:26 {root} /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "34 31 0:31 {root} /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n"
)


def lay_out(root: Path, mountinfo: str, membership: str, files: dict[str, str]) -> Path:
    proc = root / "proc/self"
    proc.mkdir(parents=True)
    (proc / "mountinfo").write_text(mountinfo)
    (proc / "cgroup").write_text(membership)
    for name, text in files.items():
        path = root / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_v2_container_with_its_own_namespace_reads_its_cpu_max(tmp_path: Path) -> None:
    """``docker run --cpus 1``: the group is ``/`` in the container's cgroup namespace."""
    root = lay_out(tmp_path, V2_MOUNT.format(root="/"), "0::/\n",
                   {"/sys/fs/cgroup/cpu.max": "100000 100000\n"})  # fmt: skip
    assert cpu_quota(root) == 1.0
    assert usable_cores(root) == 1


def test_a_limit_on_a_parent_group_applies_and_the_smallest_wins(tmp_path: Path) -> None:
    """Kubernetes without a cgroup namespace: the pod's limit sits on the container's parent."""
    pod = "/sys/fs/cgroup/kubepods.slice/pod1"
    root = lay_out(tmp_path, V2_MOUNT.format(root="/"), "0::/kubepods.slice/pod1/c1\n", {
        "/sys/fs/cgroup/cpu.max": "max 100000\n",
        f"{pod}/cpu.max": "150000 100000\n",
        f"{pod}/c1/cpu.max": "max 100000\n",
    })  # fmt: skip
    assert cpu_quota(root) == 1.5
    assert usable_cores(root) == min(AFFINITY, 2)  # rounded up: 1.5 cores' time is 2 workers'

    (root / pod.lstrip("/") / "c1/cpu.max").write_text("50000 100000\n")
    assert cpu_quota(root) == 0.5
    assert usable_cores(root) == 1  # never 0


def test_a_v1_hierarchy_reads_cfs_quota_over_period(tmp_path: Path) -> None:
    """cgroup v1 (this machine's kind): the cpu controller's own hierarchy, mounted at the
    container's group (``root`` field), with the quota in microseconds a period."""
    group = "/docker/abc"
    root = lay_out(
        tmp_path,
        V1_MOUNTS.format(root=group),
        f"4:cpuset:{group}\n3:cpu,cpuacct:{group}\n1:name=systemd:{group}\n0::/\n",
        {
            "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "100000\n",
            "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            "/sys/fs/cgroup/cpuset/cpu.cfs_quota_us": "1\n",  # not the cpu controller: ignored
            "/sys/fs/cgroup/cpuset/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cpu_quota(root) == 1.0
    assert usable_cores(root) == 1
    (root / "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(root) is None
    assert usable_cores(root) == AFFINITY


def test_a_mount_point_with_a_space_is_found(tmp_path: Path) -> None:
    mountinfo = "30 23 0:26 / /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw\n"
    root = lay_out(tmp_path, mountinfo, "0::/\n", {"/sys/fs/my cgroup/cpu.max": "100000 50000"})
    assert cpu_quota(root) == 2.0


@pytest.mark.parametrize(
    "cpu_max", ["max 100000", "max", "", "0 100000", "-5 100000", "abc def", "100000 0"]
)
def test_no_limit_or_nonsense_leaves_the_affinity(tmp_path: Path, cpu_max: str) -> None:
    root = lay_out(tmp_path, V2_MOUNT.format(root="/"), "0::/\n",
                   {"/sys/fs/cgroup/cpu.max": cpu_max})  # fmt: skip
    assert cpu_quota(root) is None
    assert usable_cores(root) == AFFINITY


def test_unreadable_or_missing_files_leave_the_affinity(tmp_path: Path) -> None:
    assert cpu_quota(tmp_path) is None  # no /proc at all (not Linux, or hidden)
    root = lay_out(tmp_path, V2_MOUNT.format(root="/"), "0::/\n", {})  # no cpu.max
    assert cpu_quota(root) is None
    garbage = lay_out(tmp_path / "g", "garbage\n - cgroup2\n\n", "nonsense\n", {})
    assert cpu_quota(garbage) is None
    assert usable_cores(garbage) == AFFINITY


def test_this_machine_answers_within_its_affinity() -> None:
    assert 1 <= usable_cores() <= AFFINITY


def test_workers_auto_follows_the_quota(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = lay_out(tmp_path, V2_MOUNT.format(root="/"), "0::/\n",
                   {"/sys/fs/cgroup/cpu.max": "100000 100000\n"})  # fmt: skip
    monkeypatch.setattr(config, "usable_cores", lambda: usable_cores(root))
    assert Settings(workers="auto").worker_count == 1
    assert not Settings(workers="auto").runners_on_loop  # one worker: its runner on a thread
