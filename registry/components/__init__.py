"""Loaded plugin instances, by kind: how a request reaches a plugin version's component.

- :mod:`~plugserve.registry.components.base`: :class:`LoadedPlugin`, what every kind
  shares (label, version, manifest, requests in flight, warmup and close, statistics);
- :mod:`~plugserve.registry.components.stage`: :class:`Stage`, a preprocessor or
  postprocessor;
- :mod:`~plugserve.registry.components.runner`: :class:`Runner`, what every runner kind
  shares (its ``[runner]`` table, its inputs as named arrays, its ``validate``);
- :mod:`~plugserve.registry.components.batched`: :class:`BatchedRunner`, requests batched
  by its scheduler;
- :mod:`~plugserve.registry.components.streaming`: :class:`StreamingRunner`, several
  responses to a request;
- :mod:`~plugserve.registry.components.isolated`: :class:`IsolatedRunner`, a runner in
  processes of its own;
- :mod:`~plugserve.registry.components.inline`: when a synchronous call runs on the event
  loop rather than on a thread.

The loader (``registry/loader.py``) builds the kind a version's manifest and component make.
"""

from plugserve.registry.components.base import LoadedPlugin
from plugserve.registry.components.batched import BatchedRunner
from plugserve.registry.components.inline import LOOP_BUDGET_S, PROCESS_BUDGET_S
from plugserve.registry.components.isolated import IsolatedRunner
from plugserve.registry.components.runner import Checked, Runner, batch_policy
from plugserve.registry.components.stage import Stage
from plugserve.registry.components.streaming import StreamingRunner

__all__ = [
    "LOOP_BUDGET_S",
    "PROCESS_BUDGET_S",
    "BatchedRunner",
    "Checked",
    "IsolatedRunner",
    "LoadedPlugin",
    "Runner",
    "Stage",
    "StreamingRunner",
    "batch_policy",
]
