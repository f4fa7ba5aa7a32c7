"""One connection of raw_impl's pool and the answer read on it: the asyncio protocol
(httptools' parser callbacks, write flow control) and the Reply it hands the stages (each
wait under the read deadline, reading paused while a slow reader holds PAUSE_BYTES)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

import httptools

from epdctl.proxy.deadlines import Entry, wheel
from epdctl.proxy.errors import UpstreamError

WRITE_SLICE = 1 << 18
"""A large body goes out in slices this size, each once the transport has room (its
buffer under the high-water mark): never copied whole into the transport's buffer."""
PAUSE_BYTES = 1 << 20
"""A streamed answer's bytes held unread from this size on: the connection stops reading
(the instance's socket fills, TCP slows it) until the reader takes them."""


class PoolSide(Protocol):
    """What a connection and its answer need of the pool they belong to."""

    base: str

    def lost_one(self) -> None: ...

    def release(self, conn: Conn) -> None: ...


class Conn(asyncio.Protocol):
    """One keep-alive connection; `reply` is the answer being read on it, if any."""

    def __init__(self, pool: PoolSide) -> None:
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

    def __init__(self, pool: PoolSide, conn: Conn, stage: str, read_timeout_s: float) -> None:
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
        # One deadline per reply on the loop's wheel (deadlines.py), re-armed lazily: a wait
        # moves it, and it looks when it fires (a stream's every chunk would otherwise make
        # and cancel one).
        self._deadline = 0.0
        self._timer: Entry | None = None
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
        timer = self._timer
        if timer is None or timer.when > self._deadline:  # none, or set for a longer bound
            if timer is not None:
                timer.cancel()
            self._timer = wheel(loop).at(self._deadline, self._look)
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
            self._timer = wheel(loop).at(self._deadline, self._look)
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
        """The body as it comes, all that has come at each step in one piece; what the
        reader has not taken stays under PAUSE_BYTES (plus one read of the socket)."""
        self._is_streamed = True
        while True:
            if self._chunks:
                chunks = self._take()
                yield chunks[0] if len(chunks) == 1 else b"".join(chunks)
            elif self._is_complete:
                return
            elif self._error is not None:
                raise self._broken()
            else:
                await self._wait()

    def idle(self, seconds: float) -> None:
        """Every later wait for bytes bounded by `seconds` (the same one timer, re-armed)."""
        self._read_s = seconds

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
