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
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools

from epdctl.proxy.errors import UpstreamError
from epdctl.proxy.transport.base import with_key

SEPARATE_BODY_BYTES = 1 << 20
"""Bodies from this size on are written after their head, not joined to it (a copy)."""
WRITE_SLICE = 1 << 18
"""A large body goes out in slices this size, each once the transport has room (its
buffer under the high-water mark): never copied whole into the transport's buffer."""
MAX_CONNECTIONS = 256
"""Connections open to one instance at most, in use and idle: a request beyond them waits
for one (under its stage's deadline), so a burst cannot open thousands of sockets."""
PAUSE_BYTES = 1 << 20
"""A streamed answer's bytes held unread from this size on: the connection stops reading
(the instance's socket fills, TCP slows it) until the reader takes them."""

class _Conn(asyncio.Protocol):
    """One keep-alive connection; `reply` is the answer being read on it, if any."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reply: RawReply | None = None
        self.is_closed = False
        self.idle_since = 0.0
        self._room: asyncio.Future[None] | None = None  # set while writing is paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    # write flow control (the transport calls these around its high-water mark)
    def pause_writing(self) -> None:
        if self._room is None:
            self._room = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)

    async def write_body(self, body: bytes) -> None:
        """`body` in slices, each once the transport has room; ConnectionResetError if the
        connection is lost meanwhile."""
        view = memoryview(body)
        for start in range(0, len(view), WRITE_SLICE):
            if self.is_closed or self.transport is None:
                raise ConnectionResetError("connection lost while the body was written")
            self.transport.write(view[start:start + WRITE_SLICE])
            if self._room is not None:
                await asyncio.shield(self._room)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.abort(exc)

    def eof_received(self) -> bool:
        return False  # close; connection_lost tells the reply

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_exception(exc or ConnectionResetError("connection closed by the instance"))
            room.exception()  # retrieved: nobody may be waiting on it
        self.pool.lost_one()
        if self.reply is not None:
            self.reply._lost(exc)

    def abort(self, exc: Exception | None = None) -> None:
        self.is_closed = True
        if self.transport is not None:
            self.transport.abort()
        if self.reply is not None:
            self.reply._lost(exc)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.reply is not None:
            self.reply.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.reply is not None:
            self.reply._head(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.reply is not None:
            self.reply._data(body)

    def on_message_complete(self) -> None:
        if self.reply is not None:
            self.reply._complete(self.parser.should_keep_alive())


class RawReply:
    """An answer on a pooled connection, behind the Reply interface."""

    def __init__(self, pool: _Pool, conn: _Conn, stage: str, read_timeout_s: float) -> None:
        self._pool = pool
        self._conn = conn
        self._stage = stage
        self._read_s = read_timeout_s
        self.status = 0
        self.content_type = "application/json"
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []
        self._is_complete = self._keep_alive = self._has_begun = False
        self._is_until_close = True  # no length, not chunked: the body ends with the connection
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        # One timer per reply, re-armed lazily: a wait moves the deadline, the timer looks
        # when it fires (a stream's every chunk would otherwise make and cancel one).
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._held = 0  # bytes in _chunks
        self._is_streamed = self._is_paused = False

    # from the connection
    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _head(self, status: int) -> None:
        self.status = status
        self._has_begun = True
        for name, value in self.raw_headers:
            name = name.lower()
            if name == b"content-type":
                self.content_type = value.decode("latin-1")
            elif name in (b"content-length", b"transfer-encoding"):
                self._is_until_close = False
        self._wake()

    def _data(self, body: bytes) -> None:
        self._chunks.append(body)
        self._held += len(body)
        if self._is_streamed and self._held >= PAUSE_BYTES and not self._is_paused \
                and self._conn.transport is not None:
            self._is_paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _take(self) -> list[bytes]:
        chunks, self._chunks, self._held = self._chunks, [], 0
        if self._is_paused:
            self._is_paused = False
            if self._conn.transport is not None and not self._conn.is_closed:
                self._conn.transport.resume_reading()
        return chunks

    def _complete(self, keep_alive: bool) -> None:
        self._is_complete, self._keep_alive = True, keep_alive
        self._wake()

    def _lost(self, exc: Exception | None) -> None:
        if exc is None and self._has_begun and self._is_until_close:
            self._complete(False)  # HTTP/1.0-style: a clean close ends the answer
            return
        if not self._is_complete and self._error is None:
            self._error = exc or ConnectionResetError("connection closed by the instance")
        self._wake()

    async def _wait(self) -> None:
        """Until the connection has news; UpstreamError "timeout" after `read_timeout_s`
        without any (the connection is then closed: its answer can no longer be read)."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        self._deadline = loop.time() + self._read_s
        if self._timer is None:
            self._timer = loop.call_at(self._deadline, self._look)
        await waiter

    def _look(self) -> None:
        """The timer fired: a timeout if the wait under way began `read_timeout_s` ago; else
        armed again for that wait's deadline (none under way: armed by the next)."""
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._deadline:
            self._timer = loop.call_at(self._deadline, self._look)
            return
        detail = f"no byte from the instance in {self._read_s:g}s"
        waiter.set_exception(UpstreamError(self._stage, self._pool.base, "timeout", detail))
        self._conn.abort(TimeoutError(detail))  # not a clean close: never a whole answer

    async def _head_ready(self) -> None:
        while not self._has_begun:
            if self._error is not None:
                raise self._error
            await self._wait()

    # the Reply interface
    def header_list(self) -> list[tuple[bytes, bytes]]:
        return list(self.raw_headers)

    def _broken(self) -> UpstreamError:
        error = self._error
        detail = f"{type(error).__name__}: {error}".rstrip(": ")
        return UpstreamError(self._stage, self._pool.base, "broken", detail)

    async def read(self) -> bytes:
        while not self._is_complete:
            if self._error is not None:
                raise self._broken()
            await self._wait()
        chunks = self._take()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it comes; what the reader has not taken stays under PAUSE_BYTES
        (plus one read of the socket)."""
        self._is_streamed = True
        while True:
            if self._chunks:
                for chunk in self._take():
                    yield chunk
            elif self._is_complete:
                return
            elif self._error is not None:
                raise self._broken()
            else:
                await self._wait()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn = self._conn
        conn.reply = None
        if self._is_complete and self._keep_alive and self.status < 500 and not conn.is_closed:
            self._pool.release(conn)
        else:
            conn.abort()


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
        self.idle: deque[_Conn] = deque()  # the most recently used last
        self.open = 0  # connections open or being opened, in use and idle
        self.limit = limit
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._sweep: asyncio.TimerHandle | None = None

    def idle_conn(self) -> _Conn | None:
        """The most recently used live connection, dropping any past keep-alive."""
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if not conn.is_closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    async def acquire(self, is_fresh: bool = False) -> _Conn | None:
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

    async def connect(self, timeout_s: float) -> _Conn:
        """A new connection, in the place `acquire` reserved."""
        loop = asyncio.get_running_loop()
        made: list[_Conn] = []

        def factory() -> _Conn:
            made.append(_Conn(self))
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

    def release(self, conn: _Conn) -> None:
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
