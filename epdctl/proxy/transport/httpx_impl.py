"""The Upstream contract (transport/base.py) over httpx: one httpx.AsyncClient shared by
every request (`--client httpx`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import httpx

from epdctl.proxy.errors import UpstreamError
from epdctl.proxy.transport.base import with_key, within


def _error(exc: Exception, stage: str, base: str, kind: str = "unavailable") -> UpstreamError:
    kind = "timeout" if isinstance(exc, httpx.TimeoutException) else kind
    return UpstreamError(stage, base, kind, f"{type(exc).__name__}: {exc}".rstrip(": "))


_CLOSED = httpx.ByteStream(b"")


class HttpxReply:
    """httpx.Response behind the Reply interface, translating httpx's errors."""

    __slots__ = ("_resp", "_stage", "_base", "_idle_s", "status", "content_type")

    def __init__(self, resp: httpx.Response, stage: str, base: str) -> None:
        self._resp = resp
        self._stage = stage
        self._base = base
        self._idle_s: float | None = None
        self.status = resp.status_code
        self.content_type = resp.headers.get("content-type", "application/json")

    def header_list(self) -> list[tuple[bytes, bytes]]:
        return list(self._resp.headers.raw)

    async def read(self) -> bytes:
        try:
            return await self._resp.aread()
        except httpx.TransportError as exc:
            raise _error(exc, self._stage, self._base, "broken") from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in within(self._resp.aiter_raw(), lambda: self._idle_s):
                yield chunk
        except httpx.TransportError as exc:
            raise _error(exc, self._stage, self._base, "broken") from exc
        except TimeoutError:
            raise UpstreamError(self._stage, self._base, "timeout",
                                f"no byte from the instance in {self._idle_s:g}s") from None

    def idle(self, seconds: float) -> None:
        self._idle_s = seconds

    async def close(self) -> None:
        await self._resp.aclose()
        # httpx's Response and its stream refer to each other: left to the cyclic GC, the
        # request (and a body of tens of MiB, a video inline) lives on until a collection,
        # often a full one (the pair was promoted while in use). Freed now instead.
        self._resp.stream = _CLOSED


class HttpxUpstream:
    """The default client: one httpx.AsyncClient shared by every request."""

    def __init__(self, client: httpx.AsyncClient, connect_timeout_s: float,
                 api_key: str | None = None) -> None:
        self._client = client
        self._connect_s = connect_timeout_s
        self._auth = f"Bearer {api_key}" if api_key else None
        self._timeouts: dict[float, httpx.Timeout] = {}

    def _timeout(self, read_s: float) -> httpx.Timeout:
        timeout = self._timeouts.get(read_s)
        if timeout is None:
            timeout = self._timeouts[read_s] = httpx.Timeout(read_s, connect=self._connect_s)
        return timeout

    async def post(self, base: str, path: str, body: bytes, headers: Mapping[str, str],
                   read_timeout_s: float, stage: str) -> HttpxReply:
        return await self.request("POST", base, path, body, headers, read_timeout_s, stage)

    async def request(self, method: str, base: str, path: str, body: bytes,
                      headers: Mapping[str, str], read_timeout_s: float, stage: str
                      ) -> HttpxReply:
        request = self._client.build_request(
            method, base + path, content=body or None, headers=with_key(headers, self._auth),
            timeout=self._timeout(read_timeout_s))
        try:
            resp = await self._client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise _error(exc, stage, base) from exc
        return HttpxReply(resp, stage, base)

    async def fetch(self, url: str, timeout_s: float, max_bytes: int) -> tuple[int, str, bytes]:
        try:
            async with self._client.stream("GET", url, timeout=self._timeout(timeout_s),
                                           follow_redirects=True) as resp:
                data = bytearray()
                async for chunk in resp.aiter_bytes():
                    data += chunk
                    if len(data) > max_bytes:
                        raise UpstreamError("media", url, "too large", f"over {max_bytes} bytes")
                return resp.status_code, resp.headers.get("content-type", ""), bytes(data)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
            raise _error(exc, "media", url) from exc

    async def probe(self, url: str, timeout_s: float) -> bool:
        try:
            resp = await self._client.get(url, timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200
