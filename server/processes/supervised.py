"""A worker's answers for the whole server, from its supervisor: the model repository
extension (the supervisor has every worker make the change) and the statistics (it
merges every worker's). The assembly (``server/app.py``) hands these to a worker's front
ends where a single process hands the local ones (``server/triton/``)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import aiohttp

from plugserve.registry.errors import Unavailable
from plugserve.server.processes.unix import UnixClient
from plugserve.server.runtime.logs import REQUEST_ID
from plugserve.server.triton.repository import relayed
from plugserve.server.triton.statistics import stats_path


class SupervisedRepository:
    """The repository extension of a worker among several: its supervisor has every worker
    do it (one change at a time), and answers once all have."""

    def __init__(self, supervisor: UnixClient) -> None:
        self.supervisor = supervisor

    async def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = await self._call("index", {"ready": ready_only})
        return rows

    async def load(self, route: str, config: str | None = None) -> dict[str, Any]:
        body = {} if config is None else {"parameters": {"config": config}}
        answer: dict[str, Any] = await self._call(f"models/{quote(route, safe='')}/load", body)
        return answer

    async def unload(self, route: str) -> dict[str, Any]:
        answer: dict[str, Any] = await self._call(f"models/{quote(route, safe='')}/unload", {})
        return answer

    async def _call(self, path: str, body: dict[str, Any]) -> Any:
        try:
            reply = await self.supervisor.call("POST", f"/v2/repository/{path}", json_body=body)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise Unavailable(f"the supervisor is not answering: {exc!r}") from None
        answer = reply.json()
        if reply.status != 200:
            raise relayed(reply.status, answer.get("error", "") if isinstance(answer, dict) else "")
        return answer


class SupervisedStatistics:
    """A worker's answer for the whole server: its supervisor asks every worker."""

    def __init__(self, supervisor: UnixClient) -> None:
        self.supervisor = supervisor

    async def of(self, route: str | None = None, version: str | None = None) -> dict[str, Any]:
        try:
            headers = {"X-Request-ID": REQUEST_ID.get() or ""}  # the supervisor logs it
            reply = await self.supervisor.call("GET", stats_path(route, version), None, headers)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise Unavailable(f"the supervisor is not answering: {exc!r}") from None
        answer = reply.json() if reply.body else {}
        if reply.status != 200:
            message = answer.get("error") if isinstance(answer, dict) else None
            raise relayed(reply.status, str(message or f"the supervisor answered {reply.status}"))
        return answer if isinstance(answer, dict) else {}
