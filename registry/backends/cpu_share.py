"""The cores a backend's threads may use, and the thread count chosen from them.

A server knows what a backend cannot: how many cores its processes may use (affinity
and cgroup quota), and how many event loops run beside the backends' threads (one per
worker process). ONNX Runtime's own default, a spinning thread per core in every
session of every process, fights those loops for the same cores: on 2 cores with one
worker it served a third of what one thread did. The server records its share here
once at start (:func:`assign`); a backend asks :func:`choose` for a session's threads
unless the runner sets them.

The share travels to the processes a server starts (workers, runner processes) in the
``PLUGSERVE_CPU_SHARE`` environment variable (``cores/loops``), which they inherit.
A registry used without a server has no share: backends keep their own defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV = "PLUGSERVE_CPU_SHARE"
MAX_CORES = 4096
"""A share naming more cores than this is not one the server wrote: it is ignored (a
session of that many threads would take the machine's memory)."""


@dataclass(frozen=True)
class CpuShare:
    """``cores`` usable by the whole server, ``loops`` event loops running on them."""

    cores: int
    loops: int

    def __post_init__(self) -> None:
        if self.cores < 1 or self.loops < 1:
            raise ValueError(f"a CPU share needs at least one core and one loop: {self}")

    @property
    def shown(self) -> str:
        return f"{self.cores}/{self.loops}"

    @classmethod
    def parse(cls, text: str) -> CpuShare | None:
        """``cores/loops`` as :attr:`shown` writes it (ASCII digits, at most ``MAX_CORES``
        cores); ``None`` for anything else."""
        cores, sep, loops = text.partition("/")
        if not (sep and _digits(cores) and _digits(loops)) or int(cores) > MAX_CORES:
            return None
        try:
            return cls(int(cores), int(loops))
        except ValueError:  # zero cores or loops
            return None


@dataclass(frozen=True)
class ThreadChoice:
    """A session's intra-op threads, whether they may spin while idle, and why."""

    threads: int
    spinning: bool
    reason: str

    def as_json(self) -> dict[str, object]:
        return {"intra_op": self.threads, "spinning": self.spinning, "reason": self.reason}


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 9


def assign(share: CpuShare | None) -> None:
    """This process's share, and its children's (through the environment)."""
    if share is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = share.shown


def current() -> CpuShare | None:
    """The share the server assigned to this process or its parent; ``None`` without one."""
    text = os.environ.get(ENV)
    return CpuShare.parse(text) if text else None


def choose(share: CpuShare, sessions: int = 1) -> ThreadChoice:
    """Threads for each of ``sessions`` concurrent executions in each event loop's process.

    The cores no loop runs on are divided among the loops' processes and, within one,
    among its concurrent executions (a runner's ``instances``); at least one thread
    each. Threads spin while idle only where every thread and every loop has a core of
    its own: a spinning thread on a loop's core takes the time the loop needs to read
    the next requests.
    """
    sessions = max(1, sessions)
    spare = share.cores - share.loops
    threads = max(1, spare // (share.loops * sessions))
    own_cores = (threads * sessions + 1) * share.loops <= share.cores
    spinning = threads > 1 and own_cores
    loops = "1 event loop" if share.loops == 1 else f"{share.loops} event loops"
    shared = threads > 1 and not own_cores
    cores = "1 usable core" if share.cores == 1 else f"{share.cores} usable cores"
    reason = (
        f"{cores}, {loops}, {sessions} concurrent "
        f"execution{'s' if sessions != 1 else ''} per loop"
        + ("; no spinning: threads share cores with a loop" if shared else "")
    )
    return ThreadChoice(threads, spinning, reason)
