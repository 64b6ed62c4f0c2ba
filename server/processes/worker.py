"""A worker process: ``python -m plugserve.server.processes.worker``, started by the supervisor.

It reads its :class:`plugserve.server.processes.link.WorkerSpec` (pickled) from stdin,
serves the data plane on the sockets it inherited, and answers its supervisor
on a control socket of its own. Not a command for people to run.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys

import structlog

from plugserve.registry.execution.isolation.supervision import die_with_parent
from plugserve.server.processes.link import WorkerLink, WorkerSpec


def main() -> int:
    spec: WorkerSpec = pickle.load(sys.stdin.buffer)
    # SIGTERM when the supervisor ends, even before the lifeline is watched: the worker
    # drains as on any stop.
    die_with_parent(signal.SIGTERM, spec.supervisor_pid)
    # Ours alone: a process a plugin starts must not hold the port or the lifeline.
    for fd in (
        spec.lifeline_fd,
        *spec.admin_fds,
        *([] if spec.data_fd is None else [spec.data_fd]),
    ):
        os.set_inheritable(fd, False)
    from plugserve.server.cli import serve_sockets
    from plugserve.server.http.startup import bind
    from plugserve.server.runtime.logs import configure_logging
    from plugserve.server.runtime.stdio import protect_std_streams

    settings = spec.settings
    protect_std_streams()
    configure_logging(settings.log_format, settings.log_level)
    structlog.contextvars.bind_contextvars(worker=spec.index)
    # Bound now; it listens once the plugins are loaded (server/processes/supervisor.py).
    if spec.data_fd is not None:
        sockets = [socket.socket(fileno=spec.data_fd)]
    else:
        sockets = [bind(*spec.address, reuse_port=True)]
    sockets += [socket.socket(fileno=fd) for fd in spec.admin_fds]
    return serve_sockets(settings, sockets, WorkerLink(spec))


if __name__ == "__main__":
    sys.exit(main())
