"""What the fast path's framing hands a handler."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

from plugserve.server.transport.h1framing import FastRequest


def test_the_content_type_is_read_as_aiohttp_reads_it() -> None:
    def request(*value: str) -> FastRequest:
        headers = CIMultiDict({"Content-Type": value[0]} if value else {})
        return FastRequest("/v2/models/a/infer", "a", CIMultiDictProxy(headers), b"")

    assert request("Application/JSON; charset=utf-8").content_type == "application/json"
    assert request("json").content_type == "application/octet-stream"
    assert request().content_type == "application/octet-stream"
