"""The messages between a worker and a runner process, over a Unix stream socket.

A frame is ``<u32 JSON length><u32 raw length>`` then a JSON object (orjson) and
raw bytes. The JSON says what the message is (``k``); tensors are described in
it (:func:`put_tensors`) and their bytes lie in the sender's shared memory
region, or in the frame's raw bytes when they do not fit there (or are
``BYTES`` elements, Python objects that shared memory cannot carry).

Kinds, worker to runner process: ``infer`` (``i`` id, ``x`` inputs, ``d``
deadline in ``time.monotonic()`` seconds (one clock for every process of the
machine), ``p`` priority, ``t`` tenant, ``r`` request id), ``cancel`` (``i``),
``free`` (``o``: offsets of output blocks the worker no longer reads), ``stats``
(``i``). Runner process to worker: ``ok`` (``i``, ``y`` outputs, ``q`` queue
seconds, ``c`` compute seconds), ``error`` (``i``, ``s`` status, ``e`` class,
``m`` message, ``f`` fields), ``cancelled`` (``i``), ``stats`` (``i`` and the
figures).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import orjson

from registry import errors
from registry.errors import PlugserveError
from registry.isolation.shm import Allocator, Region
from registry.tensors import bytes_elements

HEADER = struct.Struct("<II")
_U32 = struct.Struct("<I")
MAX_JSON = 64 * 1024 * 1024
"""A frame whose JSON claims more is not ours: the connection is dropped."""

Descriptor = list[Any]
"""``[name, dtype, shape, where, offset, nbytes]``; where: ``s`` shared memory, ``r`` raw
bytes of the frame, ``b`` raw bytes holding ``BYTES`` elements (u32 length, bytes)."""


MAX_RAW = 2**32 - 1
"""The most raw bytes a frame carries (its header says how many in 32 bits)."""


class FrameTooLarge(ValueError):
    """Tensors that neither fit the shared memory nor a frame."""


def frame(message: Mapping[str, Any], raw: list[bytes] | None = None) -> bytes:
    size = sum(len(r) for r in raw) if raw else 0
    if size > MAX_RAW:
        raise FrameTooLarge(
            f"{size} bytes of tensors outside the shared memory; at most {MAX_RAW} cross at once"
        )
    body = orjson.dumps(message)
    rest = b"".join(raw) if raw else b""
    return HEADER.pack(len(body), len(rest)) + body + rest


class FrameReader:
    """Splits a byte stream into ``(message, raw)`` frames."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[tuple[dict[str, Any], memoryview]]:
        buffer = self._buffer
        buffer += data
        start = 0
        size = len(buffer)
        try:
            while size - start >= HEADER.size:
                json_length, raw_length = HEADER.unpack_from(buffer, start)
                if json_length > MAX_JSON:
                    raise ValueError(f"a frame of {json_length} bytes of JSON")
                end = start + HEADER.size + json_length + raw_length
                if end > size:
                    break
                body_end = start + HEADER.size + json_length
                message = orjson.loads(memoryview(buffer)[start + HEADER.size : body_end])
                raw = memoryview(bytes(buffer[body_end:end])) if raw_length else memoryview(b"")
                start = end
                yield message, raw
        finally:
            del buffer[:start]


# -- tensors ---------------------------------------------------------------------------


SMALL_BYTES = 64 * 1024
"""Answers up to this size travel in the frame: cheaper than a block and its bookkeeping."""


