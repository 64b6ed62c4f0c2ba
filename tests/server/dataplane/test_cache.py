"""The response cache over a real registry: the byte bound, LRU order, keys, invalidation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plugserve.registry.errors import InvalidInput
from plugserve.registry.execution.chain import Chain
from plugserve.registry.lifecycle.registry import Registry
from plugserve.registry.types import RequestContext
from plugserve.server.dataplane.cache import (
    ENTRY_OVERHEAD_BYTES,
    CacheKey,
    ResponseCache,
    freeze,
)
from plugserve.server.dataplane.plane import run_chain
from tests.helpers import write_plugin, write_processor

COUNTING_RUNNER = """
    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Counting:
        def __init__(self, scale, shape):
            self.scale = scale
            self.shape = shape
            self.calls = 0
            self.last = None

        def infer(self, inputs):
            self.calls += 1
            if self.shape == "list":
                return {"y": (inputs["x"] * self.scale).tolist()}
            self.last = inputs["x"] * self.scale
            return {"y": self.last}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Counting(config.get("scale", 2), config.get("shape", "array"))
"""


def write_counter(
    plugins_dir: Path, name: str = "count", cache: bool = True, extra: str = ""
) -> Path:
    """A runner ``y = x * scale`` counting its calls (``component.calls``)."""
    return write_plugin(
        plugins_dir,
        "runner",
        name,
        "1.0.0",
        f"{extra}[runner]\nresponse_cache = {'true' if cache else 'false'}\n"
        '[route]\npreprocess = ["shift"]\n',
        {"plugin.py": COUNTING_RUNNER},
    )


@pytest.fixture
async def registry(plugins_dir: Path, models_dir: Path):  # type: ignore[no-untyped-def]
    write_processor(plugins_dir, "preprocessor", "shift", "1.0.0", amount=0)
    write_counter(plugins_dir)
    reg = Registry(plugins_dir, models_dir, drain_timeout=2)
    await reg.start()
    yield reg
    await reg.close()


def ctx(route: str = "count", **parameters: Any) -> RequestContext:
    return RequestContext("r", route, parameters, {}, "application/json")


def x(*values: float) -> dict[str, np.ndarray]:
    return {"x": np.array([values], dtype=np.float32)}


def chain(registry: Registry, route: str = "count") -> Chain:
    return registry.routes.resolve(route, None)


def calls(registry: Registry, route: str = "count") -> int:
    return int(chain(registry, route).runner.component.calls)


def key_of(c: Chain, data: Any) -> CacheKey:
    key = ResponseCache(1).key(c, data, ctx())
    assert key is not None
    return key


async def infer(cache: ResponseCache, registry: Registry, data: Any, **params: Any) -> Any:
    return await run_chain(cache, chain(registry), data, ctx(**params))


async def test_a_repeated_request_is_answered_without_running_a_stage(
    registry: Registry,
) -> None:
    cache = ResponseCache(1 << 20)
    first = await infer(cache, registry, x(1, 2))
    second = await infer(cache, registry, x(1, 2))
    np.testing.assert_array_equal(second["y"], [[2, 4]])
    np.testing.assert_array_equal(first["y"], second["y"])
    assert calls(registry) == 1
    assert cache.hits == {"count": 1} and cache.misses == {"count": 1}
    stats = chain(registry).runner.stats
    assert stats is not None
    triton = stats.as_triton("count", "1.0.0")
    assert triton["inference_stats"]["cache_hit"]["count"] == 1
    assert triton["inference_stats"]["cache_miss"]["count"] == 1
    assert triton["inference_stats"]["success"]["count"] == 2
    assert triton["execution_count"] == 1  # a hit runs nothing


async def test_a_hit_refuses_a_priority_the_runner_would_refuse(registry: Registry) -> None:
    """Found by attacking it: a hit answered 200 where a miss answered 400 for a priority
    outside the runner's levels (the check was the queue's, which a hit never reaches)."""
    cache = ResponseCache(1 << 20)
    await infer(cache, registry, x(1, 2))
    c = chain(registry)
    context = ctx()
    context.priority = 2  # one level only
    with pytest.raises(InvalidInput, match="priority 2 is outside 1..1"):
        await run_chain(cache, c, x(1, 2), context)
    context.priority = 1
    await run_chain(cache, c, x(1, 2), context)
    assert calls(registry) == 1  # that one was a hit


async def test_cached_arrays_are_copies_and_read_only(registry: Registry) -> None:
    cache = ResponseCache(1 << 20)
    await infer(cache, registry, x(1, 2))
    chain(registry).runner.component.last[...] = 99  # the runner reuses its buffer
    hit = await infer(cache, registry, x(1, 2))
    np.testing.assert_array_equal(hit["y"], [[2, 4]])
    with pytest.raises(ValueError, match="read-only"):
        hit["y"][0, 0] = 5
    hit["z"] = 1  # the dict is the caller's own: the entry keeps its outputs
    assert "z" not in (await infer(cache, registry, x(1, 2)))


async def test_the_key_changes_with_each_part_of_the_request(registry: Registry) -> None:
    cache = ResponseCache(1 << 20)
    c = chain(registry)
    base = cache.key(c, x(1, 2), ctx())
    assert base is not None
    variants = {
        "bytes": cache.key(c, x(1, 3), ctx()),
        "name": cache.key(c, {"w": x(1, 2)["x"]}, ctx()),
        "datatype": cache.key(c, {"x": np.array([[1, 2]], dtype=np.float64)}, ctx()),
        "shape": cache.key(c, {"x": np.array([1, 2], dtype=np.float32)}, ctx()),
        "parameter": cache.key(c, x(1, 2), ctx(mode="fast")),
        "parameter as bytes": cache.key(c, x(1, 2), ctx(mode=b"fast")),
        "parameter as int": cache.key(c, x(1, 2), ctx(mode=1)),
        "parameter as text": cache.key(c, x(1, 2), ctx(mode="1")),
        "route": cache.key(Chain("other", c.preprocess, c.runner, c.postprocess), x(1, 2), ctx()),
        "chain": cache.key(Chain("count", (), c.runner, c.postprocess), x(1, 2), ctx()),
        "bytes element": cache.key(c, {"x": np.array([b"a"], dtype=object)}, ctx()),
        "text element": cache.key(c, {"x": np.array(["a"], dtype=object)}, ctx()),
        "body": cache.key(c, b"\x00\x00\x80?", ctx()),
    }
    digests = {name: k.digest for name, k in variants.items() if k is not None}
    assert len(digests) == len(variants)
    assert len(set(digests.values())) == len(digests) and base.digest not in digests.values()
    # Parameters that only steer scheduling or encoding share the entry.
    for ignored in ({"timeout": 10**6}, {"priority": 1}, {"binary_data_output": True}):
        same = cache.key(c, x(1, 2), ctx(**ignored))
        assert same is not None and same.digest == base.digest
    # Non-contiguous input: the same values, the same key.
    wide = np.array([[1, 9, 2, 9]], dtype=np.float32)[:, ::2]
    strided = cache.key(c, {"x": wide}, ctx())
    assert strided is not None and strided.digest == base.digest


async def test_parameters_and_inputs_each_miss(registry: Registry) -> None:
    cache = ResponseCache(1 << 20)
    await infer(cache, registry, x(1, 2))
    await infer(cache, registry, x(1, 2), mode="fast")
    await infer(cache, registry, x(1, 2), timeout=5_000_000, priority=1)
    await infer(cache, registry, x(2, 2))
    assert calls(registry) == 3
    assert cache.hits == {"count": 1}


async def test_a_digest_collision_is_a_miss_never_a_wrong_answer(registry: Registry) -> None:
    cache = ResponseCache(1 << 20)
    c = chain(registry)
    key = cache.key(c, x(1, 2), ctx())
    assert key is not None
    assert cache.put(key, {"y": np.zeros(2)}, 1)
    forged = CacheKey(
        key.route, key.digest, key.header, (np.frombuffer(b"\1" * 8, np.uint8),), key.loads
    )
    assert cache.get(forged) is None
    assert cache.get(replace(key, header=key.header + b" ")) is None
    assert cache.get(key) is not None
    # Large data is compared as arrays: one byte differing at the end is a miss too.
    large = np.zeros((1, 100_000), dtype=np.float32)
    big = cache.key(c, {"x": large}, ctx())
    assert big is not None and cache.put(big, {"y": np.zeros(2)}, 1)
    last = large.copy()
    last[0, -1] = 1
    changed = cache.key(c, {"x": last}, ctx())
    assert changed is not None and cache.get(replace(changed, digest=big.digest)) is None
    assert cache.get(big) is not None


async def test_the_bound_is_in_bytes_and_the_least_recently_used_goes_first(
    registry: Registry,
) -> None:
    c = chain(registry)
    big = np.zeros(1000, dtype=np.float64)  # 8,000 bytes each
    keys = [key_of(c, x(i)) for i in range(4)]
    one = keys[0]
    size = 8000 + len(one.header) + one.data[0].nbytes + ENTRY_OVERHEAD_BYTES
    cache = ResponseCache(3 * size)
    for key in keys[:3]:
        assert cache.put(key, {"y": big}, 1)
    assert len(cache) == 3 and cache.bytes == 3 * size
    assert cache.get(keys[0]) is not None  # now the most recently used
    assert cache.put(keys[3], {"y": big}, 1)
    assert cache.bytes <= cache.capacity and len(cache) == 3 and cache.evictions == 1
    assert cache.get(keys[1]) is None  # the least recently used went
    assert all(cache.get(k) is not None for k in (keys[0], keys[2], keys[3]))
    # An entry larger than the whole cache is never kept (and evicts nothing).
    assert not cache.put(keys[1], {"y": np.zeros(4000)}, 1)
    assert len(cache) == 3


async def test_off_uncacheable_and_unmarked_routes_run_every_time(
    plugins_dir: Path, models_dir: Path
) -> None:
    write_processor(plugins_dir, "preprocessor", "shift", "1.0.0", amount=0)
    write_counter(plugins_dir, "plain", cache=False)
    write_counter(plugins_dir, "lists", extra='[config]\nshape = "list"\n')
    reg = Registry(plugins_dir, models_dir, drain_timeout=2)
    await reg.start()
    try:
        for cache, route in (
            (ResponseCache(1 << 20), "plain"),
            (ResponseCache(0), "lists"),
            (ResponseCache(1 << 20), "lists"),  # a list: not a result the cache copies
        ):
            before = calls(reg, route)
            for _ in range(2):
                await run_chain(cache, chain(reg, route), x(1, 2), ctx(route))
            assert calls(reg, route) == before + 2
            assert len(cache) == 0
    finally:
        await reg.close()


async def test_a_reload_of_any_stage_invalidates_and_releases(
    plugins_dir: Path, registry: Registry
) -> None:
    cache = ResponseCache(1 << 20)
    registry.listeners.append(cache.listener(registry))
    await infer(cache, registry, x(1, 2))
    await infer(cache, registry, x(1, 2))
    assert calls(registry) == 1 and len(cache) == 1
    # The same version, reloaded: the same answer, but computed again.
    await registry.load(plugins_dir / "runner" / "count" / "1.0.0", force=True)
    assert len(cache) == 0  # released with the old load
    await infer(cache, registry, x(1, 2))
    assert calls(registry) == 1  # the new load's first call
    assert len(cache) == 1
    await registry.load(plugins_dir / "preprocessor" / "shift" / "1.0.0", force=True)
    assert len(cache) == 0
    answer = await infer(cache, registry, x(1, 2))
    np.testing.assert_array_equal(answer["y"], [[2, 4]])
    assert calls(registry) == 2
    await registry.unload(("runner", "count", "1.0.0"))
    assert len(cache) == 0 and cache.bytes == 0


def test_freeze_keeps_arrays_bytes_text_and_flat_mappings_only() -> None:
    frozen = freeze({"a": np.arange(3), "s": np.array([b"xy", "z"], dtype=object), "n": 1})
    assert frozen is not None
    value, size = frozen
    assert not value["a"].flags.writeable and size == 24 + 16 + 3 + 16
    assert freeze(b"abc") == (b"abc", 3)
    assert freeze([1, 2]) is None
    assert freeze({"nested": {"a": 1}}) is None
    assert freeze({"a": np.array([object()], dtype=object)}) is None
