"""A small asyncio client for etcd v3 through its JSON gateway (``/v3/...``), over aiohttp.

etcd serves the gRPC API as JSON on its client port (keys and values base64,
64-bit integers as strings). This client covers what fleet mode needs: range
reads, compare-and-swap transactions, leases and a prefix watch. Several
endpoints may be given; a request that cannot reach one moves on to the next.
With a user name, the client authenticates (``/v3/auth/authenticate``), sends
the token with every request, and authenticates again when etcd says the token
is no longer valid.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

MAX_WATCH_MESSAGE = 256 * 2**20
"""The largest watch response read (one JSON line). etcd takes values up to 1.5 MiB by
default and may send many in one response; aiohttp's own line limit (512 KiB) broke the
watch on one large value. A longer message ends the watch: the next session reads it all."""


class EtcdError(Exception):
    """etcd cannot be reached, or answered with an error."""


class EtcdAuthExpired(EtcdError):
    """etcd no longer accepts the client's token: authenticate again."""


class WatchCompacted(EtcdError):
    """The watch's start revision was compacted away: read everything again."""


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd holds it: key and value are bytes, UTF-8 or not."""

    key: bytes
    value: bytes
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "PUT" or "DELETE"
    kv: KeyValue


@dataclass(frozen=True)
class WatchBatch:
    """The events etcd sent in one watch response (one or more revisions, in order)."""

    revision: int
    events: tuple[WatchEvent, ...]


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode("ascii")


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that selects every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return _b64(b"\0")
    raw[-1] += 1
    return _b64(bytes(raw))


def _kv(raw: Any) -> KeyValue:
    """A key-value of the gateway's answer; :class:`EtcdError` when it is not one."""
    try:
        return KeyValue(
            key=base64.b64decode(raw["key"], validate=True),
            value=base64.b64decode(raw.get("value", ""), validate=True),
            mod_revision=int(raw.get("mod_revision", 0)),
            lease=int(raw.get("lease", 0)),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EtcdError(f"etcd sent a malformed key-value: {exc!r}") from None


class EtcdClient:
    """One client per server; ``close()`` it when done."""

    def __init__(
        self,
        endpoints: Sequence[str],
        timeout_s: float = 2.0,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = list(endpoints)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, connect=timeout_s)
        self.username = username
        self._password = password or ""
        self._token: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._current = 0

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._current]

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>``; raises :class:`EtcdError` for etcd's errors."""
        if self.username is not None and self._token is None:
            await self._authenticate()
        data = await self._post(path, body)
        if self.username is not None and _is_auth_error(data):
            await self._authenticate()  # the token expired (or etcd restarted)
            data = await self._post(path, body)
        if "error" in data:
            raise EtcdError(f"{self.endpoint}/v3/{path}: {data.get('message') or data['error']}")
        return data

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One POST, trying each endpoint once from the current one."""
        last: Exception | None = None
        for _ in range(len(self.endpoints)):
            url = f"{self.endpoint}/v3/{path}"
            try:
                async with self._http().post(
                    url, json=body, timeout=self.timeout, headers=self._headers()
                ) as resp:
                    data = await resp.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                last = exc
                self._current = (self._current + 1) % len(self.endpoints)
                continue
            if not isinstance(data, dict):
                raise EtcdError(f"{url}: unexpected answer {data!r}")
            if resp.status != 200 and "error" not in data:
                data["error"] = f"HTTP {resp.status}"
            return data
        raise EtcdError(f"etcd unreachable at {', '.join(self.endpoints)}: {last!r}")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": self._token} if self._token else {}

    async def _authenticate(self) -> None:
        self._token = None
        data = await self._post(
            "auth/authenticate", {"name": self.username, "password": self._password}
        )
        if "error" in data or not data.get("token"):
            raise EtcdError(
                f"etcd refused user {self.username!r}: {data.get('message') or data.get('error')}"
            )
        self._token = str(data["token"])

    # -- keys --------------------------------------------------------------------------

    async def range_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` and the store's revision when read."""
        data = await self.call("kv/range", {"key": _b64(prefix), "range_end": prefix_end(prefix)})
        return int(data["header"]["revision"]), [_kv(kv) for kv in data.get("kvs", [])]

    async def get(self, key: str | bytes) -> KeyValue | None:
        data = await self.call("kv/range", {"key": _b64(key)})
        kvs = data.get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    async def put(self, key: str | bytes, value: bytes, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        data = await self.call("kv/put", body)
        return int(data["header"]["revision"])

    async def put_if(
        self,
        key: str,
        value: bytes | None,
        mod_revision: int,
        lease: int = 0,
        held: tuple[str, bytes, int] | None = None,
    ) -> tuple[bool, int, KeyValue | None]:
        """Put (or, ``value`` None, delete) ``key`` if its mod revision is ``mod_revision``
        (0: the key does not exist), under ``lease`` if given, and, with ``held`` (key,
        value, lease), only while that key holds that value under that lease. Returns
        (done, revision, current key when not done)."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value or b"")}
        if lease:
            put["lease"] = str(lease)
        request = (
            {"request_delete_range": {"key": _b64(key)}} if value is None else {"request_put": put}
        )
        body = {
            "compare": [
                {
                    "key": _b64(key),
                    "target": "MOD",
                    "result": "EQUAL",
                    "mod_revision": str(mod_revision),
                },
                *_holding(held),
            ],
            "success": [request],
            "failure": [{"request_range": {"key": _b64(key)}}],
        }
        data = await self.call("kv/txn", body)
        revision = int(data["header"]["revision"])
        if data.get("succeeded"):
            return True, revision, None
        kvs = data["responses"][0]["response_range"].get("kvs", [])
        return False, revision, _kv(kvs[0]) if kvs else None

    # -- leases ------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        data = await self.call("lease/grant", {"TTL": str(ttl_s)})
        return int(data["ID"])

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; returns its TTL, 0 when it has expired."""
        data = await self.call("lease/keepalive", {"ID": str(lease)})
        return int(data.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self.call("lease/revoke", {"ID": str(lease)})

    # -- watch -------------------------------------------------------------------------

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[WatchBatch]:
        """Changes under ``prefix`` from ``start_revision`` on, as etcd sends them.

        Ends (raising :class:`EtcdError`) when the stream breaks; raises
        :class:`WatchCompacted` when the start revision is no longer kept.
        """
        body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": prefix_end(prefix),
                "start_revision": str(start_revision),
            }
        }
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout.connect, sock_read=None)
        if self.username is not None and self._token is None:
            await self._authenticate()
        url = f"{self.endpoint}/v3/watch"
        try:
            async with self._http().post(
                url, json=body, timeout=timeout, headers=self._headers()
            ) as resp:
                if resp.status != 200:
                    raise EtcdError(f"{url}: HTTP {resp.status}: {await resp.text()}")
                while line := await resp.content.readuntil(b"\n", max_size=MAX_WATCH_MESSAGE):
                    if not line.strip():
                        continue
                    try:
                        batch = _watch_batch(json.loads(line))
                    except (KeyError, TypeError, AttributeError) as exc:
                        raise EtcdError(f"etcd sent a malformed watch response: {exc!r}") from None
                    if batch is not None:
                        yield batch
        except EtcdAuthExpired:
            self._token = None  # the next session authenticates again
            raise
        except (aiohttp.ClientError, HttpProcessingError, OSError, ValueError) as exc:
            self._current = (self._current + 1) % len(self.endpoints)
            raise EtcdError(f"watch on {url} broke: {exc!r}") from None
        raise EtcdError(f"watch on {url} ended")


