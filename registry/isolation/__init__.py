"""Isolated runners: a runner version in processes of its own (``[runner] isolation = "process"``).

- :mod:`plugserve.registry.isolation.shm`: shared memory regions and their allocator;
- :mod:`plugserve.registry.isolation.wire`: the messages between a worker and a runner process;
- :mod:`plugserve.registry.isolation.groups`: a version's group of runner processes;
- :mod:`plugserve.registry.isolation.remote`: a worker's side, the component that stands
  for the runner;
- :mod:`plugserve.registry.isolation.host`: starts, supervises and stops runner processes;
- :mod:`plugserve.registry.isolation.supervision`: restart backoff, the restart loop, the
  stall check and the parent-death signal, for runner processes and the supervisor's
  workers alike;
- ``server/processes/runner.py``: the runner process itself.
"""
