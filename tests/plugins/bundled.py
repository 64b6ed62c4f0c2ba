"""The bundled plugins' folders, a request context, and a component made without the loader."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import structlog

from plugserve.registry.manifest import load_manifest
from plugserve.registry.types import PluginInfo, RequestContext
from tests.helpers import ROOT

PLUGINS = ROOT / "plugins"
MODELS = ROOT / "models"


def folder(kind: str, name: str) -> Path:
    return PLUGINS / kind / name / "1.0.0"


def context(route: str = "test", parameters: dict[str, Any] | None = None) -> RequestContext:
    return RequestContext("r", route, parameters or {}, {}, "application/json")


def create_component(kind: str, name: str) -> Any:
    """A plugin's component made by its own ``plugserve_create_component`` with a real
    :class:`PluginInfo`, outside any loader: the chat runner's ``start``/``step`` called
    directly, step by step (tests/server/openai_api/test_bundled.py serves it)."""
    where = folder(kind, name)
    manifest = load_manifest(where)
    runner = manifest.runner
    model = None
    info = PluginInfo(name, "1.0.0", manifest.type, where, structlog.get_logger(), None, MODELS)
    if runner is not None and runner.model is not None:
        model = info.resolve(runner.model)
    info = PluginInfo(name, "1.0.0", manifest.type, where, structlog.get_logger(), model, MODELS)
    spec = importlib.util.spec_from_file_location(f"bundled_{kind}_{name}", where / "plugin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.plugserve_create_component(plugin=info, config=manifest.config)
