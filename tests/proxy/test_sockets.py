"""The rig itself (sockets.py): what a handler scripts is what the proxy's client meets on a
socket, on each transport, so that every rig test means what it says."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from epdctl.proxy.errors import UpstreamError
from tests.proxy.fakes import Fakes, Seen, sse_response
from tests.proxy.sockets import Instances, Names

pytestmark = pytest.mark.anyio
CHUNKS = [bytes([65 + n]) * (n + 1) for n in range(12)]


async def post(rig, name: str = "pd0", read_timeout_s: float = 5.0):
    return await rig.proxy.client.post(f"http://{name}", "/v1/chat/completions", b"{}",
                                       {"content-type": "application/json"}, read_timeout_s,
                                       "decode")


async def test_a_streamed_answer_arrives_whole_and_in_order(rig_factory):
    rig = rig_factory()
    rig.fakes.then("pd0", lambda seen: sse_response(*CHUNKS))
    reply = await post(rig)
    assert reply.status == 200 and reply.content_type == "text/event-stream"
    pieces = [chunk async for chunk in reply.chunks()]
    assert b"".join(pieces) == b"".join(CHUNKS) and all(pieces)
    await reply.close()


async def test_a_refused_request_is_unavailable_and_seen_once(rig_factory):
    rig = rig_factory()
    rig.fakes.down.add("pd0")
    with pytest.raises(UpstreamError) as info:
        await post(rig)
    assert info.value.kind == "unavailable"
    assert [s.instance for s in rig.fakes.posts("pd")] == ["pd0"]


async def test_a_body_broken_off_is_broken_after_what_came(rig_factory):
    class Breaks(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield CHUNKS[0]
            raise httpx.ReadError("the instance died")

    rig = rig_factory()
    rig.fakes.then("pd0", lambda seen: httpx.Response(200, stream=Breaks()))
    reply = await post(rig)
    got: list[bytes] = []
    with pytest.raises(UpstreamError) as info:
        async for chunk in reply.chunks():
            got.append(chunk)
    await reply.close()
    assert got == CHUNKS[:1] and info.value.kind == "broken"


async def test_a_silent_instance_times_out_and_sees_the_client_leave(rig_factory):
    left = asyncio.Event()

    async def silent(seen: Seen) -> None:
        try:
            await asyncio.sleep(30)
        finally:
            left.set()

    rig = rig_factory()
    rig.fakes.then("pd0", silent)
    with pytest.raises(UpstreamError) as info:
        await post(rig, read_timeout_s=0.2)
    assert info.value.kind == "timeout"
    await asyncio.wait_for(left.wait(), 5)


async def test_rigs_sharing_names_each_reach_their_own_fakes(rig_factory):
    one, two = rig_factory(Fakes()), rig_factory(Fakes())
    for rig in (two, one, two):
        assert (await rig.chat("hi")).status_code == 200
    assert (len(one.fakes.posts("pd0")), len(two.fakes.posts("pd0"))) == (1, 2)


async def test_a_handlers_own_error_fails_the_test():
    def wrong(request: httpx.Request) -> httpx.Response:
        raise ValueError("a bug in the test")

    instances = Instances(wrong)
    port = await instances.port("x")
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.RemoteProtocolError):  # closed without an answer
            await client.get(f"http://127.0.0.1:{port}/")
    with pytest.raises(AssertionError, match="a bug in the test"):
        await instances.close()


async def test_names_are_the_loops_own_again_after(anyio_backend):
    import socket

    names = Names()
    loop = asyncio.get_running_loop()
    names.install()
    assert "getaddrinfo" in vars(loop)
    await names.close()
    assert "getaddrinfo" not in vars(loop)
    assert await loop.getaddrinfo("127.0.0.1", 80, type=socket.SOCK_STREAM)
