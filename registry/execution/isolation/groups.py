"""Groups of runner processes: what a host starts for a version's load (its spec, its
processes and their state) and the :class:`Runners` protocol that a worker's
:class:`~plugserve.registry.execution.isolation.remote.RemoteRunner` reaches them through.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from plugserve.registry.execution.layout import TensorBounds


@dataclass(frozen=True)
class RunnerSpec:
    """What a runner process needs to load its version."""

    folder: Path
    label: str
    models_dir: Path
    plugins_dir: Path | None = None
    instances: int = 1
    devices: tuple[str, ...] = ()
    load_timeout: float = 120.0
    close_timeout: float = 10.0

    def as_json(self) -> dict[str, Any]:
        return {
            "folder": str(self.folder),
            "label": self.label,
            "models_dir": str(self.models_dir),
            "plugins_dir": None if self.plugins_dir is None else str(self.plugins_dir),
            "instances": self.instances,
            "devices": list(self.devices),
            "load_timeout": self.load_timeout,
            "close_timeout": self.close_timeout,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RunnerSpec:
        plugins_dir = doc.get("plugins_dir")
        return cls(
            folder=Path(doc["folder"]),
            label=str(doc["label"]),
            models_dir=Path(doc["models_dir"]),
            plugins_dir=None if plugins_dir is None else Path(plugins_dir),
            instances=int(doc["instances"]),
            devices=tuple(str(d) for d in doc["devices"]),
            load_timeout=float(doc["load_timeout"]),
            close_timeout=float(doc["close_timeout"]),
        )


@dataclass(frozen=True)
class ProcessSettings:
    """How this server starts runner processes: their logging, event loop and shared memory."""

    log_format: str = "console"
    log_level: str = "info"
    event_loop: str = "auto"
    shm_bytes: int = 64 * 1024 * 1024
    """Each connection's shared memory, each way; a tensor that does not fit goes inline."""
    stall_timeout_s: float = 60.0
    """A process whose event loop has not answered for this long is killed (0: never)."""
    tensor_bounds: TensorBounds = field(default_factory=TensorBounds)
    """What one tensor may hold, and so each tensor a process's batches merge into."""


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass(eq=False)
class RunnerProcess:
    """One instance of a group: the process serving it now, and its history."""

    index: int
    device: str | None
    socket: Path
    pid: int | None = None
    started_at: float | None = None
    """When the process serving now came up, loaded (:func:`time.monotonic`)."""
    restarts: int = 0
    ended: dict[int, str] = field(default_factory=dict)
    """How each process that served this instance ended, by pid."""
    up: asyncio.Event = field(default_factory=asyncio.Event)
    proc: asyncio.subprocess.Process | None = None
    watch: asyncio.Task[None] | None = None
    stall_watch: asyncio.Task[None] | None = None


@dataclass(eq=False)
class RunnerGroup:
    """The processes of one load of a version (``key``, unique), for whoever holds it."""

    key: str
    content: str
    """The version and the content it was loaded from (``label@fingerprint``)."""
    spec: RunnerSpec
    processes: list[RunnerProcess]
    metadata: dict[str, Any] | None = None
    holders: set[str] = field(default_factory=set)
    failed: str | None = None
    stopping: bool = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None and p.up.is_set()]

    @property
    def restarts(self) -> int:
        return sum(p.restarts for p in self.processes)

    @property
    def devices(self) -> list[str]:
        return [p.device for p in self.processes if p.device is not None]

    def as_json(self) -> dict[str, Any]:
        """What a worker needs to reach the processes (:func:`group_from_json`)."""
        return {
            "key": self.key,
            "content": self.content,
            "label": self.spec.label,
            "metadata": self.metadata,
            "failed": self.failed,
            "processes": [
                {
                    "index": p.index,
                    "device": p.device,
                    "socket": str(p.socket),
                    "pid": p.pid,
                    "up": p.up.is_set(),
                    "restarts": p.restarts,
                }
                for p in self.processes
            ],
        }


def group_from_json(doc: dict[str, Any], spec: RunnerSpec) -> RunnerGroup:
    """A worker's copy of a group its supervisor runs (pids and restarts as of then)."""
    processes = []
    for p in doc["processes"]:
        process = RunnerProcess(int(p["index"]), p["device"], Path(p["socket"]), p["pid"])
        process.restarts = int(p["restarts"])
        if p["up"]:
            process.up.set()
        processes.append(process)
    return RunnerGroup(
        doc["key"], doc["content"], spec, processes, doc["metadata"], failed=doc["failed"]
    )


class Runners(Protocol):
    """Where a process's isolated runners run: a :class:`RunnerHost` of its own, or its
    supervisor's (``server/processes/shared_runners.py``), shared by every worker."""

    settings: ProcessSettings

    async def acquire(self, content: str, spec: RunnerSpec) -> RunnerGroup: ...

    async def ready(self, key: str, index: int) -> RunnerProcess: ...

    async def ended(self, key: str, index: int, pid: int) -> str | None: ...

    async def release(self, key: str) -> None: ...

    async def figures(self, key: str) -> dict[str, Any]: ...

    async def close(self) -> None: ...
