"""Triton's system shared memory extension: registered regions, and tensors read from and
written into them.

A region is ``byte_size`` bytes at ``offset`` in a POSIX shared memory object
(``/dev/shm/<key>``) that a client on this host created. The server keeps the
object's descriptor open and copies with ``pread``/``pwrite``, never through a
mapping: a client that shrinks its object afterwards gets a 400, never a
``SIGBUS`` in the server. A region in use by a request (its :class:`Region` held)
stays open until the request is done, unregistered or not.

Protocol-neutral: HTTP (``server/triton/shm_http.py``) and gRPC call
:class:`Regions` and :class:`Attachment` with the :class:`~server.codec.InferRequest`
they decoded.
"""

from __future__ import annotations

import os
import re
import stat
import threading
import urllib.parse
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from registry.errors import Forbidden, InvalidInput, NotFound, PayloadTooLarge
from registry.tensors import bytes_elements
from server.auth import is_loopback
from server.codec import (
    InferRequest,
    SharedInput,
    SharedMemoryRef,
    tensor_byte_size,
    tensor_from_bytes,
)
from server.triton.shm_table import Entries, LocalTable

log = structlog.get_logger("plugserve.shared_memory")

SHM_DIR = "/dev/shm"
MAX_REGIONS = 1024
"""Regions registered at once (each holds a descriptor in every worker)."""
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
        weakref.finalize(self, os.close, fd)  # once no request holds it either

    @classmethod
    def open(cls, name: str, key: str, offset: int, byte_size: int, registration: str) -> Region:
        """Open ``key`` (no symlink followed, regular files only) and check the region fits."""
        try:
            folder = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
                fd = os.open(key[1:], flags, dir_fd=folder)
            finally:
                os.close(folder)
        except OSError as exc:
            raise InvalidInput(
                f"Unable to open shared memory region: '{key}' ({exc.strerror})"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidInput(f"'{key}' is not a shared memory object")
            if offset + byte_size > info.st_size:
                raise InvalidInput(
                    f"failed to register shared memory region '{name}': offset {offset} + "
                    f"byte_size {byte_size} runs past the end of '{key}' ({info.st_size} bytes)"
                )
        except BaseException:
            os.close(fd)
            raise
        return cls(name, key, offset, byte_size, fd, registration)

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
    ) -> None:
        self.table = table if table is not None else LocalTable()
        self.access = access
        """Who may use them (setting ``shared_memory``): ``loopback`` (clients on this
        host), ``any`` (every caller the data plane admits) or ``off``."""
        self.max_bytes = max_bytes
        """The most a BYTES input may take (its data has no other bound): ``max_body_bytes``."""
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

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        with self._lock:
            check_name(name)
            check_key(key)
            check_size(offset, "offset")
            check_size(byte_size, "byte_size")
            self._sync()
            if name in self._entries:
                raise InvalidInput(f"shared memory region '{name}' already in manager")
            region = Region.open(name, key, offset, byte_size, uuid.uuid4().hex)

            def add(entries: Entries) -> None:
                if name in entries:
                    raise InvalidInput(f"shared memory region '{name}' already in manager")
                if len(entries) >= MAX_REGIONS:
                    raise InvalidInput(
                        f"{MAX_REGIONS} shared memory regions are registered already"
                    )
                entries[name] = {**region.status(), "registration": region.registration}

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
            return [
                {k: v for k, v in self._entries[n].items() if k != "registration"} for n in names
            ]

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
            if region is None:  # registered through another worker: open it here too
                region = Region.open(
                    name, entry["key"], entry["offset"], entry["byte_size"], entry["registration"]
                )
                self._open[name] = region
                log.info("shm_opened", region=name, key=region.key)
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
