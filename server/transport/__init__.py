"""The protocols under the front ends, with no front end's words: HTTP/2 bytes in, calls
out (``h2connection.py``, with its frames, header blocks, streams and flow control), and
HTTP/1.1's fast path (``h1connection.py``, which frames plain requests itself and hands
every other connection to aiohttp, with ``h1framing.py``)."""
