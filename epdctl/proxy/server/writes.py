"""uvicorn's httptools protocol with a client connection's writes of one loop step sent as one:
an answer's head and body (two ASGI messages, two writes in uvicorn) leave in one send, where
each write on loopback costs a system call and a pass through the TCP stack.

A write is held until the end of the loop step it came in (`call_soon`), never longer, and in
order; `close` and `write_eof` send what is held first, `abort` drops it (as the transport
would). Everything else is the transport's own.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CombinedWrites:
    """A transport whose writes within one loop step go out in one."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data if isinstance(data, bytes) else bytes(data))

    def flush(self) -> None:
        held = self._held
        if not held:
            return
        self._held = []
        if not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def writelines(self, parts: Any) -> None:
        for part in parts:
            self.write(part)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._held))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class Protocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools) over CombinedWrites."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CombinedWrites(transport, self.loop))  # type: ignore[arg-type]
