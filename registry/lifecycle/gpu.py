"""What the GPUs hold, for the memory budget: each device's total and used memory, and what
each process uses on each, read through ``nvidia-smi`` (the driver's own tool, on every
machine with an NVIDIA driver).

Devices are named as runners are placed on them (``cuda:N``, N the index ``nvidia-smi``
gives). In a container without the host's process namespace, the driver reports host
pids, which match none of ours: :func:`usage` then finds nothing for our pids, and the
budget measures a load by its devices' growth instead.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

MIB = 1 << 20
QUERY_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Devices:
    """One reading: each device's total and used bytes, and each process's bytes by device."""

    total: dict[str, int]
    used: dict[str, int]
    by_pid: dict[int, dict[str, int]]

    def of(self, pids: Iterable[int]) -> dict[str, int]:
        """The bytes ``pids`` use, by device."""
        found: dict[str, int] = {}
        for pid in pids:
            for device, nbytes in self.by_pid.get(pid, {}).items():
                found[device] = found.get(device, 0) + nbytes
        return found


def _query(*args: str) -> list[list[str]]:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return []
    try:
        done = subprocess.run(
            [tool, *args, "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=QUERY_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    if done.returncode != 0:
        return []
    return [[f.strip() for f in line.split(",")] for line in done.stdout.splitlines() if line]


def read() -> Devices | None:
    """The GPUs now, or ``None`` on a machine without ``nvidia-smi`` (or without GPUs)."""
    gpus = _query("--query-gpu=index,uuid,memory.total,memory.used")
    if not gpus:
        return None
    names, total, used = {}, {}, {}
    for row in gpus:
        try:
            index, uuid, mib_total, mib_used = row[0], row[1], int(row[2]), int(row[3])
        except (IndexError, ValueError):
            continue
        device = f"cuda:{index}"
        names[uuid] = device
        total[device], used[device] = mib_total * MIB, mib_used * MIB
    by_pid: dict[int, dict[str, int]] = {}
    for row in _query("--query-compute-apps=pid,gpu_uuid,used_memory"):
        try:
            pid, device, mib = int(row[0]), names[row[1]], int(row[2])
        except (IndexError, KeyError, ValueError):
            continue  # "[N/A]" where the driver does not say
        per = by_pid.setdefault(pid, {})
        per[device] = per.get(device, 0) + mib * MIB
    return Devices(total, used, by_pid)
