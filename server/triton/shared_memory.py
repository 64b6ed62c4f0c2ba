"""Triton's system shared memory extension: registered regions, and tensors read from and
written into them.

A region is ``byte_size`` bytes at ``offset`` in a POSIX shared memory object
(``/dev/shm/<key>``) that a client on this host created. The server keeps the
object's descriptor open and copies with ``pread``/``pwrite``, never through a
mapping: a client that shrinks its object afterwards gets a 400, never a
``SIGBUS`` in the server. A region in use by a request (its :class:`Region` held)
stays open until the request is done, unregistered or not.

A region is the object opened at registration, whatever bears its key later (as
in Triton, which maps it then): the process that registers it, the *holder*,
keeps that descriptor open until it is unregistered. With workers the holder is
the supervisor (a worker forwards the register and unregister calls to it), and a
worker opens the holder's descriptor itself through ``/proc/<holder>/fd/<fd>``,
on first use, so a region registered before the worker started (a replacement)
is the same object too. What it opens must be the object registered (its device
and inode); where ``/proc`` cannot be used it opens the key and checks the same,
and a region whose object was unlinked or replaced is then a 400, never another
object's memory.

Protocol-neutral: HTTP (``server/http_api/shm_http.py``) and gRPC call
:class:`Regions` and :class:`Attachment` with the
:class:`plugserve.server.triton.requests.InferRequest` they decoded.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
import urllib.parse
import uuid
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
from aiohttp import web

from plugserve.registry.errors import Forbidden, InvalidInput, NotFound, PayloadTooLarge
from plugserve.registry.tensors.values import bytes_elements
from plugserve.server.http.addresses import is_loopback
from plugserve.server.triton.requests import (
    InferRequest,
    SharedInput,
    SharedMemoryRef,
    tensor_byte_size,
    tensor_from_bytes,
)
from plugserve.server.triton.shm_table import Entries, LocalTable

log = structlog.get_logger("plugserve.shared_memory")

SHM_DIR = "/dev/shm"
MAX_REGIONS = 1024
"""Regions registered at once (each holds a descriptor in the supervisor and every worker)."""
PROC_DIR = "/proc"
STATUS_FIELDS = ("name", "key", "offset", "byte_size")
"""What Triton's status call shows of a region; its table entry holds more (see
:meth:`Regions.register`)."""
OPEN_FLAGS = os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
Forward = Callable[[str, dict[str, Any]], Awaitable[None]]
"""``forward(call, body)``: a worker's register (``call`` ``"register"``, ``body`` the
region) or unregister (``"unregister"``, ``{"name": ...}``), made by the holder."""
KEY_PATTERN = re.compile(r"/[A-Za-z0-9_.:@+=,-]{1,255}")
"""A POSIX shared memory name: one slash, then a file name of /dev/shm (no path, no ``..``)."""
NAME_PATTERN = re.compile(r"[^\x00-\x1f\x7f]{1,256}")


def check_key(key: object) -> str:
    """``key`` if it names an object directly under /dev/shm; else 400."""
    if not isinstance(key, str) or KEY_PATTERN.fullmatch(key) is None or key[1:] in (".", ".."):
        raise InvalidInput(
            f"shared memory key {key!r} must be a POSIX shared memory name: '/' and then "
            "up to 255 of A-Z a-z 0-9 _ . : @ + = , - (no other '/', not '.' or '..')"
        )
    return key


def check_name(name: object) -> str:
    if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
        raise InvalidInput("a shared memory region's name is 1 to 256 printable characters")
    return name


def check_size(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise InvalidInput(f"{what} must be a non-negative integer, not {value!r}")
    return value


def _open_key(key: str) -> int:
    """A descriptor of the object ``/dev/shm<key>`` (a symlink is not followed); else 400."""
    try:
        folder = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return os.open(key[1:], OPEN_FLAGS | os.O_NOFOLLOW, dir_fd=folder)
        finally:
            os.close(folder)
    except OSError as exc:
        raise InvalidInput(
            f"Unable to open shared memory region: '{key}' ({exc.strerror})"
        ) from None


def _check_object(fd: int, what: str, key: str, offset: int, byte_size: int) -> None:
    """400 (``what`` first) unless ``fd`` is a regular file holding ``offset + byte_size``
    bytes."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise InvalidInput(f"'{key}' is not a shared memory object")
    if offset + byte_size > info.st_size:
        raise InvalidInput(
            f"{what}: offset {offset} + byte_size {byte_size} runs past the end of '{key}' "
            f"({info.st_size} bytes)"
        )


