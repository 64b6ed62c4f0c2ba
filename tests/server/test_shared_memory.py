"""Triton's system shared memory extension, through the unchanged tritonclient[http]."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from onnx import TensorProto
from tritonclient import utils
from tritonclient.utils import InferenceServerException

from tests.helpers import (
    PID_RUNNER,
    ServerProcess,
    identity_model,
    until,
    write_add_runner,
    write_plugin,
)

pytestmark = pytest.mark.slow

X = np.arange(8, dtype=np.float32).reshape(2, 4)


@pytest.fixture
def plugins(plugins_dir: Path) -> Path:
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    folder = write_plugin(
        plugins_dir,
        "runner",
        "ident",
        "1.0.0",
        '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\n',
        module=None,
    )
    identity_model(
        folder / "model.onnx",
        {"s": TensorProto.STRING, "h": TensorProto.FLOAT16, "b": TensorProto.BOOL},
    )
    return plugins_dir


@pytest.fixture
def regions() -> Iterator[Callable[[int], shm.SharedMemoryRegion]]:
    """``regions(size)`` creates a region under a fresh key; all are destroyed after."""
    made: list[shm.SharedMemoryRegion] = []

    def make(size: int) -> shm.SharedMemoryRegion:
        name = uuid.uuid4().hex[:12]
        made.append(shm.create_shared_memory_region(name, f"/plugserve-test-{name}", size))
        return made[-1]

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def _start(
    server: Callable[..., ServerProcess],
    plugins: Path,
    models: Path,
    *args: str,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    return server("--plugins-dir", str(plugins), "--models-dir", str(models), *args, env=env)


def _client(srv: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(f"127.0.0.1:{srv.port}")


def _register(
    client: httpclient.InferenceServerClient, handle: shm.SharedMemoryRegion, size: int
) -> None:
    client.register_system_shared_memory(handle._triton_shm_name, handle._shm_key, size)


Request = tuple[list[httpclient.InferInput], list[httpclient.InferRequestedOutput]]


def _infer(client: httpclient.InferenceServerClient, request: Request) -> httpclient.InferResult:
    return client.infer("add", request[0], outputs=request[1])


def _add_request(
    in_region: str, out_region: str, out_size: int = X.nbytes, in_size: int = X.nbytes
) -> Request:
    inp = httpclient.InferInput("x", [2, 4], "FP32")
    inp.set_shared_memory(in_region, in_size)
    out = httpclient.InferRequestedOutput("y", binary_data=True)
    out.set_shared_memory(out_region, out_size)
    return [inp], [out]


def _serving_workers(srv: ServerProcess, workers: int) -> int:
    """How many processes have used the regions: one process opened them at registration;
    with workers the supervisor did, and each worker opens them on first use."""
    if workers == 1:
        return int("shm_registered" in srv.log())
    events = re.compile(r"shm_opened\b.*\bworker=(\d+)")
    return len({m[1] for line in srv.log().splitlines() if (m := events.search(line))})


@pytest.mark.workers(1, 2)
def test_input_and_output_in_shared_memory_on_every_worker(
    workers: int,
    server: Callable[..., ServerProcess],
    plugins: Path,
    models_dir: Path,
    regions: Callable[[int], shm.SharedMemoryRegion],
) -> None:
    srv = _start(server, plugins, models_dir)
    ins, outs = regions(X.nbytes), regions(X.nbytes)
    shm.set_shared_memory_region(ins, [X])
    control = _client(srv)
    _register(control, ins, X.nbytes)
    _register(control, outs, X.nbytes)
    # Each new client is a new connection: with 2 workers, go on until both have served
    # some (the one that registered the regions, and the other, which opens them then).
    # SO_REUSEPORT spreads them unevenly on a loaded machine: a time bound, not a count.
    deadline = time.monotonic() + 60
    for round in range(10_000):
        client = _client(srv)
        result = _infer(client, _add_request(ins._triton_shm_name, outs._triton_shm_name))
        output = result.get_output("y")
        assert output == {"name": "y", "datatype": "FP32", "shape": [2, 4]}  # no data
        got = shm.get_contents_as_numpy(outs, np.float32, [2, 4])
        np.testing.assert_array_equal(got, X + 1 + round)
        shm.set_shared_memory_region(ins, [X + 1 + round])
        client.close()
        if round >= 3 and _serving_workers(srv, workers) == workers:
            break
        if time.monotonic() > deadline:
            break
    assert _serving_workers(srv, workers) == workers
    assert control.get_server_metadata()["extensions"].count("system_shared_memory") == 1
    status = control.get_system_shared_memory_status()
    assert sorted(status, key=lambda r: r["name"]) == sorted(
        [
            {"name": h._triton_shm_name, "key": h._shm_key, "offset": 0, "byte_size": X.nbytes}
            for h in (ins, outs)
        ],
        key=lambda r: r["name"],
    )
    control.unregister_system_shared_memory(ins._triton_shm_name)
    for _ in range(6):  # gone on every worker
        client = _client(srv)
        with pytest.raises(InferenceServerException) as caught:
            _infer(client, _add_request(ins._triton_shm_name, outs._triton_shm_name))
        assert caught.value.status() == "404"
        assert f"Unable to find system shared memory region: '{ins._triton_shm_name}'" in str(
            caught.value
        )
        assert [r["name"] for r in client.get_system_shared_memory_status()] == [
            outs._triton_shm_name
        ]
        client.close()
    control.unregister_system_shared_memory()
    assert control.get_system_shared_memory_status() == []


def test_bytes_fp16_and_bool_with_offsets_and_request_order(
    server: Callable[..., ServerProcess],
    plugins: Path,
    models_dir: Path,
    regions: Callable[[int], shm.SharedMemoryRegion],
) -> None:
    client = _client(_start(server, plugins, models_dir))
    s = np.array([[b"alpha", b"\xce\xb2"], [b"", b"d"]], dtype=object)
    h = np.array([[1.5, -2.0]], dtype=np.float16)
    b = np.array([[True, False]])
    s_raw = utils.serialize_byte_tensor(s)
    s_size = utils.serialized_byte_size(s_raw)
    ins = regions(64 + s_size)
    shm.set_shared_memory_region(ins, [h], offset=8)
    shm.set_shared_memory_region(ins, [s_raw], offset=64)
    outs = regions(256)
    _register(client, ins, 64 + s_size)
    _register(client, outs, 256)
    name_in, name_out = ins._triton_shm_name, outs._triton_shm_name
    inputs = [
        httpclient.InferInput("in_s", [2, 2], "BYTES"),
        httpclient.InferInput("in_b", [1, 2], "BOOL"),  # from the body, between two in memory
        httpclient.InferInput("in_h", [1, 2], "FP16"),
    ]
    inputs[0].set_shared_memory(name_in, s_size, offset=64)
    inputs[1].set_data_from_numpy(b, binary_data=False)
    inputs[2].set_shared_memory(name_in, h.nbytes, offset=8)
    outputs = [
        httpclient.InferRequestedOutput("out_s"),
        httpclient.InferRequestedOutput("out_h"),
        httpclient.InferRequestedOutput("out_b"),
    ]
    outputs[0].set_shared_memory(name_out, 200)  # room to spare: as Triton allows
    outputs[1].set_shared_memory(name_out, 4, offset=200)
    result = client.infer("ident", inputs, outputs=outputs)
    out_s = result.get_output("out_s")
    assert out_s == {"name": "out_s", "datatype": "BYTES", "shape": [2, 2]}
    np.testing.assert_array_equal(shm.get_contents_as_numpy(outs, np.object_, [2, 2]), s)
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(outs, np.float16, [1, 2], offset=200), h
    )
    np.testing.assert_array_equal(result.as_numpy("out_b"), b)  # not in shared memory


def test_every_size_and_name_error(
    server: Callable[..., ServerProcess],
    plugins: Path,
    models_dir: Path,
    regions: Callable[[int], shm.SharedMemoryRegion],
) -> None:
    srv = _start(server, plugins, models_dir)
    client = _client(srv)
    ins, outs = regions(X.nbytes), regions(X.nbytes)
    shm.set_shared_memory_region(ins, [X])
    sentinel = np.full(X.size + 4, 7, dtype=np.float32)
    _register(client, ins, X.nbytes)
    name_in, name_out = ins._triton_shm_name, outs._triton_shm_name

    def refused(request: Request) -> str:
        with pytest.raises(InferenceServerException) as caught:
            _infer(client, request)
        assert caught.value.status() == "400", caught.value
        return str(caught.value)

    # Registering: the object must exist, be a regular file and hold offset + byte_size.
    big = regions(16)
    with pytest.raises(InferenceServerException, match="runs past the end of"):
        _register(client, big, 32)
    with pytest.raises(InferenceServerException, match="Unable to open shared memory region"):
        client.register_system_shared_memory("gone", "/plugserve-test-no-such-object", 8)
    for key in ("nope", "/a/b", "/..", "/../etc/passwd", "/dev/shm/x", "/"):
        with pytest.raises(InferenceServerException, match="POSIX shared memory name") as c:
            client.register_system_shared_memory("bad", key, 8)
        assert c.value.status() == "400"
    link = Path("/dev/shm") / f"plugserve-test-link-{uuid.uuid4().hex[:8]}"
    link.symlink_to(f"/dev/shm/{ins._shm_key[1:]}")
    try:
        with pytest.raises(InferenceServerException, match="Unable to open"):
            client.register_system_shared_memory("link", "/" + link.name, 8)
    finally:
        link.unlink()
    with pytest.raises(InferenceServerException, match="already in manager"):
        _register(client, ins, X.nbytes)

    # The output region: registered short, with the sentinel after what it may hold.
    with open(f"/dev/shm/{outs._shm_key[1:]}", "r+b") as f:
        f.truncate(sentinel.nbytes)
        f.write(sentinel.tobytes())
    client.register_system_shared_memory(name_out, outs._shm_key, X.nbytes - 4)

    # Inputs: byte_size must be the tensor's, and lie within the region.
    assert "needs 32 bytes; shared_memory_byte_size is 16" in refused(
        _add_request(name_in, name_out, in_size=16, out_size=X.nbytes - 4)
    )
    inputs, outputs = _add_request(name_in, name_out, out_size=X.nbytes - 4)
    inputs[0].set_shared_memory(name_in, X.nbytes, offset=4)
    assert "runs past the end of region" in refused((inputs, outputs))
    assert _status(client, _add_request("unknown", name_out)) == "404"
    # Outputs: the region asked for must lie in the registered one; then it must fit.
    assert "runs past the end of region" in refused(
        _add_request(name_in, name_out, out_size=X.nbytes)
    )
    message = refused(_add_request(name_in, name_out, out_size=X.nbytes - 4))
    assert "(28 bytes) should be at least 32 bytes to hold the results" in message
    after = np.fromfile(f"/dev/shm/{outs._shm_key[1:]}", dtype=np.float32)
    np.testing.assert_array_equal(after, sentinel)  # nothing written, least of all past the end

    # The parameters: both or neither, no data besides.
    for params, text in (
        ({"shared_memory_region": name_in}, "needs shared_memory_byte_size"),
        ({"shared_memory_byte_size": 32}, "needs shared_memory_region"),
        ({"shared_memory_region": name_in, "shared_memory_byte_size": -1}, "non-negative"),
    ):
        bare = {"name": "x", "shape": [2, 4], "datatype": "FP32", "parameters": params}
        status, _, body = srv.request("POST", "/v2/models/add/infer", {"inputs": [bare]})
        assert (status, text in body.decode()) == (400, True), body
    inp: dict[str, Any] = {
        "name": "x",
        "shape": [2, 4],
        "datatype": "FP32",
        "data": X.reshape(-1).tolist(),
        "parameters": {"shared_memory_region": name_in, "shared_memory_byte_size": 32},
    }
    status, _, body = srv.request("POST", "/v2/models/add/infer", {"inputs": [inp]})
    assert status == 400 and b"takes no 'data'" in body


def _status(client: httpclient.InferenceServerClient, request: Request) -> str:
    with pytest.raises(InferenceServerException) as caught:
        _infer(client, request)
    return str(caught.value.status())


def test_cuda_shared_memory_needs_a_gpu(
    server: Callable[..., ServerProcess], plugins: Path, models_dir: Path
) -> None:
    """Triton's examples unregister every CUDA region first: that works; registering cannot."""
    client = _client(_start(server, plugins, models_dir))
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("any")
    assert client.get_cuda_shared_memory_status() == []
    with pytest.raises(InferenceServerException, match="Unable to find cuda shared memory"):
        client.get_cuda_shared_memory_status("any")
    with pytest.raises(InferenceServerException) as caught:
        client.register_cuda_shared_memory("gpu", "aGFuZGxl", 0, 64)
    assert caught.value.status() == "400"
    assert "GPUs not supported: CUDA shared memory needs a GPU and cuda-python" in str(caught.value)
    assert "cuda_shared_memory" not in client.get_server_metadata()["extensions"]


