"""The parts the runners' schedulers are built of.

- ``policy``: :class:`BatchPolicy`, a runner's scheduling settings, and its priority levels;
- ``request_queue``: the requests queued for one runner instance and the order they leave
  in (priority levels, tenants' fair shares, arrival), deadlines and hang-ups while queued;
- ``batch_cutting``: which queued requests leave together as a batch, and how a batch's
  inputs are joined and its outputs split between its requests;
- ``batch_execution``: one batch's execution, and a failed batch run again one request at a
  time;
- ``sequence_tensors``: the state, context and control tensors of a sequence's requests.

The schedulers themselves are ``registry/execution/batching.py`` (``Scheduler``),
``registry/execution/streaming.py`` (``StreamScheduler``) and
``registry/execution/sequences.py`` (``Sequences``).
"""
