"""The Upstream interface over aiohttp: measured ~5x less client overhead than httpx here.

benchmarks/proxy.py on 2 cores, one 1 ms upstream, sequential POSTs: aiohttp p50 0.3 ms
over the delay, httpx 1.7-3.5 ms. __main__ therefore uses aiohttp; the proxy tests run on
both clients, against fake instances on local sockets (tests/proxy/sockets.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from epdctl.proxy.errors import UpstreamError
from epdctl.proxy.transport.base import with_key, within


class Response(aiohttp.ClientResponse):
    """A response whose connection is never reused after a 5xx: uvicorn closes the
    connection behind an error the app raised (vLLM's 500s) without `Connection: close`,
    and the next request sent on it would meet a reset."""

    async def start(self, connection: Any) -> aiohttp.ClientResponse:
        protocol = connection.protocol
        await super().start(connection)
        if self.status >= 500 and protocol is not None:
            protocol.force_close()  # closed when released, if it is still ours
            if self.connection is None:  # the whole body came with the head: pooled already
                protocol.close()  # the pool skips a closed connection
        return self


def session(connect_timeout_s: float, read_timeout_s: float, keepalive_s: float
            ) -> aiohttp.ClientSession:
    """The proxy's one shared session."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_s)
    # No cookie jar (instances set none) and no decompression (we ask for identity): both
    # cost time on every request.
    return aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
        response_class=Response,
        timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout_s,
                                      sock_read=read_timeout_s))


def _error(exc: BaseException, stage: str, base: str, kind: str = "unavailable"
           ) -> UpstreamError:
    kind = "timeout" if isinstance(exc, TimeoutError) else kind
    return UpstreamError(stage, base, kind, f"{type(exc).__name__}: {exc}".rstrip(": "))


class AiohttpReply:
    """aiohttp.ClientResponse behind the Reply interface, translating aiohttp's errors."""

    __slots__ = ("_resp", "_stage", "_base", "_idle_s", "status", "content_type")

    def __init__(self, resp: aiohttp.ClientResponse, stage: str, base: str) -> None:
        self._resp = resp
        self._stage = stage
        self._base = base
        self._idle_s: float | None = None
        self.status = resp.status
        self.content_type = resp.headers.get("Content-Type", "application/json")

    def header_list(self) -> list[tuple[bytes, bytes]]:
        return list(self._resp.raw_headers)

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _error(exc, self._stage, self._base, "broken") from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in within(self._resp.content.iter_any(), lambda: self._idle_s):
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _error(exc, self._stage, self._base, "broken") from exc

    def idle(self, seconds: float) -> None:
        self._idle_s = seconds

    async def close(self) -> None:
        # An unfinished body means the client left or we gave up: drop the connection so
        # the instance sees the disconnect and aborts the request.
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()


class AiohttpUpstream:
    """One aiohttp.ClientSession shared by every request."""

    def __init__(self, session: aiohttp.ClientSession, connect_timeout_s: float,
                 api_key: str | None = None) -> None:
        self._session = session
        self._connect_s = connect_timeout_s
        self._auth = f"Bearer {api_key}" if api_key else None
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    def _timeout(self, read_s: float) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get(read_s)
        if timeout is None:
            timeout = self._timeouts[read_s] = aiohttp.ClientTimeout(
                total=None, connect=self._connect_s, sock_read=read_s)
        return timeout

    async def post(self, base: str, path: str, body: bytes, headers: Mapping[str, str],
                   read_timeout_s: float, stage: str) -> AiohttpReply:
        try:
            resp = await self._session.post(base + path, data=body,
                                            headers=with_key(headers, self._auth),
                                            timeout=self._timeout(read_timeout_s))
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _error(exc, stage, base) from exc
        return AiohttpReply(resp, stage, base)

    async def request(self, method: str, base: str, path: str, body: bytes,
                      headers: Mapping[str, str], read_timeout_s: float, stage: str
                      ) -> AiohttpReply:
        try:
            resp = await self._session.request(method, base + path, data=body or None,
                                               headers=with_key(headers, self._auth),
                                               timeout=self._timeout(read_timeout_s))
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _error(exc, stage, base) from exc
        return AiohttpReply(resp, stage, base)

    async def fetch(self, url: str, timeout_s: float, max_bytes: int) -> tuple[int, str, bytes]:
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                         allow_redirects=True, auto_decompress=True) as resp:
                data = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    data += chunk
                    if len(data) > max_bytes:
                        raise UpstreamError("media", url, "too large", f"over {max_bytes} bytes")
                return resp.status, resp.headers.get("Content-Type", ""), bytes(data)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise _error(exc, "media", url) from exc

    async def probe(self, url: str, timeout_s: float) -> bool:
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)
                                         ) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False
