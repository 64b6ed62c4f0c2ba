"""The etcd JSON-gateway client against a real etcd: ranges, compare-and-swap, leases, watch."""

import asyncio

import pytest

from plugserve.registry.fleet.etcd import EtcdClient, EtcdError, WatchCompacted, prefix_end
from tests.etcd import EtcdProcess


@pytest.fixture
async def client(etcd: EtcdProcess):  # type: ignore[no-untyped-def]
    c = EtcdClient([etcd.endpoint])
    yield c
    await c.close()


def test_prefix_end_selects_exactly_the_prefix() -> None:
    import base64

    assert base64.b64decode(prefix_end("/p/")) == b"/p0"
    assert base64.b64decode(prefix_end("/plugserve")) == b"/plugservf"


async def test_compare_and_swap_on_the_mod_revision(client: EtcdClient) -> None:
    done, first, _ = await client.put_if("/t/k", b"one", 0)  # create only
    assert done
    done, _, current = await client.put_if("/t/k", b"two", 0)
    assert not done and current is not None and current.value == b"one"
    assert current.mod_revision == first
    done, second, _ = await client.put_if("/t/k", b"two", first)
    assert done and second > first
    done, _, _ = await client.put_if("/t/k", None, first)  # stale delete refused
    assert not done
    done, _, _ = await client.put_if("/t/k", None, second)
    assert done and await client.get("/t/k") is None


async def test_range_prefix_sees_only_its_prefix(client: EtcdClient) -> None:
    for key in ("/a/1", "/a/2", "/ab", "/b/1"):
        await client.put(key, key.encode())
    revision, kvs = await client.range_prefix("/a/")
    assert [kv.key for kv in kvs] == [b"/a/1", b"/a/2"] and revision >= 4


async def test_keys_and_values_are_bytes_utf8_or_not(client: EtcdClient) -> None:
    """issue 12, finding 2: a key that is not UTF-8 is read back, not an error."""
    await client.put(b"/u/\xff\xfe", b"\x80")
    _, kvs = await client.range_prefix("/u/")
    assert [(kv.key, kv.value) for kv in kvs] == [(b"/u/\xff\xfe", b"\x80")]


async def test_a_lease_keeps_its_keys_until_it_lapses(client: EtcdClient) -> None:
    lease = await client.grant(2)
    await client.put("/lease/k", b"v", lease=lease)
    assert await client.keepalive(lease) == 2
    await client.revoke(lease)
    assert await client.get("/lease/k") is None
    assert await client.keepalive(lease) == 0
    with pytest.raises(EtcdError, match="lease not found"):
        await client.put("/lease/k", b"v", lease=lease)


async def test_watch_streams_changes_in_order_and_breaks_when_etcd_dies(
    client: EtcdClient, etcd: EtcdProcess
) -> None:
    start = await client.put("/w/start", b"")
    seen: list[tuple[str, bytes]] = []

    async def follow() -> None:
        async for batch in client.watch("/w/", start + 1):
            seen.extend((e.kind, e.kv.key) for e in batch.events)

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.2)
    await client.put("/w/a", b"1")
    await client.put("/other", b"x")
    done, _, _ = await client.put_if("/w/a", None, (await client.get("/w/a")).mod_revision)  # type: ignore[union-attr]
    assert done
    for _ in range(50):
        if len(seen) == 2:
            break
        await asyncio.sleep(0.02)
    assert seen == [("PUT", b"/w/a"), ("DELETE", b"/w/a")]
    etcd.stop()
    with pytest.raises(EtcdError):
        await asyncio.wait_for(task, 5)
    with pytest.raises(EtcdError, match="unreachable"):
        await client.get("/w/a")


async def test_a_watch_from_a_compacted_revision_says_so(client: EtcdClient) -> None:
    first = await client.put("/c/k", b"1")
    last = await client.put("/c/k", b"2")
    await client.call("kv/compaction", {"revision": str(last)})
    with pytest.raises(WatchCompacted):
        async for _ in client.watch("/c/", first):
            pass


async def test_with_authentication_the_client_logs_in_and_again_when_its_token_is_lost(
    etcd: EtcdProcess,
) -> None:
    etcd.enable_auth("svc", "s3cret", "/svc/")
    anonymous = EtcdClient([etcd.endpoint])
    with pytest.raises(EtcdError, match="user name is empty"):
        await anonymous.get("/svc/k")
    await anonymous.close()
    wrong = EtcdClient([etcd.endpoint], username="svc", password="nope")
    with pytest.raises(EtcdError, match="refused user 'svc'"):
        await wrong.get("/svc/k")
    await wrong.close()
    client = EtcdClient([etcd.endpoint], username="svc", password="s3cret")
    try:
        await client.put("/svc/k", b"v")
        assert (await client.get("/svc/k")).value == b"v"  # type: ignore[union-attr]
        with pytest.raises(EtcdError, match="permission denied"):
            await client.put("/elsewhere", b"v")
        client._token = "stale.1"  # as after etcd restarted
        assert (await client.get("/svc/k")).value == b"v"  # type: ignore[union-attr]
        lease = await client.grant(5)
        assert await client.keepalive(lease) == 5
    finally:
        await client.close()


async def test_a_watch_carries_values_larger_than_a_line_buffer(client: EtcdClient) -> None:
    """issue 12, finding 2 (found by the property tests): a value over ~390 KiB (512 KiB
    once base64) broke every replica's watch with aiohttp's LineTooLong."""
    start = await client.put("/big/start", b"")
    value = b"x" * 1_400_000  # under etcd's default request limit of 1.5 MiB
    sizes: list[int] = []

    async def follow() -> None:
        async for batch in client.watch("/big/", start + 1):
            sizes.extend(len(e.kv.value) for e in batch.events)
            return

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.2)
    await client.put("/big/value", value)
    await asyncio.wait_for(task, 5)
    assert sizes == [len(value)]
