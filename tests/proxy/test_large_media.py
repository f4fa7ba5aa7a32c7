"""Large items (a 30 MiB video) through the proxy: fetched once, hashed once, sent to E once,
bounded by the cap, and in memory a small multiple of the item's size.

The proxy runs in-process (ASGITransport); E and PD are lean fakes that record the raw bytes
they get without parsing them, served on local sockets to the proxy's client of each kind
(the rig's); the remote video comes from a real HTTP server on 127.0.0.1. The memory tests
keep the lean fakes behind httpx.MockTransport: tracemalloc counts every allocation in the
process, and a server here receiving a 40 MiB body would add it, whole, to the proxy's peak
(a parse would be the fake's memory, not the proxy's).
"""

from __future__ import annotations

import base64
import gc
import hashlib
import json
import random
import threading
import tracemalloc
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from epdctl.proxy import ProxyConfig, create_app
from epdctl.proxy.request import media
from epdctl.proxy.request.media import content_key
from tests.proxy.fakes import Fakes

pytestmark = pytest.mark.anyio
MODEL = "tiny"
SIZE = 30 << 20
CAP = 64 << 20  # the proxy's default --max-body-bytes
ANSWER = json.dumps({"id": "c1", "object": "chat.completion", "model": MODEL, "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "ok"},
     "finish_reason": "stop"}]}).encode()


@pytest.fixture(scope="module")
def video() -> bytes:
    return random.Random(26).randbytes(SIZE)


@pytest.fixture(scope="module")
def video_b64(video: bytes) -> str:
    return base64.b64encode(video).decode()


class Lean(Fakes):
    """E and PD: each request's instance and raw body, kept as sent (no copy, no parse);
    `should_keep` False: its size only (the memory tests measure the proxy, not the fakes)."""

    def __init__(self) -> None:
        super().__init__()
        self.raws: list[tuple[str, bytes]] = []
        self.should_keep = True

    async def handle(self, request: httpx.Request) -> httpx.Response:
        raw = request.content
        self.raws.append((request.url.host, raw if self.should_keep else b"%d" % len(raw)))
        if request.url.host.startswith("e"):
            start = raw.find(b'"uuid":"') + 8
            key = raw[start:raw.index(b'"', start)].decode()
            return httpx.Response(200, json={"id": "e", "choices": [], "ec_transfer_params": {
                key: {"item_indices": [0], "metadata": {}}}})
        return httpx.Response(200, content=ANSWER, headers={"content-type": "application/json"})

    def to(self, prefix: str) -> list[bytes]:
        return [raw for host, raw in self.raws if host.startswith(prefix)]


class Remote(ThreadingHTTPServer):
    """A media server on 127.0.0.1: `/clip.mp4` is the video; counts its GETs."""

    daemon_threads = True

    def __init__(self, content: dict[str, bytes]) -> None:
        super().__init__(("127.0.0.1", 0), _Serve)
        self.content = content
        self.gets: list[str] = []

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Serve(BaseHTTPRequestHandler):
    server: Remote

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self.server.gets.append(self.path)
        data = self.server.content.get(self.path)
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("content-type", "video/mp4")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def remote(video: bytes) -> Iterator[Remote]:
    server = Remote({"/clip.mp4": video, "/big.mp4": bytes(CAP + 1)})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def poster(client: httpx.AsyncClient) -> Any:
    async def post(raw: bytes) -> httpx.Response:
        return await client.post("/v1/chat/completions", content=raw,
                                 headers={"content-type": "application/json"})

    return post


@pytest.fixture
async def proxy(rig_factory: Any) -> Any:
    """(post, lean): post(raw body) -> the proxy's answer; lean: what E and PD got."""
    rig = rig_factory(Lean(), encode=("http://e0",), max_body_bytes=CAP)
    return poster(rig.client), rig.fakes


@pytest.fixture
async def measured_proxy(remote: Remote) -> Any:
    """As `proxy`, the lean fakes behind MockTransport (the module's docstring says why)."""
    lean = Lean()
    upstream = httpx.AsyncClient(mounts={
        "all://": httpx.MockTransport(lean.handle), remote.base: httpx.AsyncHTTPTransport()})
    config = ProxyConfig(models=(MODEL,), encode=("http://e0",), prefill_decode=("http://pd0",),
                         max_body_bytes=CAP, replay_wait_s=0.01)
    app = create_app(config, upstream)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy")
    yield poster(client), lean
    await client.aclose()
    await upstream.aclose()
    app.state.proxy.close()


def chat(url: str) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": "what happens?"}]}]}).encode()


class Hashed:
    """media's hashlib, counting the bytes each sha256 is fed: a stand-in for the module."""

    def __init__(self) -> None:
        self.fed: list[int] = []

    def sha256(self, data: bytes = b"") -> Any:
        counter = self
        counter.fed.append(len(data))
        index = len(counter.fed) - 1
        real = hashlib.sha256(data)

        class Counted:
            def update(self, more: Any) -> None:
                counter.fed[index] += len(more)
                real.update(more)

            def hexdigest(self) -> str:
                return real.hexdigest()

        return Counted()


def peak_of(run: Any) -> Any:
    """Run the coroutine function under tracemalloc; (its result, peak bytes allocated)."""

    async def measured() -> tuple[Any, int]:
        gc.collect()
        tracemalloc.start()
        try:
            result = await run()
            return result, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    return measured()


