"""Isolated runners: a runner version in processes of its own (``[runner] isolation = "process"``).

- ``shm``: shared memory regions and their allocator;
- ``wire``: the messages between a worker and a runner process;
- ``groups``: a version's group of runner processes;
- ``remote``: a worker's side, the component that stands for the runner;
- ``host``: starts, supervises and stops runner processes;
- ``monitors``: the connections that read runner processes' figures, the stall check's
  sign of life among them;
- ``supervision``: restart backoff, the restart loop, the stall check and the
  parent-death signal, for runner processes and the supervisor's workers alike;
- ``server/processes/runner_process.py``: the runner process itself.
"""
