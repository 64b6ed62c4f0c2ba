"""The typed facade over pluggy: built-ins, entry points (through a fake .dist-info), conflicts."""

import asyncio
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from plugserve.registry.errors import BackendConflict
from plugserve.registry.plugins.hooks import PluginHooks
from tests.helpers import fake_distribution

ECHO_BACKEND = """
    import pluggy
    hookimpl = pluggy.HookimplMarker("plugserve")

    class Echo:
        def __init__(self, runner):
            self.runner = dict(runner)
        def infer(self, inputs):
            return dict(inputs)

    def factory(plugin, runner, model_path):
        return Echo(runner)

    @hookimpl
    def plugserve_backends():
        return {"echo": factory}

    STARTED = []

    @hookimpl
    async def plugserve_startup(app):
        STARTED.append(app)
"""


def test_builtin_backends_are_registered_through_the_hook() -> None:
    host = PluginHooks()
    assert host.backends() == {}
    host.load_builtins()
    assert set(host.backends()) == {"onnxruntime", "tensorrt"}
    assert host.backends()["onnxruntime"].model_filename == "model.onnx"  # type: ignore[attr-defined]
    assert host.backends()["tensorrt"].model_filename == "model.plan"  # type: ignore[attr-defined]


def test_entry_point_package_adds_a_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_distribution(tmp_path, "plugserve_echo", {"echo": "echo_backend"},
                      {"echo_backend": ECHO_BACKEND})  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHooks()
    host.load_builtins()
    assert host.load_entry_points() == ["entrypoint:echo"]
    assert set(host.backends()) == {"onnxruntime", "tensorrt", "echo"}
    assert host.load_entry_points() == []  # idempotent


def test_broken_entry_point_is_logged_and_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_distribution(
        tmp_path,
        "plugserve_mixed",
        {"good": "good_backend", "broken": "missing_module_xyz"},
        {"good_backend": ECHO_BACKEND},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHooks()
    assert host.load_entry_points() == ["entrypoint:good"]
    assert "echo" in host.backends()


def test_two_providers_of_one_backend_name_is_an_error_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clash = "import pluggy\nh = pluggy.HookimplMarker('plugserve')\n" \
            "@h\ndef plugserve_backends():\n    return {'onnxruntime': lambda *a: None}\n"  # fmt: skip
    fake_distribution(tmp_path, "plugserve_clash", {"clash": "clash_backend"},
                      {"clash_backend": clash})  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHooks()
    host.load_builtins()
    host.load_entry_points()
    with pytest.raises(BackendConflict) as info:
        host.backends()
    assert "'onnxruntime'" in info.value.message
    assert "builtin:onnxruntime" in info.value.message
    assert "entrypoint:clash" in info.value.message


async def test_lifecycle_hooks_are_called_and_awaited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_distribution(tmp_path, "plugserve_life", {"life": "life_backend"},
                      {"life_backend": ECHO_BACKEND})  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHooks()
    host.load_entry_points()
    app = web.Application()
    await host.startup(app)
    import life_backend  # type: ignore[import-not-found]

    assert [app] == life_backend.STARTED


async def test_a_failing_lifecycle_hook_does_not_stop_the_others() -> None:
    calls = []

    class Bad:
        from plugserve.registry.hookspecs import hookimpl

        @hookimpl
        def plugserve_shutdown(self, app: web.Application) -> None:
            raise RuntimeError("bad")

    class Good:
        from plugserve.registry.hookspecs import hookimpl

        @hookimpl
        def plugserve_shutdown(self, app: web.Application) -> None:
            calls.append(app)

    host = PluginHooks()
    host.register(Bad(), "bad")
    host.register(Good(), "good")
    app = web.Application()
    await host.shutdown(app)
    assert calls == [app]


@pytest.mark.parametrize("hook", ["plugserve_startup", "plugserve_shutdown"])
async def test_a_lifecycle_hook_that_never_returns_is_given_up_and_the_others_run(
    hook: str,
) -> None:
    """issue 12, class "every call into plugin code that is not a request has a bound":
    startup and shutdown hooks, sync (on a thread) or async, each stop being waited for."""
    calls: list[str] = []
    release = threading.Event()

    def sync_hang(app: web.Application) -> None:
        calls.append("sync")
        release.wait()

    async def async_hang(app: web.Application) -> None:
        calls.append("async")
        await asyncio.Event().wait()

    def good(app: web.Application) -> None:
        calls.append("good")

    from plugserve.registry.hookspecs import hookimpl

    host = PluginHooks()
    for function in (sync_hang, async_hang, good):
        plugin = type(function.__name__, (), {hook: staticmethod(hookimpl(function))})
        host.register(plugin, function.__name__)
    started = time.monotonic()
    if hook == "plugserve_startup":
        await asyncio.wait_for(host.startup(web.Application(), 0.3), 10)
    else:
        await asyncio.wait_for(host.shutdown(web.Application(), 0.3), 10)
    assert time.monotonic() - started < 2
    assert sorted(calls) == ["async", "good", "sync"]
    release.set()
