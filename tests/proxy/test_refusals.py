"""vLLM's refusals over real sockets and the real aiohttp client: the client gets them as
they are, and a connection the instance closed behind a 500 is never used again."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from epdctl.proxy import ProxyConfig, create_app
from epdctl.proxy.transport.aiohttp_impl import session
from tests.proxy.fakes import MODEL

pytestmark = pytest.mark.anyio
REFUSAL = json.dumps({"error": {
    "message": "Cannot load local files without `--allowed-local-media-path`.",
    "type": "InternalServerError", "param": None, "code": 500}}).encode()
OK = json.dumps({"id": "chatcmpl-x", "object": "chat.completion", "choices": []}).encode()


class Uvicornish:
    """Answers like uvicorn under vLLM: after a 500 from an exception the app raised, the
    response is complete and the connection is closed, with no `Connection: close`."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.connections = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                self.requests.append(head.split(b"\r\n", 1)[0] + b" " + body)
                status, answer = ((b"500 Internal Server Error", REFUSAL) if b"file:" in body
                                  else (b"200 OK", OK))
                extra = b""
                if head.startswith(b"GET /version?x=1 "):
                    answer, extra = b'{"version":"0.32.0"}', b"x-vllm: yes\r\n"
                writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
                             + extra + b"content-length: " + str(len(answer)).encode()
                             + b"\r\n\r\n" + answer)
                await writer.drain()
                if status.startswith(b"500"):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def through_aiohttp() -> AsyncIterator[tuple[httpx.AsyncClient, Uvicornish, object]]:
    upstream = Uvicornish()
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    config = ProxyConfig(models=(MODEL,), prefill_decode=(f"http://127.0.0.1:{port}",))
    async with session(5.0, 10.0, 2.0) as client_session:
        app = create_app(config, client_session)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://proxy") as client:
            yield client, upstream, app
    server.close()
    await server.wait_closed()


def _body(url: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}]}]}


async def test_a_500_reaches_the_client_unchanged_and_its_connection_is_dropped(
        through_aiohttp):
    client, upstream, app = through_aiohttp
    for _ in range(3):
        r = await client.post("/v1/chat/completions", json=_body("file:///etc/hostname"))
        assert (r.status_code, r.content) == (500, REFUSAL)  # not a 502 "connection reset"
        r = await client.post("/v1/chat/completions", json=_body("data:image/png;base64,AA=="))
        assert (r.status_code, r.content) == (200, OK)
    assert len(upstream.requests) == 6  # each request sent once: no retry, no replay
    metrics = (await client.get("/metrics")).text
    assert "epdctl_proxy_retries_total{" not in metrics
    # Each 500 cost its connection (the server closed it); the 200 after it came on a fresh
    # one, and the next 500 on that (kept alive): one at first and one after each 500.
    assert upstream.connections == 4


async def test_a_passed_through_get_keeps_its_query_and_the_instances_headers(through_aiohttp):
    client, upstream, _ = through_aiohttp
    r = await client.get("/version?x=1", headers={"x-request-id": "v-1"})
    assert (r.status_code, r.content) == (200, b'{"version":"0.32.0"}')
    assert r.headers["x-vllm"] == "yes" and r.headers["content-type"] == "application/json"
    assert upstream.requests == [b"GET /version?x=1 HTTP/1.1 "]
