"""Triton's system shared memory over gRPC, through the unchanged tritonclient.grpc."""

from __future__ import annotations

import base64
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.helpers import PID_RUNNER, ServerProcess, write_add_runner, write_plugin

pytestmark = pytest.mark.slow

X = np.arange(8, dtype=np.float32).reshape(2, 4)
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
"""A channel with a connection of its own (gRPC shares one between a process's channels
to the same address): a new one may reach another worker."""


@pytest.fixture
def regions() -> Iterator[Callable[[int], shm.SharedMemoryRegion]]:
    made: list[shm.SharedMemoryRegion] = []

    def make(size: int) -> shm.SharedMemoryRegion:
        name = uuid.uuid4().hex[:12]
        made.append(shm.create_shared_memory_region(name, f"/plugserve-grpc-{name}", size))
        return made[-1]

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


@pytest.mark.workers(1, 2)
def test_inputs_and_outputs_in_shared_memory_over_grpc(
    plugins_dir: Path,
    models_dir: Path,
    server: Callable[..., ServerProcess],
    regions: Callable[[int], shm.SharedMemoryRegion],
) -> None:
    write_add_runner(plugins_dir, "add", "1.0.0", amount=1)
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    control = grpcclient.InferenceServerClient(srv.grpc_url)
    control.unregister_system_shared_memory()
    control.unregister_cuda_shared_memory()  # as Triton's examples start: nothing to do here
    ins, outs = regions(X.nbytes), regions(X.nbytes)
    shm.set_shared_memory_region(ins, [X])
    control.register_system_shared_memory(ins._triton_shm_name, ins._shm_key, X.nbytes)
    control.register_system_shared_memory(outs._triton_shm_name, outs._shm_key, X.nbytes)
    status = control.get_system_shared_memory_status(as_json=True)["regions"]
    assert {r["name"]: int(r["byte_size"]) for r in status.values()} == {
        ins._triton_shm_name: X.nbytes,
        outs._triton_shm_name: X.nbytes,
    }
    for k in range(6):  # new channels: with 2 workers, connections reach both
        shm.set_shared_memory_region(ins, [X + k])
        client = grpcclient.InferenceServerClient(srv.grpc_url, channel_args=OWN_CONNECTION)
        inp = grpcclient.InferInput("x", [2, 4], "FP32")
        inp.set_shared_memory(ins._triton_shm_name, X.nbytes)
        out = grpcclient.InferRequestedOutput("y")
        out.set_shared_memory(outs._triton_shm_name, X.nbytes)
        result = client.infer("add", [inp], outputs=[out])
        meta = result.get_output("y")
        assert (meta.datatype, list(meta.shape)) == ("FP32", [2, 4])
        got = shm.get_contents_as_numpy(outs, np.float32, [2, 4])
        np.testing.assert_array_equal(got, X + k + 1)
        client.close()
    # A region too small for the output: 400 as INVALID_ARGUMENT, nothing written.
    small = regions(8)
    control.register_system_shared_memory(small._triton_shm_name, small._shm_key, 8)
    inp = grpcclient.InferInput("x", [2, 4], "FP32")
    inp.set_shared_memory(ins._triton_shm_name, X.nbytes)
    out = grpcclient.InferRequestedOutput("y")
    out.set_shared_memory(small._triton_shm_name, 8)
    with pytest.raises(InferenceServerException) as info:
        control.infer("add", [inp], outputs=[out])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "should be at least 32 bytes" in info.value.message()
    # An input whose size does not match its shape; an unknown region.
    inp.set_shared_memory(ins._triton_shm_name, 16)
    with pytest.raises(InferenceServerException) as info:
        control.infer("add", [inp])
    assert "needs 32 bytes" in info.value.message()
    inp.set_shared_memory("nope", X.nbytes)
    with pytest.raises(InferenceServerException) as info:
        control.infer("add", [inp])
    assert info.value.status() == "StatusCode.NOT_FOUND"
    control.unregister_system_shared_memory(ins._triton_shm_name)
    left = control.get_system_shared_memory_status(as_json=True)["regions"]
    assert ins._triton_shm_name not in left and outs._triton_shm_name in left
    with pytest.raises(InferenceServerException) as info:
        control.register_cuda_shared_memory("gpu0", base64.b64encode(b"handle"), 0, 64)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "GPUs not supported" in info.value.message()