def test_the_inference_token_and_the_setting_apply(
    server: Callable[..., ServerProcess],
    plugins: Path,
    models_dir: Path,
    tmp_path: Path,
    regions: Callable[[int], shm.SharedMemoryRegion],
) -> None:
    handle = regions(X.nbytes)
    token = "t" * 32
    srv = _start(server, plugins, models_dir, env={"PLUGSERVE_INFERENCE_TOKEN": token})
    with pytest.raises(InferenceServerException) as caught:
        _register(_client(srv), handle, X.nbytes)
    assert caught.value.status() == "401"
    _client(srv).register_system_shared_memory(
        "r", handle._shm_key, X.nbytes, headers={"Authorization": f"Bearer {token}"}
    )
    config = tmp_path / "off.toml"
    config.write_text('shared_memory = "off"\n')
    off = _client(_start(server, plugins, models_dir, "--config", str(config)))
    with pytest.raises(InferenceServerException, match="turned off") as caught:
        _register(off, handle, X.nbytes)
    assert caught.value.status() == "403"
    with pytest.raises(InferenceServerException, match="turned off"):
        _infer(off, _add_request("r", "r"))


SLOW_RUNNER = """
    import time

    import numpy as np
    import pluggy

    hookimpl = pluggy.HookimplMarker("plugserve")

    class Slow:
        def infer(self, inputs):
            time.sleep(1.0)
            return {"y": np.asarray(inputs["x"]) * 2}

    @hookimpl
    def plugserve_create_component(plugin, config):
        return Slow()
"""


