"""Compressed responses: gzip or deflate when the client's ``Accept-Encoding`` asks for one.

Request bodies need nothing here: aiohttp inflates a ``Content-Encoding: gzip``
or ``deflate`` body as it is read (``server/http/bodies.py`` bounds it).
"""

from __future__ import annotations

import zlib

CODINGS = ("gzip", "deflate")
"""What a response may be compressed with, preferred first (tritonclient asks for one)."""
MIN_BYTES = 1024
"""Smaller bodies go as they are: compressing them saves less than it costs (a client
that asked for compression takes an uncompressed answer, as HTTP allows)."""
OFF_LOOP_BYTES = 64 * 1024
"""Larger bodies are compressed off the event loop."""
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""gzip's framing, and HTTP's ``deflate``: the zlib format (RFC 9110), as Triton sends it."""


def accepted(header: str | None) -> str | None:
    """The coding to answer with for an ``Accept-Encoding`` header, or ``None``.

    ``gzip`` before ``deflate`` when both are acceptable; ``*`` stands for any coding
    the header does not name; a coding with ``q=0`` is refused, ``*`` or not (RFC 9110).
    """
    if not header:
        return None
    qualities: dict[str, float] = {}
    for item in header.lower().split(","):
        coding, _, params = item.partition(";")
        qualities[coding.strip()] = _quality(params)
    star = qualities.get("*", 0.0)
    return next((c for c in CODINGS if qualities.get(c, star) > 0), None)


def _quality(params: str) -> float:
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip() == "q":
            try:
                return float(value)
            except ValueError:
                return 0.0
    return 1.0


def compress(body: bytes, coding: str) -> bytes:
    """``body`` in ``coding`` (``gzip`` or ``deflate``), at zlib's default level."""
    compressor = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, _WBITS[coding])
    return compressor.compress(body) + compressor.flush()
