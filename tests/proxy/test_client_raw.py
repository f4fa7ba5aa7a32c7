"""The proxy's own keep-alive POSTs (epdctl.proxy.transport.raw_impl) against a real local server:
what goes out, answers whole and streamed, reuse, and each failure named as the callers
expect (unavailable: nothing answered, retryable; broken: an answer began)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from epdctl.proxy.errors import UpstreamError
from epdctl.proxy.transport import raw_conn
from epdctl.proxy.transport.raw_impl import RawUpstream
from tests.waits import until

pytestmark = pytest.mark.anyio
HEADERS = {"content-type": "application/json", "x-request-id": "r1"}
OK = b'{"ok": true}'


def answer(body: bytes = OK, status: int = 200, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
            % (status, len(body), extra)) + body


class Server:
    """Answers each request with the next scripted action: bytes to write, or a callable
    given the writer (to misbehave)."""

    def __init__(self) -> None:
        self.script: list[bytes | Callable[[asyncio.StreamWriter], Any]] = []
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed = 0  # connections the client closed (or this server did)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                action = self.script.pop(0) if self.script else answer()
                if callable(action):
                    result = action(writer)
                    if asyncio.iscoroutine(result):
                        await result
                    if writer.is_closing():
                        return
                else:
                    writer.write(action)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()


@pytest.fixture
async def rig() -> AsyncIterator[tuple[Server, RawUpstream, str]]:
    server = Server()
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    upstream = RawUpstream(5.0)
    try:
        yield server, upstream, f"http://127.0.0.1:{port}"
    finally:
        upstream.close()
        srv.close()
        await srv.wait_closed()


async def post(upstream: RawUpstream, base: str, body: bytes = b'{"a": 1}') -> Any:
    return await upstream.post(base, "/v1/chat/completions", body, HEADERS, 5.0, "encode")


async def test_the_request_goes_out_whole_and_the_connection_is_reused(rig):
    server, upstream, base = rig
    for _ in range(3):
        reply = await post(upstream, base)
        assert (reply.status, reply.content_type, await reply.read()) == (
            200, "application/json", OK)
        await reply.close()
    assert server.connections == 1
    host = base.removeprefix("http://").encode()
    assert server.requests[0] == (b"POST /v1/chat/completions HTTP/1.1\r\nhost: " + host +
                                  b"\r\ncontent-length: 8\r\ncontent-type: application/json"
                                  b"\r\nx-request-id: r1\r\n\r\n" + b'{"a": 1}')


async def test_a_large_body_goes_out_whole_after_its_head_on_a_reused_connection(rig):
    """Past SEPARATE_BODY_BYTES the body is written on its own (not joined to the head): the
    instance still reads one whole request, and the next one on the same connection."""
    from epdctl.proxy.transport.raw_impl import SEPARATE_BODY_BYTES

    server, upstream, base = rig
    body = b'{"v": "' + b"QUJD" * (SEPARATE_BODY_BYTES // 2) + b'"}'
    for sent in (body, b'{"a": 1}'):
        await (await post(upstream, base, sent)).close()
    assert server.connections == 1
    assert [r.partition(b"\r\n\r\n")[2] for r in server.requests] == [body, b'{"a": 1}']
    assert b"content-length: %d\r\n" % len(body) in server.requests[0]


async def test_the_instances_key_goes_with_every_post(rig):
    server, _, base = rig
    keyed = RawUpstream(5.0, api_key="s3cret")
    try:
        await (await post(keyed, base)).close()
    finally:
        keyed.close()
    assert b"\r\nauthorization: Bearer s3cret\r\n" in server.requests[0]


async def test_a_chunked_stream_comes_through_in_order(rig):
    server, upstream, base = rig
    events = [b"data: one\n\n", "data: é€😀\n\n".encode(), b"data: [DONE]\n\n"]

    async def stream(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    server.script.append(stream)
    reply = await post(upstream, base)
    assert reply.content_type == "text/event-stream"
    assert b"".join([chunk async for chunk in reply.chunks()]) == b"".join(events)
    await reply.close()
    await (await post(upstream, base)).close()
    assert server.connections == 1  # a whole stream leaves the connection reusable


async def test_events_that_came_together_are_relayed_in_one_piece(rig):
    """Speed of bytes: a stream's events that arrived before the reader looked come out as
    one piece (one write to the client), not one per HTTP chunk the instance wrote."""
    server, upstream, base = rig
    events = [b"data: %d\n\n" % n for n in range(16)] + [b"data: [DONE]\n\n"]
    server.script.append(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n"
                         + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
                         + b"0\r\n\r\n")
    reply = await post(upstream, base)
    await until(lambda: reply._is_complete, "the whole stream in")
    assert [chunk async for chunk in reply.chunks()] == [b"".join(events)]
    await reply.close()


async def test_idle_bounds_every_later_wait_of_a_stream(rig):
    """After `idle(s)` (a stream committed to the client), silence past s is a "timeout",
    though the request's own read timeout is longer."""
    server, upstream, base = rig
    gone = asyncio.Event()

    async def stall(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await gone.wait()

    server.script.append(stall)
    reply = await upstream.post(base, "/v1/chat/completions", b"{}", HEADERS, 30.0, "decode")
    chunks = reply.chunks()
    assert await anext(chunks) == b"first"
    reply.idle(0.2)
    started = asyncio.get_running_loop().time()
    with pytest.raises(UpstreamError) as info:
        await anext(chunks)
    assert info.value.kind == "timeout"
    assert asyncio.get_running_loop().time() - started < 5
    gone.set()
    await reply.close()


async def test_an_answer_that_ends_with_its_connection_is_whole(rig):
    """HTTP/1.0 style (tests/fake_server.py streams so): no length, no chunks, then close."""
    server, upstream, base = rig
    events = b"data: one\n\ndata: [DONE]\n\n"

    def until_close(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + events)
        writer.close()

    server.script += [until_close, until_close]
    reply = await post(upstream, base)
    assert b"".join([chunk async for chunk in reply.chunks()]) == events
    await reply.close()
    reply = await post(upstream, base)
    assert await reply.read() == events
    await reply.close()
    assert server.connections == 2


async def test_a_5xx_is_never_followed_on_its_connection(rig):
    server, upstream, base = rig
    server.script.append(answer(b'{"error": "boom"}', 500))
    reply = await post(upstream, base)
    assert (reply.status, await reply.read()) == (500, b'{"error": "boom"}')
    await reply.close()
    await (await post(upstream, base)).close()
    assert server.connections == 2


async def test_connection_close_is_honoured(rig):
    server, upstream, base = rig
    server.script.append(answer(extra=b"connection: close\r\n"))
    await (await post(upstream, base)).close()
    await (await post(upstream, base)).close()
    assert server.connections == 2


async def test_nothing_listening_is_unavailable(rig):
    _, upstream, base = rig
    dead = "http://127.0.0.1:1"
    with pytest.raises(UpstreamError) as err:
        await post(upstream, dead)
    assert err.value.kind == "unavailable" and err.value.is_retryable


async def test_closed_before_any_answer_byte_is_unavailable(rig):
    server, upstream, base = rig
    server.script.append(lambda writer: writer.close())
    with pytest.raises(UpstreamError) as err:
        await post(upstream, base)
    assert err.value.kind == "unavailable"


async def test_a_pooled_connection_the_instance_closed_is_replaced_once(rig):
    server, upstream, base = rig
    await (await post(upstream, base)).close()
    server.script.append(lambda writer: writer.close())  # the idle connection, gone
    reply = await post(upstream, base)
    assert (reply.status, await reply.read()) == (200, OK)
    await reply.close()
    assert server.connections == 2


async def test_an_answer_cut_short_is_broken(rig):
    server, upstream, base = rig

    def cut(writer: asyncio.StreamWriter) -> None:
        writer.write(answer(b"x" * 100)[:-90])
        writer.close()

    server.script.append(cut)
    reply = await post(upstream, base)
    assert reply.status == 200
    with pytest.raises(UpstreamError) as err:
        await reply.read()
    assert err.value.kind == "broken" and not err.value.is_retryable
    await reply.close()


async def test_a_cancelled_post_drops_its_connection(rig):
    server, upstream, base = rig
    received = asyncio.Event()

    async def hang(writer: asyncio.StreamWriter) -> None:
        received.set()
        await asyncio.Event().wait()  # never answers

    server.script.append(hang)
    task = asyncio.ensure_future(post(upstream, base))
    await received.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await (await post(upstream, base)).close()
    assert server.connections == 2


@pytest.mark.parametrize("when", ["head", "body"])
async def test_an_instance_silent_past_the_read_timeout_is_a_timeout(rig, when):
    """`read_timeout_s` bounds each wait for the instance's next bytes (as httpx's read
    timeout): no head, or a body that stops coming, ends in UpstreamError "timeout" and the
    connection is dropped; the next POST goes out on a fresh one."""
    server, upstream, base = rig

    async def silent(writer: asyncio.StreamWriter) -> None:
        if when == "body":
            writer.write(answer(b"x" * 100)[:-50])
            await writer.drain()
        await asyncio.Event().wait()  # then nothing more

    server.script.append(silent)
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(UpstreamError) as err:
        reply = await upstream.post(base, "/tokenize", b"{}", HEADERS, 0.2, "prefill_decode")
        assert when == "body" and reply.status == 200
        await reply.read()
    assert err.value.kind == "timeout" and "0.2s" in str(err.value)
    assert 0.2 <= loop.time() - began < 5
    await (await post(upstream, base)).close()
    assert server.connections == 2


async def test_a_stream_longer_than_the_read_timeout_is_read_whole(rig):
    """The deadline is each wait's, not the answer's: bytes that keep coming, each well
    within `read_timeout_s` of the last, are read to the end however long that takes."""
    server, upstream, base = rig
    gap_s, pieces, read_s = 0.1, 30, 2.0  # 3 s in all: longer than read_s

    async def trickle(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        for i in range(pieces):
            writer.write(b"%x\r\n%s\r\n" % (len(b"%d," % i), b"%d," % i))
            await writer.drain()
            await asyncio.sleep(gap_s)
        writer.write(b"0\r\n\r\n")

    server.script.append(trickle)
    loop = asyncio.get_running_loop()
    began = loop.time()
    reply = await upstream.post(base, "/v1/chat/completions", b"{}", HEADERS, read_s,
                                "prefill_decode")
    body = b"".join([chunk async for chunk in reply.chunks()])
    await reply.close()
    assert body == b"".join(b"%d," % i for i in range(pieces))
    assert loop.time() - began > read_s  # it did outlast one read timeout


async def test_an_idle_connection_past_keepalive_is_not_reused(rig):
    server, _, base = rig
    upstream = RawUpstream(5.0, keepalive_s=0.0)
    try:
        for _ in range(2):
            await (await post(upstream, base)).close()
    finally:
        upstream.close()
    assert server.connections == 2


async def test_a_stream_the_reader_lags_on_is_held_under_the_pause_size(rig):
    """An instance that streams faster than the proxy's client takes it (a slow client
    downstream): the connection stops reading at PAUSE_BYTES held, so the proxy holds no
    more than that (plus one socket read), and reads on once the reader takes it; the body
    comes through whole and in order."""
    from epdctl.proxy.transport.raw_conn import PAUSE_BYTES

    server, upstream, base = rig
    piece = 1 << 16
    body = bytes(range(256)) * (32 * (1 << 20) // 256)  # 32 MiB: more than every buffer
    wrote_all = asyncio.Event()

    async def flood(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
                     b"content-length: %d\r\n\r\n" % len(body))
        for at in range(0, len(body), piece):
            writer.write(body[at:at + piece])
            await writer.drain()
        wrote_all.set()

    server.script.append(flood)
    reply = await post(upstream, base)
    chunks = reply.chunks()
    got = [await anext(chunks)]
    transport = reply._conn.transport
    assert transport is not None
    for _ in range(200_000):  # the loop runs until the connection pauses (or all came)
        if not transport.is_reading() or wrote_all.is_set():
            break
        await asyncio.sleep(0)
    assert not transport.is_reading() and not wrote_all.is_set()
    assert PAUSE_BYTES <= reply._held <= PAUSE_BYTES + (1 << 18)
    got += [chunk async for chunk in chunks]
    assert b"".join(got) == body
    assert wrote_all.is_set() and transport.is_reading()
    await reply.close()


async def test_a_large_body_is_written_as_the_instance_takes_it(rig, monkeypatch):
    """A 32 MiB body to an instance that does not read yet: the proxy's transport buffer
    stays near its high-water mark (write flow control), not the whole body."""
    server, upstream, base = rig
    transports: list[asyncio.WriteTransport] = []
    made = raw_conn.Conn.connection_made

    def record(self: raw_conn.Conn, transport: asyncio.BaseTransport) -> None:
        transports.append(transport)  # type: ignore[arg-type]
        made(self, transport)

    monkeypatch.setattr(raw_conn.Conn, "connection_made", record)
    body = b"x" * (32 << 20)
    task = asyncio.ensure_future(post(upstream, base, body))
    await until(lambda: transports and transports[0].get_write_buffer_size() > 0,
                "the instance's socket full")
    held = transports[0].get_write_buffer_size()
    assert held <= (1 << 16) + raw_conn.WRITE_SLICE, held
    reply = await task  # the server reads it all, then answers
    assert (reply.status, await reply.read()) == (200, OK)
    await reply.close()
    assert server.requests[-1].endswith(body)


async def test_no_more_than_the_cap_of_connections_to_one_instance(rig):
    """With 2 allowed, a third request waits for a connection and then reuses one."""
    server, _, base = rig
    capped = RawUpstream(5.0, max_connections=2)
    gate = asyncio.Event()

    async def held(writer: asyncio.StreamWriter) -> None:
        await gate.wait()
        writer.write(answer())
        await writer.drain()

    server.script += [held, held]
    try:
        async def one() -> bytes:
            reply = await post(capped, base)
            try:
                return await reply.read()
            finally:
                await reply.close()

        tasks = [asyncio.ensure_future(one()) for _ in range(3)]
        await until(lambda: len(server.requests) == 2, "two requests at the instance")
        gate.set()
        assert await asyncio.gather(*tasks) == [OK] * 3
        assert server.connections == 2
    finally:
        capped.close()


async def test_an_idle_connection_is_closed_after_keepalive_without_new_requests(rig):
    server, _, base = rig
    brief = RawUpstream(5.0, keepalive_s=0.2)
    try:
        await (await post(brief, base)).close()
        assert server.closed == 0
        await until(lambda: server.closed == 1, "the idle connection closed")
    finally:
        brief.close()