def _holding(held: tuple[str, bytes, int] | None) -> list[dict[str, Any]]:
    """The compares of a write made only while ``held`` (key, value, lease) stands."""
    if held is None:
        return []
    key, value, lease = held
    return [
        {"key": _b64(key), "target": "VALUE", "result": "EQUAL", "value": _b64(value)},
        {"key": _b64(key), "target": "LEASE", "result": "EQUAL", "lease": str(lease)},
    ]


def _is_auth_error(data: dict[str, Any]) -> bool:
    """etcd's answer to a missing, expired or unknown token (gRPC Unauthenticated, or
    InvalidArgument "user name is empty" for no token at all)."""
    message = str(data.get("message") or data.get("error") or "")
    return "error" in data and (
        data.get("code") == 16 or "auth token" in message or "user name is empty" in message
    )


def _watch_batch(message: dict[str, Any]) -> WatchBatch | None:
    if "error" in message:
        if _is_auth_error(message["error"] if isinstance(message["error"], dict) else message):
            raise EtcdAuthExpired(str(message["error"]))
        raise EtcdError(str(message["error"].get("message", message["error"])))
    result = message.get("result", {})
    if int(result.get("compact_revision", 0)) > 0:
        raise WatchCompacted(f"revisions up to {result['compact_revision']} were compacted")
    if result.get("canceled"):
        raise EtcdError(f"watch canceled: {result.get('cancel_reason', '')}")
    events = tuple(
        WatchEvent(event.get("type", "PUT"), _kv(event["kv"])) for event in result.get("events", [])
    )
    if not events:
        return None
    return WatchBatch(int(result["header"]["revision"]), events)