def test_unregister_while_a_request_uses_the_regions(
    server: Callable[..., ServerProcess],
    plugins_dir: Path,
    models_dir: Path,
    regions: Callable[[int], shm.SharedMemoryRegion],
) -> None:
    """The request in flight reads and writes its regions to the end; the next finds none."""
    write_plugin(plugins_dir, "runner", "slow", "1.0.0", "", {"plugin.py": SLOW_RUNNER})
    srv = _start(server, plugins_dir, models_dir)
    ins, outs = regions(X.nbytes), regions(X.nbytes)
    shm.set_shared_memory_region(ins, [X])
    client = _client(srv)
    _register(client, ins, X.nbytes)
    _register(client, outs, X.nbytes)
    inputs, outputs = _add_request(ins._triton_shm_name, outs._triton_shm_name)
    pending = client.async_infer("slow", inputs, outputs=outputs)
    time.sleep(0.4)  # the runner holds the request
    _client(srv).unregister_system_shared_memory()
    assert _client(srv).get_system_shared_memory_status() == []
    result = pending.get_result()
    assert result.get_output("y") == {"name": "y", "datatype": "FP32", "shape": [2, 4]}
    np.testing.assert_array_equal(shm.get_contents_as_numpy(outs, np.float32, [2, 4]), X * 2)
    with pytest.raises(InferenceServerException, match="Unable to find system shared memory"):
        client.infer("slow", inputs, outputs=outputs)


