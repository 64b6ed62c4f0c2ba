"""Regions and their tensors on real /dev/shm objects, and the table workers share."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from plugserve.registry.errors import Forbidden, InvalidInput, NotFound
from plugserve.server.http_api.codec import decode_request
from plugserve.server.triton import shared_memory
from plugserve.server.triton.shared_memory import Regions
from plugserve.server.triton.shm_table import SharedTable

X = np.arange(8, dtype=np.float32).reshape(2, 4)


@pytest.fixture
def objects() -> Iterator[Callable[[bytes], str]]:
    """``objects(data)``: a new object in /dev/shm holding ``data``; its key. Unlinked after."""
    made: list[Path] = []

    def make(data: bytes) -> str:
        path = Path("/dev/shm") / f"plugserve-test-{uuid.uuid4().hex[:12]}"
        path.write_bytes(data)
        made.append(path)
        return "/" + path.name

    yield make
    for path in made:
        path.unlink(missing_ok=True)


def _request(region: str, out_region: str | None = None, byte_size: int = X.nbytes) -> bytes:
    body = (
        b'{"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "parameters": '
        b'{"shared_memory_region": "%s", "shared_memory_byte_size": %d}}]'
        % (region.encode(), byte_size)
    )
    if out_region is not None:
        body += (
            b', "outputs": [{"name": "y", "parameters": {"shared_memory_region": "%s", '
            b'"shared_memory_byte_size": 32}}]' % out_region.encode()
        )
    return body + b"}"


def test_a_region_held_by_a_request_outlives_its_unregister(
    objects: Callable[[bytes], str],
) -> None:
    regions = Regions()
    regions.register("in", objects(X.tobytes()), 0, X.nbytes)
    out_key = objects(bytes(32))
    regions.register("out", out_key, 0, 32)
    request = decode_request(_request("in", "out"), None)
    attached = regions.attach(request)
    regions.unregister()  # while the request runs: both regions go from the table ...
    assert regions.status() == []
    with pytest.raises(NotFound, match="Unable to find system shared memory region: 'in'"):
        regions.attach(decode_request(_request("in"), None))
    attached.read_inputs(request)  # ... and the request still reads and writes them
    np.testing.assert_array_equal(request.inputs["x"], X)
    assert not request.inputs["x"].flags.writeable
    attached.write_outputs({"y": X * 2})
    assert Path("/dev/shm" + out_key).read_bytes() == (X * 2).tobytes()


def test_a_shrunk_object_is_a_400_not_a_crash(objects: Callable[[bytes], str]) -> None:
    regions = Regions()
    key = objects(X.tobytes())
    regions.register("in", key, 0, X.nbytes)
    os.truncate("/dev/shm" + key, 8)  # the client shrinks it after registering
    request = decode_request(_request("in"), None)
    attached = regions.attach(request)
    with pytest.raises(InvalidInput, match="is now shorter than the region registered"):
        attached.read_inputs(request)
    # Found by attacking it: a write past the shrunk end grew the object again, and answered 200.
    with pytest.raises(InvalidInput, match="is now shorter than the region registered"):
        regions.write("in", 16, b"\0" * 16)
    assert os.stat("/dev/shm" + key).st_size == 8


def test_regions_offsets_and_bounds(objects: Callable[[bytes], str]) -> None:
    regions = Regions()
    key = objects(b"\0" * 16 + X.tobytes())
    regions.register("r", key, 16, X.nbytes)
    assert regions.status("r") == [{"name": "r", "key": key, "offset": 16, "byte_size": 32}]
    np.testing.assert_array_equal(regions.read("r", 0, 32).view(np.float32), X.reshape(-1))
    regions.write("r", 28, b"\1\2\3\4")
    assert Path("/dev/shm" + key).read_bytes()[44:] == b"\1\2\3\4"
    with pytest.raises(InvalidInput, match="runs past the end of region 'r'"):
        regions.write("r", 30, b"\1\2\3")
    with pytest.raises(InvalidInput, match="runs past the end of region 'r'"):
        regions.read("r", 1, 32)
    with pytest.raises(InvalidInput, match="runs past the end of"):
        regions.register("big", key, 16, 33)
    with pytest.raises(NotFound, match="Unable to find system shared memory region: 'nope'"):
        regions.status("nope")
    regions.unregister("nope")  # no error, as in Triton
    assert [r["name"] for r in regions.status()] == ["r"]


def test_at_most_max_regions(
    objects: Callable[[bytes], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_memory, "MAX_REGIONS", 2)
    regions = Regions()
    key = objects(bytes(8))
    regions.register("a", key, 0, 8)
    regions.register("b", key, 0, 8)
    with pytest.raises(InvalidInput, match="2 shared memory regions are registered already"):
        regions.register("c", key, 0, 8)


@pytest.mark.parametrize("key", ["x", "/a/b", "/.", "/..", "//x", "/x\n", "/" + "a" * 256, 7])
def test_keys_that_are_not_posix_shm_names_are_refused(key: object) -> None:
    with pytest.raises(InvalidInput, match="POSIX shared memory name"):
        shared_memory.check_key(key)


def test_a_fifo_is_not_a_shared_memory_object() -> None:
    path = Path("/dev/shm") / f"plugserve-test-{uuid.uuid4().hex[:12]}"
    os.mkfifo(path)
    try:
        with pytest.raises(InvalidInput, match="is not a shared memory object"):
            Regions().register("f", "/" + path.name, 0, 0)
    finally:
        path.unlink()


def test_who_may_use_shared_memory() -> None:
    for remote in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        Regions(access="loopback").admit(remote)
    with pytest.raises(Forbidden, match="not on loopback"):
        Regions(access="loopback").admit("10.1.2.3")
    Regions(access="loopback").admit(None, local=True)  # a Unix socket peer
    Regions(access="any").admit("10.1.2.3")
    with pytest.raises(Forbidden, match="turned off"):
        Regions(access="off").admit("127.0.0.1")


@pytest.mark.parametrize(
    ("peer", "seen"),
    [
        ("ipv4:127.0.0.1:50051", ("127.0.0.1", False)),
        ("ipv6:[::1]:50051", ("::1", False)),
        ("ipv6:%5B::1%5D:50051", ("::1", False)),
        ("ipv4:10.0.0.7:50051", ("10.0.0.7", False)),
        ("unix:/tmp/socket", (None, True)),
        ("something-else", (None, False)),
    ],
)
def test_grpc_peers(peer: str, seen: tuple[str | None, bool]) -> None:
    assert shared_memory.grpc_peer(peer) == seen


def test_grpc_peers_are_admitted_as_http_peers() -> None:
    regions = Regions(access="loopback")
    regions.admit(*shared_memory.grpc_peer("ipv6:%5B::1%5D:50051"))
    regions.admit(*shared_memory.grpc_peer("unix:/run/plugserve.sock"))
    with pytest.raises(Forbidden):
        regions.admit(*shared_memory.grpc_peer("ipv4:192.168.1.20:50051"))


def test_workers_share_the_table(tmp_path: Path, objects: Callable[[bytes], str]) -> None:
    """Two workers: what one registers the other opens on first use; unregister reaches both."""
    one, two = Regions(SharedTable(tmp_path)), Regions(SharedTable(tmp_path))
    first, second = objects(X.tobytes()), objects((X + 1).tobytes())
    one.register("in", first, 0, X.nbytes)
    assert two.status() == one.status()
    np.testing.assert_array_equal(two.read("in", 0, 32).view(np.float32), X.reshape(-1))
    with pytest.raises(InvalidInput, match="already in manager"):
        two.register("in", second, 0, X.nbytes)
    one.unregister("in")
    with pytest.raises(NotFound):
        two.read("in", 0, 32)
    one.register("in", second, 0, X.nbytes)  # the same name, another object: reopened
    np.testing.assert_array_equal(two.read("in", 0, 32).view(np.float32), X.reshape(-1) + 1)
    two.unregister()
    assert one.status() == []


def _replace(key: str, data: bytes) -> None:
    """The owner unlinks the object; someone creates another under its key."""
    os.unlink("/dev/shm" + key)
    Path("/dev/shm" + key).write_bytes(data)


def test_another_process_opens_the_object_registered_not_the_key(
    tmp_path: Path, objects: Callable[[bytes], str]
) -> None:
    """Issue 29 finding 4, in one process: a worker that opens a region after its object
    was unlinked and another created under its key opens the object registered (the
    holder's descriptor), and reads and writes it, never the newcomer."""
    holder, worker = Regions(SharedTable(tmp_path)), Regions(SharedTable(tmp_path))
    key = objects(X.tobytes() + bytes(32))
    holder.register("r", key, 0, 64)
    _replace(key, b"\x7f" * 64)
    np.testing.assert_array_equal(worker.read("r", 0, 32).view(np.float32), X.reshape(-1))
    worker.write("r", 32, (X * 2).tobytes())
    np.testing.assert_array_equal(holder.read("r", 32, 32).view(np.float32), (X * 2).reshape(-1))
    assert Path("/dev/shm" + key).read_bytes() == b"\x7f" * 64


def test_without_proc_a_replaced_object_is_a_400(
    tmp_path: Path, objects: Callable[[bytes], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the holder's descriptor cannot be opened (no /proc), a worker opens the key:
    the object registered is used; a newcomer under its key, or none, is a 400."""
    monkeypatch.setattr(shared_memory, "PROC_DIR", str(tmp_path / "no-proc"))
    holder = Regions(SharedTable(tmp_path))
    key, other = objects(X.tobytes()), objects(X.tobytes())
    holder.register("kept", key, 0, 32)
    holder.register("replaced", other, 0, 32)
    _replace(other, b"\x7f" * 32)
    worker = Regions(SharedTable(tmp_path))
    np.testing.assert_array_equal(worker.read("kept", 0, 32).view(np.float32), X.reshape(-1))
    replaced = f"the object registered as '{other}' has been unlinked or replaced since"
    with pytest.raises(InvalidInput, match=replaced):
        worker.write("replaced", 0, b"\0" * 4)
    assert Path("/dev/shm" + other).read_bytes() == b"\x7f" * 32
    os.unlink("/dev/shm" + other)
    with pytest.raises(InvalidInput, match=replaced):
        worker.read("replaced", 0, 32)
    with pytest.raises(InvalidInput, match="register the region again"):  # nor on a retry
        Regions(SharedTable(tmp_path)).read("replaced", 0, 32)
