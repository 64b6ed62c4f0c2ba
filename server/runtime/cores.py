"""How many cores this process may use: its CPU affinity, bounded by its cgroup's CPU quota.

A container limited to 2 CPUs on a 64-core node (Kubernetes ``limits.cpu: 2``, ``docker
run --cpus 2``) sees 64 cores in its affinity: its quota is in the cgroup files, not
in the affinity. ``workers = "auto"`` sized by the affinity alone would start 64 workers
that share 2 cores' worth of time, each with its own copy of every model. The quota is
read as Go's runtime (1.25) and the JVM read it: the cgroup of this process in
``/proc/self/cgroup``, found under its mount in ``/proc/self/mountinfo``, and every
ancestor up to that mount (a limit set on a parent applies to its children): v2's
``cpu.max``, v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``. The smallest limit,
rounded up to whole cores (1.5 CPUs: 2 workers, each using part of its core), bounds
the affinity's count. Anything unreadable counts as no limit.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

ROOT = Path("/")


def usable_cores(root: Path = ROOT) -> int:
    """The cores this process may run on (its affinity, as a container's cpuset sets it),
    at most its cgroup's CPU quota rounded up; at least 1."""
    return bounded(affinity_cores(), cpu_quota(root))


def affinity_cores() -> int:
    """The cores this process's CPU affinity allows (all of them where it has none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def bounded(cores: int, quota: float | None) -> int:
    """``cores``, at most ``quota`` (in cores) rounded up; at least 1."""
    return cores if quota is None else min(cores, max(1, math.ceil(quota)))


def cpu_quota(root: Path = ROOT) -> float | None:
    """The CPU time this process's cgroups allow, in cores (1.5: one and a half cores'
    time each period); ``None`` where no cgroup limits it or the files cannot be read."""
    try:
        mountinfo = (root / "proc/self/mountinfo").read_text()
        membership = (root / "proc/self/cgroup").read_text()
    except OSError:
        return None
    limits: list[float] = []
    for mount_root, mountpoint, fstype, options in _cgroup_mounts(mountinfo):
        if fstype == "cgroup2":
            group = _group(membership, None)
        elif "cpu" in options.split(","):
            group = _group(membership, "cpu")
        else:
            continue
        if group is None:
            continue
        top = root / mountpoint.lstrip("/")
        for folder in _up_to(top, _inside(group, mount_root)):
            limit = _v2_limit(folder) if fstype == "cgroup2" else _v1_limit(folder)
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def _cgroup_mounts(mountinfo: str) -> Iterator[tuple[str, str, str, str]]:
    """(root, mount point, filesystem type, super options) of each cgroup mount."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        yield _unescape(fields[3]), _unescape(fields[4]), tail[0], tail[2]


def _unescape(path: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def _group(membership: str, controller: str | None) -> str | None:
    """This process's cgroup path: v2's (``0::/path``, ``controller`` None) or the v1
    hierarchy's that holds ``controller``."""
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controller is None and parts[0] == "0" and controllers == "":
            return path
        if controller is not None and controller in controllers.split(","):
            return path
    return None


def _inside(group: str, mount_root: str) -> PurePosixPath:
    """``group`` relative to its mount's root (a cgroup namespace makes both ``/``); the
    mount's own folder when the group lies outside it."""
    try:
        return PurePosixPath(group).relative_to(mount_root)
    except ValueError:
        return PurePosixPath(".")


def _up_to(top: Path, relative: PurePosixPath) -> Iterator[Path]:
    """The group's folder and each parent, up to and including the mount's."""
    parts = [p for p in relative.parts if p not in ("", ".", "/")]
    for depth in range(len(parts), -1, -1):
        yield top.joinpath(*parts[:depth])


def _v2_limit(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return _ratio(quota, period)


def _v1_limit(folder: Path) -> float | None:
    try:
        quota = (folder / "cpu.cfs_quota_us").read_text().strip()
        period = (folder / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    """``quota / period`` in cores; ``None`` for no limit (``max``, ``-1``) or nonsense."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None  # "max": no limit
    return q / p if q > 0 and p > 0 else None