async def test_a_video_data_url_is_decoded_and_hashed_once_and_sent_to_e_once(
        proxy, video, video_b64, monkeypatch):
    post, lean = proxy
    hashed = Hashed()
    monkeypatch.setattr(media, "hashlib", hashed)
    url = f"data:video/mp4;base64,{video_b64}"
    r = await post(chat(url))
    assert r.status_code == 200, r.text[:300]
    # One digest, fed the modality's prefix and each of the video's bytes exactly once.
    assert hashed.fed == [len(b"video\0") + SIZE]
    key = content_key("video", video)
    [enc] = lean.to("e")
    assert url.encode() in enc and f'"uuid":"{key}"'.encode() in enc
    [pd] = lean.to("pd")
    assert url.encode() in pd and f'"uuid":"{key}"'.encode() in pd


async def test_a_remote_video_is_fetched_once_hashed_once_and_inlined_to_e(
        proxy, remote, video, video_b64, monkeypatch):
    post, lean = proxy
    hashed = Hashed()
    monkeypatch.setattr(media, "hashlib", hashed)
    url = f"{remote.base}/clip.mp4"
    body = json.loads(chat(url))
    body["messages"][0]["content"].append({"type": "video_url", "video_url": {"url": url}})
    r = await post(json.dumps(body).encode())  # the same video twice: one fetch, one key
    assert r.status_code == 200, r.text[:300]
    assert remote.gets == ["/clip.mp4"]
    assert hashed.fed == [len(b"video\0") + SIZE]
    inline = f"data:video/mp4;base64,{video_b64}".encode()
    key = content_key("video", video)
    [enc] = lean.to("e")  # one distinct item, one E sub-request
    assert inline in enc and f'"uuid":"{key}"'.encode() in enc
    [pd] = lean.to("pd")
    assert pd.count(inline) == 2 and url.encode() not in pd


def one_line_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    assert r.content.count(b"\n") <= 1 and b"Traceback" not in r.content
    return r.json()["error"]["message"]


async def test_a_data_url_past_the_cap_is_a_one_line_413_naming_it(proxy, video_b64):
    post, lean = proxy
    url = f"data:video/mp4;base64,{video_b64}{video_b64}{video_b64}"  # 120 MiB of base64
    message = one_line_error(await post(chat(url)), 413)
    assert message == f"request body is larger than {CAP} bytes (--max-body-bytes)"
    assert lean.raws == []


async def test_a_remote_video_past_the_cap_is_a_one_line_400_naming_it(proxy, remote):
    post, lean = proxy
    url = f"{remote.base}/big.mp4"
    message = one_line_error(await post(chat(url)), 400)
    assert message == (f"video_url {url}: more than the proxy's limit of {CAP} bytes "
                       "(--max-body-bytes)")
    assert remote.gets == ["/big.mp4"] and lean.raws == []


# Memory: what the proxy allocates at its peak, over the client's own copy of the body
# (built before measuring). For a data URL of S base64 characters: the body as received (S,
# kept for a pass-through), its parsed string (S), the keyed part serialized once for every
# body that carries it (S, jsonio.Shared) and the one sub-request body being sent (1.5 S:
# orjson grows its buffer by half and keeps it): 4.5 S. Decoding and hashing add one piece
# (1 MiB), not a copy of the item. A remote video of D bytes: its data URL (4/3 D), the
# serialized part (4/3 D) and the sub-request body (1.5 x 4/3 D): 4.7 D; while it is
# inlined, the fetched bytes and two encodings of them (at most 3.7 D, less). Each bound has
# half an item of slack. Before this change (orjson parsing and writing the 40 MiB string,
# the payload decoded whole, httpx's answer freed only by the cyclic GC, so E's body lived
# on) the data URL cost 17.8 S and the remote video 22 D.
DATA_URL_BOUND = 4.5 + 0.5
REMOTE_BOUND = 3.5 * 4 / 3 + 0.5


async def test_a_video_data_url_costs_the_proxy_at_most_a_few_copies_of_it(measured_proxy,
                                                                          video_b64):
    post, lean = measured_proxy
    lean.should_keep = False
    raw = chat(f"data:video/mp4;base64,{video_b64}")
    r, peak = await peak_of(lambda: post(raw))
    assert r.status_code == 200, r.text[:300]
    assert len(lean.to("e")) == 1 and len(lean.to("pd")) == 1
    print(f"data URL: peak {peak / 2**20:.1f} MiB = {peak / len(video_b64):.2f} x the item")
    assert peak < DATA_URL_BOUND * len(video_b64)


async def test_a_remote_video_costs_the_proxy_at_most_a_few_copies_of_it(measured_proxy,
                                                                         remote):
    post, lean = measured_proxy
    lean.should_keep = False
    raw = chat(f"{remote.base}/clip.mp4")
    r, peak = await peak_of(lambda: post(raw))
    assert r.status_code == 200, r.text[:300]
    assert remote.gets == ["/clip.mp4"] and len(lean.to("e")) == 1
    print(f"remote: peak {peak / 2**20:.1f} MiB = {peak / SIZE:.2f} x the item")
    assert peak < REMOTE_BOUND * SIZE