def _open_registered(entry: Mapping[str, Any]) -> int:
    """A descriptor of the object a table entry names: the holder's own descriptor, opened
    through ``/proc``; where that cannot be, the key's object, if it is the one registered."""
    name, key = entry["name"], entry["key"]
    held = f"{PROC_DIR}/{int(entry['holder'])}/fd/{int(entry['fd'])}"
    try:
        info = os.stat(held)  # the descriptor's object, before anything opens it
        if [info.st_dev, info.st_ino] != list(entry["identity"]):
            raise OSError(errno.ESTALE, "the descriptor holds another object")
        fd = os.open(held, OPEN_FLAGS)
    except OSError as exc:
        log.debug("shm_holder_unreachable", region=name, holder=entry["holder"], error=exc.strerror)
        try:
            fd = _open_key(key)
        except InvalidInput:
            raise _replaced(name, key) from None
    info = os.fstat(fd)
    if [info.st_dev, info.st_ino] != list(entry["identity"]):
        os.close(fd)
        raise _replaced(name, key)
    return fd


def _replaced(name: str, key: str) -> InvalidInput:
    return InvalidInput(
        f"shared memory region '{name}': the object registered as '{key}' has been unlinked "
        "or replaced since, and this worker cannot reach it; register the region again"
    )


class Region:
    """An open shared memory object: ``byte_size`` bytes from ``offset`` are the region."""

    def __init__(
        self, name: str, key: str, offset: int, byte_size: int, fd: int, registration: str
    ) -> None:
        self.name = name
        self.key = key
        self.offset = offset
        self.byte_size = byte_size
        self.fd = fd
        self.registration = registration
        """New at each register: a region registered again under its name is another one."""
        info = os.fstat(fd)
        self.identity = (info.st_dev, info.st_ino)
        """The object itself: the same in every process that opened it, whatever its name."""
        weakref.finalize(self, os.close, fd)  # once no request holds it either

    @classmethod
    def open(cls, name: str, key: str, offset: int, byte_size: int, registration: str) -> Region:
        """Open ``key`` (no symlink followed, regular files only) and check the region fits."""
        fd = _open_key(key)
        try:
            _check_object(
                fd, f"failed to register shared memory region '{name}'", key, offset, byte_size
            )
        except BaseException:
            os.close(fd)
            raise
        return cls(name, key, offset, byte_size, fd, registration)

    @classmethod
    def reopen(cls, entry: Mapping[str, Any]) -> Region:
        """The object a table entry names, opened in this process: the holder's descriptor
        (``/proc/<holder>/fd/<fd>``), else its key; 400 unless it is the object registered."""
        name, key = entry["name"], entry["key"]
        fd = _open_registered(entry)
        try:
            _check_object(
                fd, f"shared memory region '{name}'", key, entry["offset"], entry["byte_size"]
            )
        except BaseException:
            os.close(fd)
            raise
        return cls(name, key, entry["offset"], entry["byte_size"], fd, entry["registration"])

    def entry(self) -> dict[str, Any]:
        """The region as the table holds it: its status, registration, and how another
        process of this server opens the same object (the holder's pid, descriptor, and
        the object's identity)."""
        return {
            **self.status(),
            "registration": self.registration,
            "holder": os.getpid(),
            "fd": self.fd,
            "identity": list(self.identity),
        }

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }

    def check(self, offset: int, byte_size: int, what: str) -> None:
        """400 unless ``byte_size`` bytes at ``offset`` lie within the region."""
        if offset + byte_size > self.byte_size:
            raise InvalidInput(
                f"{what}: shared_memory_offset {offset} + shared_memory_byte_size {byte_size} "
                f"runs past the end of region '{self.name}' ({self.byte_size} bytes)"
            )

    def read(self, offset: int, byte_size: int) -> np.ndarray:
        """A copy of ``byte_size`` bytes at ``offset`` in the region (checked by the caller)."""
        data = np.empty(byte_size, dtype=np.uint8)
        view, done, start = data.data, 0, self.offset + offset
        while done < byte_size:
            count = os.preadv(self.fd, [view[done:]], start + done)
            if count == 0:
                raise self._shrunk()
            done += count
        return data

    def _shrunk(self) -> InvalidInput:
        return InvalidInput(
            f"shared memory region '{self.name}': '{self.key}' is now shorter than "
            "the region registered"
        )

    def write(self, offset: int, data: memoryview) -> None:
        """Write ``data`` at ``offset`` in the region (checked by the caller); a 400, and
        nothing written, if the object has shrunk below it since it was registered (a
        write past its end would grow it again)."""
        done, start = 0, self.offset + offset
        if os.fstat(self.fd).st_size < start + len(data):
            raise self._shrunk()
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], start + done)


