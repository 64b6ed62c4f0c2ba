"""Loaded plugin instances, by kind: how a request reaches a plugin version's component.

- ``base``: :class:`LoadedPlugin`, what every kind shares (label, version, manifest,
  requests in flight, warmup and close, statistics);
- ``stage``: :class:`Stage`, a preprocessor or postprocessor;
- ``runner``: :class:`Runner`, what every runner kind shares (its ``[runner]`` table, its
  inputs as named arrays, its ``validate``);
- ``batched``: :class:`BatchedRunner`, requests batched by its scheduler;
- ``streaming``: :class:`StreamingRunner`, several responses to a request;
- ``isolated``: :class:`IsolatedRunner`, a runner in processes of its own;
- ``inline``: when a synchronous call runs on the event loop rather than on a thread.

The loader (``registry/lifecycle/loader.py``) builds the kind that a version's manifest
and component make.
"""

from plugserve.registry.execution.components.base import LoadedPlugin
from plugserve.registry.execution.components.batched import BatchedRunner
from plugserve.registry.execution.components.inline import LOOP_BUDGET_S, PROCESS_BUDGET_S
from plugserve.registry.execution.components.isolated import IsolatedRunner
from plugserve.registry.execution.components.runner import Checked, Runner, batch_policy
from plugserve.registry.execution.components.stage import Stage
from plugserve.registry.execution.components.streaming import StreamingRunner

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
