"""server/writes.py: a client connection's writes of one loop step leave in one, in order,
and nothing written is lost or sent after the connection is closed; then uvicorn with the
protocol, over a real socket, answers as it did (head and body)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import uvicorn

from epdctl.proxy.server.writes import CombinedWrites, Protocol

pytestmark = pytest.mark.anyio


class Recording:
    """What a transport was asked to do."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.calls: list[str] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.calls.append("close")
        self.closing = True

    def abort(self) -> None:
        self.calls.append("abort")
        self.closing = True

    def write_eof(self) -> None:
        self.calls.append("write_eof")

    def get_write_buffer_size(self) -> int:
        return 7

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


def combined() -> tuple[CombinedWrites, Recording]:
    inner = Recording()
    return CombinedWrites(inner, asyncio.get_running_loop()), inner  # type: ignore[arg-type]


async def test_writes_of_one_step_go_out_as_one_in_order() -> None:
    writes, inner = combined()
    writes.write(b"head ")
    writes.write(b"")  # nothing: not a write
    writes.write(bytearray(b"body"))
    assert inner.writes == []  # held until the step ends
    assert writes.get_write_buffer_size() == 7 + 9
    await asyncio.sleep(0)
    assert inner.writes == [b"head body"]
    writes.write(b"next")
    await asyncio.sleep(0)
    assert inner.writes == [b"head body", b"next"]


async def test_close_and_write_eof_send_what_is_held_first() -> None:
    writes, inner = combined()
    writes.write(b"last")
    writes.write_eof()
    assert inner.writes == [b"last"] and inner.calls == ["write_eof"]
    writes.write(b"bye")
    writes.close()
    assert inner.writes == [b"last", b"bye"] and inner.calls == ["write_eof", "close"]
    await asyncio.sleep(0)  # the step's flush finds nothing left
    assert inner.writes == [b"last", b"bye"]


async def test_abort_drops_what_is_held_and_a_closing_transport_gets_nothing() -> None:
    writes, inner = combined()
    writes.write(b"never")
    writes.abort()
    await asyncio.sleep(0)
    assert inner.writes == [] and inner.calls == ["abort"]
    writes, inner = combined()
    writes.write(b"late")
    inner.closing = True
    await asyncio.sleep(0)
    assert inner.writes == []


async def test_everything_else_is_the_transports() -> None:
    writes, _ = combined()
    assert writes.get_extra_info("peername") == ("127.0.0.1", 1)
    assert writes.is_closing() is False


async def _app(scope: dict, receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"5")]})
    await send({"type": "http.response.body", "body": b"hello"})


@pytest.fixture
async def server_port() -> Any:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = uvicorn.Server(uvicorn.Config(_app, host="127.0.0.1", port=port, http=Protocol,
                                           lifespan="off", log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    await asyncio.wait_for(_until_started(server), 10)
    yield port
    server.should_exit = True
    await asyncio.wait_for(task, 10)


async def _until_started(server: uvicorn.Server) -> None:
    while not server.started:
        await asyncio.sleep(0.01)


async def test_uvicorn_with_the_protocol_answers_each_request_whole(server_port) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server_port)
    try:
        request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
        writer.write(request + request)  # two on one keep-alive connection
        # Each answer complete, in order: the head, then exactly its body.
        for _ in range(2):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            assert b"content-length: 5\r\n" in head
            assert await asyncio.wait_for(reader.readexactly(5), 10) == b"hello"
    finally:
        writer.close()