def put_tensors(
    arrays: Mapping[str, np.ndarray],
    region: Region | None,
    allocator: Allocator | None,
    inline_below: int = 0,
) -> tuple[list[Descriptor], list[bytes], list[int]]:
    """Describe ``arrays``, writing their bytes into ``region`` where a block is free (one
    copy), else into the frame's raw bytes (all of them when together they are smaller
    than ``inline_below``). Returns descriptors, raw chunks and the offsets of the blocks
    taken (freed when the other side is done with them)."""
    descriptors: list[Descriptor] = []
    chunks: list[bytes] = []
    taken: list[int] = []
    raw_at = 0
    if inline_below and sum(np.asarray(a).nbytes for a in arrays.values()) < inline_below:
        region = None
    for name, value in arrays.items():
        array = np.asarray(value)
        shape = list(array.shape)
        if array.dtype.kind == "O":
            data = bytes_elements(array)
            descriptors.append([name, "|O", shape, "b", raw_at, len(data)])
            chunks.append(data)
            raw_at += len(data)
            continue
        dtype = array.dtype.str
        nbytes = array.nbytes
        offset = allocator.alloc(nbytes) if region is not None and allocator and nbytes else None
        if offset is not None:
            assert region is not None
            np.ndarray(array.shape, array.dtype, buffer=region.map, offset=offset)[...] = array
            taken.append(offset)
            descriptors.append([name, dtype, shape, "s", offset, nbytes])
        else:
            data = np.ascontiguousarray(array).tobytes()
            descriptors.append([name, dtype, shape, "r", raw_at, nbytes])
            chunks.append(data)
            raw_at += nbytes
    return descriptors, chunks, taken


def get_tensors(
    descriptors: list[Descriptor],
    region: Region | None,
    raw: memoryview,
    keep: Callable[[np.ndarray, int], np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The arrays ``descriptors`` describe: read-only views of ``region`` (no copy) or of the
    frame's raw bytes. ``keep(view, offset)`` may wrap each shared memory view (a worker
    frees the block once the arrays made from it are gone)."""
    out: dict[str, np.ndarray] = {}
    for name, dtype, shape, where, offset, nbytes in descriptors:
        if where == "b":
            count = int(np.prod(shape)) if shape else 1
            out[name] = _read_bytes_elements(raw[offset : offset + nbytes], count).reshape(shape)
            continue
        if where == "s":
            if region is None or offset + nbytes > region.size:
                raise ValueError(f"tensor {name!r} lies outside the shared memory")
            view = np.ndarray(shape, np.dtype(dtype), buffer=region.map, offset=offset)
            view.flags.writeable = False
            out[name] = keep(view, offset) if keep is not None else view
        else:
            array = np.frombuffer(
                raw, np.dtype(dtype), offset=offset, count=nbytes // np.dtype(dtype).itemsize
            )
            out[name] = array.reshape(shape)
    return out


def _read_bytes_elements(data: memoryview, count: int) -> np.ndarray:
    out = np.empty(count, dtype=object)
    at = 0
    for index in range(count):
        (length,) = _U32.unpack_from(data, at)
        at += 4
        out[index] = bytes(data[at : at + length])
        at += length
    return out


# -- errors ----------------------------------------------------------------------------


def error_message(request_id: int, exc: PlugserveError) -> dict[str, Any]:
    return {
        "k": "error",
        "i": request_id,
        "s": exc.status,
        "e": type(exc).__name__,
        "m": exc.message,
        "f": _jsonable(exc.fields),
        "h": exc.headers(),
    }


def error_from(message: Mapping[str, Any]) -> PlugserveError:
    """The error a runner process answered, as the class it raised where plugserve has it."""
    cls = getattr(errors, str(message.get("e")), None)
    exc: PlugserveError
    if (
        isinstance(cls, type)
        and issubclass(cls, PlugserveError)
        and cls.__init__ is PlugserveError.__init__
    ):
        exc = cls(str(message["m"]), **message.get("f", {}))
    else:
        exc = _Relayed(str(message["m"]), **message.get("f", {}))
    exc.status = int(message.get("s", 500))
    exc.relayed_headers = dict(message.get("h", {}))  # type: ignore[attr-defined]
    return exc


class _Relayed(PlugserveError):
    """An error of a class built otherwise (``PluginError``): its message and status as sent."""

    def headers(self) -> dict[str, str]:
        return dict(getattr(self, "relayed_headers", {}))


def _jsonable(fields: Mapping[str, Any]) -> dict[str, Any]:
    try:
        orjson.dumps(fields)
        return dict(fields)
    except TypeError:
        return {k: str(v) for k, v in fields.items()}
