"""The messages between a worker and a runner process, over a Unix stream socket.

A frame is ``<u32 JSON length><u32 raw length><u64 request id>`` then a JSON
object (orjson) and raw bytes. The JSON says what the message is (``k``); tensors
are described in it (:func:`put_tensors`) and their bytes lie in the sender's
shared memory region, or in the frame's raw bytes when they do not fit there (or
are ``BYTES`` elements, Python objects that shared memory cannot carry, and are
never escaped as JSON text).

A frame's JSON holds at most :data:`MAX_JSON` bytes: :func:`frame` measures it
before the frame is put together and refuses a larger one (:class:`FrameTooLarge`),
so the sender fails that one message. The request id in the fixed header (the
message's ``i``) lets a reader refuse one frame it cannot take, too large or
unreadable, for that request alone, skipping its bytes (:class:`FrameReader`):
the connection and the other requests on it go on.

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

from plugserve.registry import errors
from plugserve.registry.errors import PlugserveError
from plugserve.registry.execution.isolation.shm import Allocator, Region
from plugserve.registry.tensors.values import bytes_elements

HEADER = struct.Struct("<IIQ")
_U32 = struct.Struct("<I")
MAX_JSON = 64 * 1024 * 1024
"""The most bytes of JSON a frame holds: a larger message is refused by its sender, and a
frame claiming more is skipped by its reader."""
NO_REQUEST = 2**64 - 1
"""The request id in the header of a frame that belongs to no request (``free``)."""

Descriptor = list[Any]
"""``[name, dtype, shape, where, offset, nbytes]``; where: ``s`` shared memory, ``r`` raw
bytes of the frame, ``b`` raw bytes holding ``BYTES`` elements (u32 length, bytes)."""


MAX_RAW = 2**32 - 1
"""The most raw bytes a frame carries (its header says how many in 32 bits)."""


class FrameTooLarge(ValueError):
    """Tensors that neither fit the shared memory nor a frame."""


def frame(message: Mapping[str, Any], raw: list[bytes] | None = None) -> bytes:
    """``message`` (its ``i``, when it has one, in the header too) and ``raw``, as one frame;
    :class:`FrameTooLarge` when either is over what a frame holds, before anything is
    joined (a frame is only ever sent whole or not at all)."""
    size = sum(len(r) for r in raw) if raw else 0
    if size > MAX_RAW:
        raise FrameTooLarge(
            f"{size} bytes of tensors outside the shared memory; at most {MAX_RAW} cross at once"
        )
    body = orjson.dumps(message)
    if len(body) > MAX_JSON:  # names: a control character is 6 bytes of JSON
        raise FrameTooLarge(
            f"a frame of {len(body)} bytes of JSON (tensor names and descriptors); "
            f"at most {MAX_JSON}"
        )
    rest = b"".join(raw) if raw else b""
    return HEADER.pack(len(body), len(rest), message.get("i", NO_REQUEST)) + body + rest


Refused = Callable[[int, ValueError], None]
"""Told of a frame skipped: its request id (:data:`NO_REQUEST` for none) and why
(:class:`FrameTooLarge`, or a :class:`ValueError` for JSON that cannot be read)."""


class FrameReader:
    """Splits a byte stream into ``(message, raw)`` frames.

    A frame claiming more than :data:`MAX_JSON` bytes of JSON, or whose JSON is not an
    object, is skipped (its bytes are dropped as they arrive, never kept) and reported to
    ``refused``; without one, :class:`ValueError` is raised instead.
    """

    def __init__(self, refused: Refused | None = None) -> None:
        self._buffer = bytearray()
        self._skip = 0
        """Bytes of a skipped frame still to come."""
        self._refused = refused

    def feed(self, data: bytes) -> Iterator[tuple[dict[str, Any], memoryview]]:
        buffer = self._buffer
        if self._skip:
            dropped = min(self._skip, len(data))
            self._skip -= dropped
            buffer += memoryview(data)[dropped:]
        else:
            buffer += data
        start = 0
        size = len(buffer)
        try:
            while size - start >= HEADER.size:
                json_length, raw_length, request_id = HEADER.unpack_from(buffer, start)
                end = start + HEADER.size + json_length + raw_length
                if json_length > MAX_JSON:
                    self._skip = max(end - size, 0)
                    start = min(end, size)
                    self._refuse(request_id, FrameTooLarge(
                        f"a frame of {json_length} bytes of JSON; at most {MAX_JSON}"
                    ))  # fmt: skip
                    continue
                if end > size:
                    break
                body_end = start + HEADER.size + json_length
                try:  # the view is a temporary: gone before the buffer is resized
                    message = orjson.loads(memoryview(buffer)[start + HEADER.size : body_end])
                except orjson.JSONDecodeError as exc:
                    message = ValueError(f"a frame whose JSON cannot be read: {exc}")
                raw = memoryview(bytes(buffer[body_end:end])) if raw_length else memoryview(b"")
                start = end
                if type(message) is not dict:
                    self._refuse(request_id, _not_an_object(message))
                    continue
                yield message, raw
        finally:
            del buffer[:start]

    def _refuse(self, request_id: int, problem: ValueError) -> None:
        if self._refused is None:
            raise problem
        self._refused(request_id, problem)


def _not_an_object(message: Any) -> ValueError:
    if isinstance(message, ValueError):
        return message
    return ValueError("a frame whose JSON is not an object")


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
    if inline_below and sum(np.asarray(a).nbytes for a in arrays.values()) < inline_below:
        region = None
    try:
        _put_each(arrays, region, allocator, descriptors, chunks, taken)
    except BaseException:
        for offset in taken:  # nobody will learn of them
            assert allocator is not None
            allocator.free(offset)
        raise
    return descriptors, chunks, taken


def _put_each(
    arrays: Mapping[str, np.ndarray],
    region: Region | None,
    allocator: Allocator | None,
    descriptors: list[Descriptor],
    chunks: list[bytes],
    taken: list[int],
) -> None:
    """:func:`put_tensors`' work, appending to its lists (the blocks taken as they are)."""
    raw_at = 0
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