@pytest.fixture
def owner() -> Iterator[Callable[[str, bytes], int]]:
    """``owner(key, data)``: a new object ``/dev/shm<key>`` holding ``data``, as a client
    creates it (``shm_open``, ``ftruncate``); its descriptor, kept open by the test (the
    object's memory, unlinked or not). Every object left under those keys is unlinked after."""
    keys: list[str] = []
    fds: list[int] = []

    def create(key: str, data: bytes) -> int:
        fd = os.open("/dev/shm" + key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.pwrite(fd, data, 0)
        keys.append(key)
        fds.append(fd)
        return fd

    yield create
    for fd in fds:
        os.close(fd)
    for key in keys:
        Path("/dev/shm" + key).unlink(missing_ok=True)


def _fresh_keys() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:12]
    return f"/plugserve-test-in-{tag}", f"/plugserve-test-out-{tag}"


SENTINEL = np.full(8, -7.0, dtype=np.float32).tobytes()


def _replace_objects(
    owner: Callable[[str, bytes], int], key_in: str, key_out: str
) -> tuple[int, int]:
    """The owner unlinks both objects (keeping its descriptors, as Triton allows), and
    someone creates new objects under the same keys: their descriptors."""
    for key in (key_in, key_out):
        os.unlink("/dev/shm" + key)
    return owner(key_in, (X + 100).tobytes()), owner(key_out, SENTINEL)


