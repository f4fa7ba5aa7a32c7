"""Streams pass byte for byte; a client that leaves cancels everything it started."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.proxy.fakes import MODEL, STREAM, chat_chunk, image_part, sse
from tests.waits import until

pytestmark = pytest.mark.anyio


async def test_stream_passes_byte_for_byte_with_utf8_split_across_chunks(rig_factory):
    rig = rig_factory()
    emoji = STREAM.index("😀".encode())
    euro = STREAM.index("€".encode())
    # Cut inside multi-byte characters and inside the first event, one byte at a time too.
    cuts = sorted({3, 40, euro + 1, euro + 2, emoji + 1, emoji + 3, len(STREAM) - 2})
    chunks = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)], strict=True)]
    assert b"".join(chunks) == STREAM
    rig.fakes.stream_chunks = chunks
    r = await rig.chat("hi", stream=True)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.content == STREAM
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                   for line in r.text.split("\n\n") if line.startswith("data: {"))
    assert text == "Hello é€😀"
    rig.fakes.stream_chunks = [bytes([b]) for b in STREAM]
    assert (await rig.chat("hi", stream=True)).content == STREAM


async def test_completions_stream_and_crlf_events(rig_factory):
    rig = rig_factory()
    body = (b'data: {"choices":[{"index":0,"text":"","finish_reason":null}]}\r\n\r\n'
            b'data: {"choices":[{"index":0,"text":"ok","finish_reason":null}]}\r\n\r\n'
            b"data: [DONE]\r\n\r\n")
    rig.fakes.stream_body = body
    r = await rig.client.post("/v1/completions",
                              json={"model": MODEL, "prompt": "x", "stream": True})
    assert (r.status_code, r.content) == (200, body)


def _scope(path: str = "/v1/chat/completions") -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}


class Client:
    """Drives the ASGI app by hand so the test decides when the client leaves."""

    def __init__(self, app, body: dict) -> None:
        self.app = app
        self.pending = [{"type": "http.request", "body": json.dumps(body).encode(),
                         "more_body": False}]
        self.gone = asyncio.Event()
        self.sent: list[dict] = []
        self.got_body = asyncio.Event()

    async def receive(self) -> dict:
        if self.pending:
            return self.pending.pop(0)
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            self.got_body.set()

    def start(self) -> asyncio.Task:
        return asyncio.create_task(self.app(_scope(), self.receive, self.send))


async def test_disconnect_during_encode_cancels_the_sub_requests(rig_factory):
    rig = rig_factory(encode=("http://e0", "http://e1"))
    started, cancelled = [], []

    async def hang(seen):
        started.append(seen.instance)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(seen.instance)
            raise

    # Each item goes to its key's encoder: both may land on one.
    rig.fakes.then("e0", hang, hang)
    rig.fakes.then("e1", hang, hang)
    client = Client(rig.app, {"model": MODEL, "messages": [{"role": "user", "content": [
        image_part(), image_part(b"other")]}]})
    task = client.start()
    await until(lambda: len(started) == 2, "both encoders reached")
    client.gone.set()
    await asyncio.wait_for(task, 2)
    # Each encoder sees its connection go, as vLLM sees a client leave, and stops.
    await until(lambda: len(cancelled) == 2, "both encoders' requests cancelled")
    assert sorted(cancelled) == sorted(started)
    assert client.sent == []
    assert rig.fakes.posts("pd") == []
    assert all(i.outstanding == 0 for i in rig.proxy.upstreams.pools["encode"].instances)
    assert rig.proxy.inflight == 0
    metrics = (await rig.client.get("/metrics")).text
    assert 'outcome="cancelled"' in metrics


async def test_disconnect_mid_stream_closes_the_upstream_stream(rig_factory):
    closed = asyncio.Event()

    class Endless(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield sse(chat_chunk("", role="assistant"), chat_chunk("Hi"))
            await asyncio.sleep(30)

        async def aclose(self) -> None:
            closed.set()

    rig = rig_factory()
    rig.fakes.then("pd0", lambda seen: httpx.Response(200, stream=Endless()))
    client = Client(rig.app, {"model": MODEL, "stream": True,
                              "messages": [{"role": "user", "content": "hi"}]})
    task = client.start()
    await asyncio.wait_for(client.got_body.wait(), 2)
    client.gone.set()
    await asyncio.wait_for(task, 2)
    await until(closed.is_set, "the instance's stream closed as its connection went")
    assert client.sent[0]["status"] == 200
    assert not any(m.get("more_body") is False for m in client.sent[1:])
    assert rig.proxy.upstreams.pools["prefill_decode"].instances[0].outstanding == 0
    assert rig.proxy.inflight == 0
