"""Fixtures for the bundled plugins: each loaded from plugins/ against the committed models/."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from plugserve.registry.lifecycle.loader import Loader
from plugserve.registry.plugins.hooks import PluginHooks
from tests.plugins.bundled import MODELS, PLUGINS, folder


@pytest.fixture
async def bundled() -> AsyncIterator[Callable[[str, str], Awaitable[Any]]]:
    """``await bundled(kind, name)``: the component of that bundled plugin, loaded by the
    real loader (manifest, import, create, warmup); released after the test."""
    host = PluginHooks()
    host.load_builtins()
    loader = Loader(host, MODELS, plugins_dir=PLUGINS)
    loaded = []

    async def load(kind: str, name: str) -> Any:
        loaded.append(await loader.load(folder(kind, name)))
        return loaded[-1].component

    yield load
    for plugin in loaded:
        await loader.release(plugin)