def _pid_request() -> Request:
    inputs, outputs = _add_request("in", "out")
    return inputs, [*outputs, httpclient.InferRequestedOutput("pid", binary_data=True)]


def _worker_pids(srv: ServerProcess) -> set[int]:
    code, _, body = srv.request("GET", "/admin/status")
    return {w["pid"] for w in json.loads(body)["workers"]} if code == 200 else set()


@pytest.mark.workers(2)
def test_a_region_is_the_object_registered_on_every_worker(
    server: Callable[..., ServerProcess],
    plugins_dir: Path,
    models_dir: Path,
    owner: Callable[[str, bytes], int],
) -> None:
    """Issue 29 finding 4: the owner registers its objects, unlinks them, and someone
    creates new objects under the same keys: every worker reads the inputs from the object
    registered and writes the outputs into the one registered, never the newcomer's."""
    write_plugin(plugins_dir, "runner", "addpid", "1.0.0", "", {"plugin.py": PID_RUNNER})
    srv = _start(server, plugins_dir, models_dir)
    key_in, key_out = _fresh_keys()
    fd_in, fd_out = owner(key_in, X.tobytes()), owner(key_out, bytes(X.nbytes))
    control = _client(srv)
    control.register_system_shared_memory("in", key_in, X.nbytes)
    control.register_system_shared_memory("out", key_out, X.nbytes)
    _, new_out = _replace_objects(owner, key_in, key_out)
    served: set[int] = set()
    for round in range(80):  # new connections, until both workers have served 5 at least
        os.pwrite(fd_in, (X + round).tobytes(), 0)
        client = _client(srv)
        inputs, outputs = _pid_request()
        result = client.infer("addpid", inputs, outputs=outputs)
        client.close()
        served.add(int(result.as_numpy("pid")[0, 0]))
        got = np.frombuffer(os.pread(fd_out, X.nbytes, 0), dtype=np.float32)
        np.testing.assert_array_equal(got, (X + round + 1).reshape(-1))
        if round >= 10 and len(served) == 2:
            break
    assert served == _worker_pids(srv)
    assert os.pread(new_out, X.nbytes, 0) == SENTINEL  # nothing written into the newcomer
    assert sorted(r["name"] for r in control.get_system_shared_memory_status()) == ["in", "out"]
    supervisor = Path(f"/proc/{srv.proc.pid}/fd")
    assert _holds(supervisor, key_in) and _holds(supervisor, key_out)
    control.unregister_system_shared_memory()
    assert not _holds(supervisor, key_in) and not _holds(supervisor, key_out)