def test_a_shared_memory_input_beside_a_raw_one(
    plugins_dir: Path,
    models_dir: Path,
    server: Callable[..., ServerProcess],
    regions: Callable[[int], shm.SharedMemoryRegion],
) -> None:
    """raw_input_contents holds the inputs not in shared memory only, in order."""
    from onnx import TensorProto

    from tests.helpers import identity_model

    folder = write_plugin(
        plugins_dir, "runner", "pair", "1.0.0",
        '[runner]\nbackend = "onnxruntime"\nmodel = "model.onnx"\n', module=None,
    )  # fmt: skip
    identity_model(folder / "model.onnx", {"a": TensorProto.FLOAT, "b": TensorProto.INT32})
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    a = np.array([[1.5, -2.0]], np.float32)
    b = np.array([[7, 8]], np.int32)
    region = regions(a.nbytes)
    shm.set_shared_memory_region(region, [a])
    client.register_system_shared_memory(region._triton_shm_name, region._shm_key, a.nbytes)
    in_a = grpcclient.InferInput("in_a", [1, 2], "FP32")
    in_a.set_shared_memory(region._triton_shm_name, a.nbytes)
    in_b = grpcclient.InferInput("in_b", [1, 2], "INT32")
    in_b.set_data_from_numpy(b)
    result = client.infer("pair", [in_a, in_b])
    np.testing.assert_array_equal(result.as_numpy("out_a"), a)
    np.testing.assert_array_equal(result.as_numpy("out_b"), b)


@pytest.mark.workers(2)
def test_a_region_registered_over_grpc_is_the_object_registered_on_every_worker(
    plugins_dir: Path, models_dir: Path, server: Callable[..., ServerProcess]
) -> None:
    """Issue 29 finding 4, over gRPC: regions registered through gRPC, their objects then
    unlinked by the owner and new ones created under their keys; on new channels, whichever
    worker serves reads and writes the objects registered, never the newcomers."""
    write_plugin(plugins_dir, "runner", "addpid", "1.0.0", "", {"plugin.py": PID_RUNNER})
    srv = server("--plugins-dir", str(plugins_dir), "--models-dir", str(models_dir))
    tag = uuid.uuid4().hex[:12]
    paths = [Path(f"/dev/shm/plugserve-grpc-{part}-{tag}") for part in ("in", "out")]
    fds = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600) for p in paths]
    try:
        os.pwrite(fds[0], X.tobytes(), 0)
        os.pwrite(fds[1], bytes(X.nbytes), 0)
        control = grpcclient.InferenceServerClient(srv.grpc_url)
        for name, path in zip(("in", "out"), paths, strict=True):
            control.register_system_shared_memory(name, "/" + path.name, X.nbytes)
        for path in paths:  # the owner unlinks; someone else takes the keys
            path.unlink()
            path.write_bytes(b"\x7f" * X.nbytes)
        served: set[int] = set()
        for k in range(80):  # new channels, until both workers have served 5 at least
            os.pwrite(fds[0], (X + k).tobytes(), 0)
            client = grpcclient.InferenceServerClient(srv.grpc_url, channel_args=OWN_CONNECTION)
            inp = grpcclient.InferInput("x", [2, 4], "FP32")
            inp.set_shared_memory("in", X.nbytes)
            out = grpcclient.InferRequestedOutput("y")
            out.set_shared_memory("out", X.nbytes)
            result = client.infer(
                "addpid", [inp], outputs=[out, grpcclient.InferRequestedOutput("pid")]
            )
            client.close()
            served.add(int(result.as_numpy("pid")[0, 0]))
            got = np.frombuffer(os.pread(fds[1], X.nbytes, 0), dtype=np.float32)
            np.testing.assert_array_equal(got, (X + k + 1).reshape(-1))
            if k >= 10 and len(served) == 2:
                break
        assert len(served) == 2
        assert [p.read_bytes() for p in paths] == [b"\x7f" * X.nbytes] * 2
    finally:
        for fd in fds:
            os.close(fd)
        for path in paths:
            path.unlink(missing_ok=True)
