"""The proxy's POSTs to its instances (E, P, D, PD sub-requests: the hot path) over its own
HTTP/1.1 keep-alive pool, parsed by httptools; everything else goes through aiohttp_impl.

Under cProfile on benchmarks/proxy.py, aiohttp's client was a third of the proxy's time on
the image path (two sub-requests a request: building, header maps, payload objects, timers);
here a request is one write of prebuilt bytes and a parser callback per event. Passed-through
routes, media fetches and health probes (rare, and needing redirects, decompression, any
method) stay on the aiohttp session (aiohttp_impl).

Every stage runs under its own deadline; beside it, each wait for the instance's next bytes
(its answer's head, then each piece of the body) ends after `read_timeout_s` with an
UpstreamError "timeout", as httpx's read timeout does. A connection is pooled
again only after a whole answer that allows it (never after a 5xx: uvicorn may close it
without saying so) and kept for at most `keepalive_s` (below vLLM's 5 s). A pooled connection
the instance closed meanwhile, found dead before any byte of its answer, is replaced once.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping
from urllib.parse import urlsplit

import httptools

from epdctl.proxy.errors import UpstreamError
from epdctl.proxy.transport.base import with_key
from epdctl.proxy.transport.raw_conn import Conn, RawReply

SEPARATE_BODY_BYTES = 1 << 20
"""Bodies from this size on are written after their head, not joined to it (a copy)."""
MAX_CONNECTIONS = 256
"""Connections open to one instance at most, in use and idle: a request beyond them waits
for one (under its stage's deadline), so a burst cannot open thousands of sockets."""


class _Pool:
    """The connections to one instance: at most `limit` open, the idle ones kept for
    `keepalive_s` (closed then, whether or not another request comes)."""

    def __init__(self, base: str, keepalive_s: float, limit: int = MAX_CONNECTIONS) -> None:
        url = urlsplit(base)
        self.base = base
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.host_header = f"host: {url.netloc}\r\n".encode("latin-1")
        self.keepalive_s = keepalive_s
        self.idle: deque[Conn] = deque()  # the most recently used last
        self.open = 0  # connections open or being opened, in use and idle
        self.limit = limit
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._sweep: asyncio.TimerHandle | None = None

    def idle_conn(self) -> Conn | None:
        """The most recently used live connection, dropping any past keep-alive."""
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if not conn.is_closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    async def acquire(self, is_fresh: bool = False) -> Conn | None:
        """An idle connection (unless `is_fresh`), or None with a place reserved to open a
        new one; waits while MAX_CONNECTIONS are open and none is idle."""
        while True:
            conn = None if is_fresh else self.idle_conn()
            if conn is not None:
                return conn
            if self.open < self.limit:
                self.open += 1
                return None
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if not waiter.done():
                    waiter.cancel()
                    self._wake()  # pass a wake-up this waiter will not use on

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def connect(self, timeout_s: float) -> Conn:
        """A new connection, in the place `acquire` reserved."""
        loop = asyncio.get_running_loop()
        made: list[Conn] = []

        def factory() -> Conn:
            made.append(Conn(self))
            return made[-1]

        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(factory, self.host, self.port)
        except BaseException:
            if not (made and made[0].transport is not None):
                self.lost_one()  # else its connection_lost gives the place back
            raise
        return conn

    def lost_one(self) -> None:
        """A connection closed (or never opened): its place goes to a waiter."""
        self.open -= 1
        self._wake()

    def release(self, conn: Conn) -> None:
        now = conn.idle_since = time.monotonic()
        self._drop_expired(now)
        self.idle.append(conn)
        self._wake()
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_s,
                                                                self._sweep_idle)

    def _drop_expired(self, now: float) -> None:
        idle = self.idle
        while idle and (idle[0].is_closed or now - idle[0].idle_since >= self.keepalive_s):
            idle.popleft().abort()  # the oldest, unused past keep-alive (or closed by now)

    def _sweep_idle(self) -> None:
        """Close what stayed idle past keep-alive even when no request comes again."""
        now = time.monotonic()
        self._drop_expired(now)
        self._sweep = None
        if self.idle:
            due = self.idle[0].idle_since + self.keepalive_s - now
            self._sweep = asyncio.get_running_loop().call_later(max(due, 0.01),
                                                                self._sweep_idle)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in self.idle:
            conn.abort()
        self.idle.clear()


class RawUpstream:
    """POSTs to the instances over the proxy's own pools (the other calls of the contract
    go to aiohttp_impl: transport.Split)."""

    def __init__(self, connect_timeout_s: float, api_key: str | None = None,
                 keepalive_s: float = 2.0, max_connections: int = MAX_CONNECTIONS) -> None:
        self._connect_s = connect_timeout_s
        self._auth = f"Bearer {api_key}" if api_key else None
        self._keepalive_s = keepalive_s
        self._limit = max_connections
        self._pools: dict[str, _Pool] = {}

    async def post(
            self, base: str, path: str, body: bytes, headers: Mapping[str, str],
            read_timeout_s: float, stage: str) -> RawReply:
        pool = self._pools.get(base)
        if pool is None:
            pool = self._pools[base] = _Pool(base, self._keepalive_s, self._limit)
        head = [f"POST {path} HTTP/1.1\r\n".encode("latin-1"), pool.host_header,
                b"content-length: %d\r\n" % len(body)]
        head += [f"{k}: {v}\r\n".encode("latin-1")
                 for k, v in with_key(headers, self._auth).items()]
        # A large body (a video inline) is written after its head, not copied into one buffer
        # with it; a small one goes in one write (one segment).
        is_large = len(body) >= SEPARATE_BODY_BYTES
        request = b"".join((*head, b"\r\n")) if is_large else b"".join((*head, b"\r\n", body))
        is_fresh = False
        while True:
            conn = await pool.acquire(is_fresh)
            is_reused = conn is not None
            if conn is None:
                try:
                    conn = await pool.connect(self._connect_s)
                except (OSError, TimeoutError) as exc:
                    kind = "timeout" if isinstance(exc, TimeoutError) else "unavailable"
                    detail = f"{type(exc).__name__}: {exc}".rstrip(": ")
                    raise UpstreamError(stage, base, kind, detail) from None
            reply = conn.reply = RawReply(pool, conn, stage, read_timeout_s)
            assert conn.transport is not None
            conn.transport.write(request)
            try:
                if is_large:
                    await conn.write_body(body)
                await reply._head_ready()
            except (OSError, httptools.HttpParserError) as exc:
                conn.abort()
                if is_reused:
                    is_fresh = True  # closed while idle: once more on a fresh connection
                    continue
                detail = f"{type(exc).__name__}: {exc}".rstrip(": ")
                raise UpstreamError(stage, base, "unavailable", detail) from None
            except BaseException:
                conn.abort()  # cancelled (the client left, a deadline): never pooled again
                raise
            return reply

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