def _holds(fds: Path, key: str) -> bool:
    """Whether a process (its /proc/<pid>/fd) has the unlinked object once under ``key``."""
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):  # one closed meanwhile
            if os.readlink(fd) == f"/dev/shm{key} (deleted)":
                return True
    return False


@pytest.mark.workers(2)
def test_workers_started_after_the_owner_unlinked_use_the_object_registered(
    server: Callable[..., ServerProcess],
    plugins_dir: Path,
    models_dir: Path,
    owner: Callable[[str, bytes], int],
) -> None:
    """Issue 29 finding 4, variant: both workers are killed (SIGKILL) after the owner
    unlinked its objects and others took their keys; the workers started in their place
    (which never saw the objects registered) read and write the objects registered."""
    write_plugin(plugins_dir, "runner", "addpid", "1.0.0", "", {"plugin.py": PID_RUNNER})
    srv = _start(server, plugins_dir, models_dir)
    # (an OSError: a connection a starting or killed worker reset, is "not yet")
    until(lambda: len(_worker_pids(srv)) == 2, 30, "both workers registered", ignoring=(OSError,))
    key_in, key_out = _fresh_keys()
    fd_in, fd_out = owner(key_in, X.tobytes()), owner(key_out, bytes(X.nbytes))
    control = _client(srv)
    control.register_system_shared_memory("in", key_in, X.nbytes)
    control.register_system_shared_memory("out", key_out, X.nbytes)
    control.close()
    _, new_out = _replace_objects(owner, key_in, key_out)
    killed = _worker_pids(srv)
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    until(
        lambda: len(_worker_pids(srv) - killed) == 2,
        60,
        "two new workers serving",
        ignoring=(OSError,),
    )
    served: set[int] = set()
    for round in range(6):  # every worker now is one started after the kill
        os.pwrite(fd_in, (X + round).tobytes(), 0)
        client = _client(srv)
        inputs, outputs = _pid_request()
        result = client.infer("addpid", inputs, outputs=outputs)
        client.close()
        served.add(int(result.as_numpy("pid")[0, 0]))
        got = np.frombuffer(os.pread(fd_out, X.nbytes, 0), dtype=np.float32)
        np.testing.assert_array_equal(got, (X + round + 1).reshape(-1))
    assert served and not served & killed
    assert os.pread(new_out, X.nbytes, 0) == SENTINEL


@pytest.mark.workers(2)
def test_the_supervisor_holds_as_many_regions_as_one_process(
    server: Callable[..., ServerProcess],
    plugins: Path,
    models_dir: Path,
    owner: Callable[[str, bytes], int],
) -> None:
    """Issue 29 finding 4, the holder's side: the supervisor keeps a descriptor per region,
    so it raises its open-files limit as a worker does; started under a soft limit of 256,
    it holds 300 regions, and a worker serves the last one."""
    key, _ = _fresh_keys()
    fd = owner(key, X.tobytes())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"the hard open-files limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # what the server inherits
    try:
        srv = _start(server, plugins, models_dir)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    body = {"key": key, "offset": 0, "byte_size": X.nbytes}
    for n in range(300):
        status, _, text = srv.request("POST", f"/v2/systemsharedmemory/region/r{n}/register", body)
        assert status == 200, (n, text)
    os.pwrite(fd, (X * 3).tobytes(), 0)
    client = _client(srv)
    assert len(client.get_system_shared_memory_status()) == 300
    inp = httpclient.InferInput("x", [2, 4], "FP32")
    inp.set_shared_memory("r299", X.nbytes)
    np.testing.assert_array_equal(client.infer("add", [inp]).as_numpy("y"), X * 3 + 1)