def grpc_peer(peer: str) -> tuple[str | None, bool]:
    """gRPC's ``context.peer()`` as :meth:`Regions.admit` takes it: (address, Unix socket).

    ``ipv4:127.0.0.1:5000`` -> ``("127.0.0.1", False)``; ``ipv6:[::1]:5000`` (or
    ``ipv6:%5B::1%5D:5000``) -> ``("::1", False)``; ``unix:/path`` -> ``(None, True)``.
    """
    scheme, _, rest = urllib.parse.unquote(peer).partition(":")
    if scheme == "unix":
        return None, True
    if scheme == "ipv6" and rest.startswith("["):
        return rest[1:].partition("]")[0], False
    if scheme == "ipv4":
        return rest.rpartition(":")[0], False
    return None, False


class Regions:
    """The system shared memory regions this server has registered, as every worker sees them.

    Safe to call from several threads; a :class:`Region` a request holds is read and
    written without the lock.
    """

    def __init__(
        self,
        table: LocalTable | None = None,
        access: str = "loopback",
        max_bytes: int = 64 * 1024 * 1024,
        forward: Forward | None = None,
    ) -> None:
        self.table = table if table is not None else LocalTable()
        self.access = access
        """Who may use them (setting ``shared_memory``): ``loopback`` (clients on this
        host), ``any`` (every caller the data plane admits) or ``off``."""
        self.max_bytes = max_bytes
        """The most a BYTES input may take (its data has no other bound): ``max_body_bytes``."""
        self.forward = forward
        """A worker's way to its supervisor, which registers and holds every region; ``None``
        where this process holds them (one process, or the supervisor itself)."""
        self._seen = -1
        self._entries: Entries = {}
        self._open: dict[str, Region] = {}
        self._lock = threading.RLock()

    def admit(self, remote: str | None, local: bool = False) -> None:
        """403 unless the caller may use shared memory: ``local`` is a Unix socket peer."""
        if self.access == "off":
            raise Forbidden("shared memory is turned off on this server (shared_memory = 'off')")
        if self.access == "loopback" and not local and not is_loopback(remote):
            raise Forbidden(
                "shared memory is for clients on the server's host: this one is not on "
                "loopback (shared_memory = 'loopback')"
            )

    # -- the extension's calls ----------------------------------------------------------

    async def register_call(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Triton's register call: :meth:`register` here, or by the holder (a worker's
        supervisor), which answers once the region is in the table every worker reads."""
        if self.forward is None:
            self.register(name, key, offset, byte_size)
            return
        self._check_new(name, key, offset, byte_size)
        body = {"name": name, "key": key, "offset": offset, "byte_size": byte_size}
        await self.forward("register", body)

    async def unregister_call(self, name: str | None = None) -> None:
        """Triton's unregister call: :meth:`unregister` here, or by the holder."""
        if self.forward is None:
            self.unregister(name)
            return
        await self.forward("unregister", {"name": name})
        with self._lock:
            self._sync()

    def _check_new(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """400 unless the arguments are valid and no region has the name."""
        check_name(name)
        check_key(key)
        check_size(offset, "offset")
        check_size(byte_size, "byte_size")
        with self._lock:
            self._sync()
            if name in self._entries:
                raise InvalidInput(f"shared memory region '{name}' already in manager")

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Open the object ``key`` names and hold it as region ``name`` until unregistered."""
        with self._lock:
            self._check_new(name, key, offset, byte_size)
            region = Region.open(name, key, offset, byte_size, uuid.uuid4().hex)

            def add(entries: Entries) -> None:
                if name in entries:
                    raise InvalidInput(f"shared memory region '{name}' already in manager")
                if len(entries) >= MAX_REGIONS:
                    raise InvalidInput(
                        f"{MAX_REGIONS} shared memory regions are registered already"
                    )
                entries[name] = region.entry()

            self.table.change(add)
            self._open[name] = region
        log.info("shm_registered", region=name, key=key, offset=offset, byte_size=byte_size)

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        """Triton's status: every region, or the one named (404 if it is not registered)."""
        with self._lock:
            self._sync()
            if name is None:
                names = sorted(self._entries)
            elif name in self._entries:
                names = [name]
            else:
                raise NotFound(f"Unable to find system shared memory region: '{name}'")
            return [{k: self._entries[n][k] for k in STATUS_FIELDS} for n in names]

    def unregister(self, name: str | None = None) -> None:
        """Forget one region, or all; an unknown name is no error (as in Triton).

        Requests holding the region finish with it; its descriptor closes after them.
        """

        def remove(entries: Entries) -> None:
            if name is None:
                entries.clear()
            else:
                entries.pop(name, None)

        with self._lock:
            self.table.change(remove)
            self._sync()
        log.info("shm_unregistered", region=name if name is not None else "*")

    def region(self, name: str) -> Region:
        """The region named, opened in this process on first use (404 if not registered)."""
        with self._lock:
            self._sync()
            entry = self._entries.get(name)
            if entry is None:
                raise NotFound(f"Unable to find system shared memory region: '{name}'")
            region = self._open.get(name)
            if region is None:  # held by another process (the supervisor): open it here too
                region = Region.reopen(entry)
                self._open[name] = region
                log.info("shm_opened", region=name, key=region.key, holder=entry["holder"])
            return region

    def read(self, name: str, offset: int, byte_size: int) -> np.ndarray:
        region = self.region(name)
        region.check(offset, byte_size, f"read of region '{name}'")
        return region.read(offset, byte_size)

    def write(self, name: str, offset: int, data: bytes | memoryview) -> None:
        region = self.region(name)
        view = memoryview(data).cast("B")
        region.check(offset, len(view), f"write into region '{name}'")
        region.write(offset, view)

    def attach(self, request: InferRequest) -> Attachment:
        """The regions of the request's shared memory tensors, held until it is done; sizes
        and bounds checked before anything is read or the chain runs."""
        inputs = []
        for name, item in request.shared_inputs.items():
            where = f"input {name!r}"
            ref = item.ref
            expected = tensor_byte_size(item.datatype, item.shape)
            if expected is not None and expected != ref.byte_size:
                raise InvalidInput(
                    f"{where}: shape {list(item.shape)} of {item.datatype} needs {expected} "
                    f"bytes; shared_memory_byte_size is {ref.byte_size}"
                )
            if expected is None and ref.byte_size > self.max_bytes:
                raise PayloadTooLarge(
                    f"{where}: {ref.byte_size} bytes of BYTES data; at most {self.max_bytes} "
                    "(max_body_bytes)"
                )
            region = self.region(ref.region)
            region.check(ref.offset, ref.byte_size, where)
            inputs.append((name, item, region))
        outputs = []
        for output in request.outputs or ():
            if (place := output.shared) is not None:
                region = self.region(place.region)
                region.check(place.offset, place.byte_size, f"output {output.name!r}")
                outputs.append((output.name, place, region))
        return Attachment(inputs, outputs)

    def _sync(self) -> None:
        """Catch up with the table: regions another worker registered or unregistered."""
        if self.table.generation() == self._seen:
            return
        self._seen, self._entries = self.table.read()
        for name, region in list(self._open.items()):
            entry = self._entries.get(name)
            if entry is None or entry["registration"] != region.registration:
                del self._open[name]  # closed once no request holds it


@dataclass
class Attachment:
    """One request's shared memory tensors and the regions they lie in."""

    inputs: list[tuple[str, SharedInput, Region]]
    outputs: list[tuple[str, SharedMemoryRef, Region]]

    @property
    def input_bytes(self) -> int:
        return sum(item.ref.byte_size for _, item, _ in self.inputs)

    def output_bytes(self, outputs: Mapping[str, np.ndarray]) -> int:
        """The bytes of the outputs to write into shared memory."""
        return sum(outputs[name].nbytes for name, _, _ in self.outputs if name in outputs)

    def read_inputs(self, request: InferRequest) -> None:
        """Read the shared memory inputs into ``request.inputs``, in the request's order."""
        if not self.inputs:
            return
        read = {name: (item.index, _read(name, item, region)) for name, item, region in self.inputs}
        slots: list[tuple[str, np.ndarray] | None] = [None] * (len(request.inputs) + len(read))
        for name, (index, array) in read.items():
            slots[index] = (name, array)
        rest = iter(request.inputs.items())
        request.inputs = {
            name: array for name, array in (s if s is not None else next(rest) for s in slots)
        }
        request.shared_inputs = {}

    def write_outputs(self, outputs: Mapping[str, np.ndarray]) -> None:
        """Write each output asked for in shared memory into its region; all sizes are
        checked first, so a region too small leaves every region untouched."""
        placed = []
        for name, ref, region in self.outputs:
            array = outputs.get(name)
            if array is None:
                continue  # the response names the unknown output
            data = _binary(array)
            if len(data) > ref.byte_size:
                raise InvalidInput(
                    f"shared memory size specified with the request for output "
                    f"'{name}' ({ref.byte_size} bytes) should be at least "
                    f"{len(data)} bytes to hold the results"
                )
            placed.append((region, ref.offset, data))
        for region, offset, data in placed:
            region.write(offset, data)


def _read(name: str, item: SharedInput, region: Region) -> np.ndarray:
    data = region.read(item.ref.offset, item.ref.byte_size)
    array = tensor_from_bytes(name, item.datatype, item.shape, data.data)
    array.flags.writeable = False  # as binary inputs arrive
    return array


def _binary(array: np.ndarray) -> memoryview:
    """An output's v2 binary form, without a copy where it is contiguous little-endian."""
    if array.dtype == object:
        return memoryview(bytes_elements(array))
    flat = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).reshape(-1)
    return flat.view(np.uint8).data


def cuda_unsupported(name: str) -> str:
    """Why a CUDA shared memory region cannot be registered, in Triton's words and ours."""
    return (
        f"failed to register CUDA shared memory region: '{name}', GPUs not supported: CUDA "
        "shared memory needs a GPU and cuda-python, and plugserve has no CUDA support (use "
        "system shared memory)"
    )


REGIONS = web.AppKey("shared_memory_regions", Regions)
"""The shared memory regions registered with this server."""
