"""HTTP over a Unix socket between the supervisor and its workers: one small client."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from yarl import URL

CONTROL_TIMEOUT_S = 600.0
"""The longest a control call waits unless told otherwise."""
READ_TIMEOUT_S = 5.0
"""A read of a process's state (metrics, plugins, status): past it, that process is left out."""


@dataclass(frozen=True)
class Reply:
    """A control call's answer: status, the headers worth passing on, and the body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


PASSED_HEADERS = ("Content-Type", "ETag", "Retry-After", "X-Plugserve-Pid", "X-Plugserve-Worker")


class UnixClient:
    """Calls one process's control app; connections are kept and reused."""

    def __init__(self, path: Path, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        self.path = path
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.UnixConnector(path=str(self.path), limit=32)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, auto_decompress=False
            )
        return self._session

    async def call(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        json_body: Any = None,
        timeout_s: float | None = None,
    ) -> Reply:
        """One request; raises :class:`aiohttp.ClientError` (or ``TimeoutError``) when the
        process is not there to answer (within ``timeout_s``, default the client's)."""
        if json_body is not None:
            body = json.dumps(json_body).encode()
            headers = {**(headers or {}), "Content-Type": "application/json"}
        session = self._open()
        # As the client sent it: a decoded path (``%2F``) would name another resource.
        url = URL(f"http://plugserve{path}", encoded=True)
        timeout = None if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        async with session.request(
            method, url, data=body, headers=headers, timeout=timeout
        ) as response:
            data = await response.read()
            kept = {h: response.headers[h] for h in PASSED_HEADERS if h in response.headers}
            return Reply(response.status, kept, data)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
