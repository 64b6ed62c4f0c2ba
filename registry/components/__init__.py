"""Loaded plugin instances: a plugin version's component, how to call it, who is using it."""

from plugserve.registry.components.base import (
    LOOP_BUDGET_S,
    PROCESS_BUDGET_S,
    Checked,
    LoadedPlugin,
    batch_policy,
)

__all__ = ["LOOP_BUDGET_S", "PROCESS_BUDGET_S", "Checked", "LoadedPlugin", "batch_policy"]
