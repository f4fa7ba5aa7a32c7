"""vLLM's refusals reach the client unchanged; the proxy's own failures as JSON with a
status before any streamed byte; a retry only when an instance gave no answer at all."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.proxy.fakes import STREAM, chat_chunk, sse, sse_response
from tests.proxy.vllm_like import VllmLike

pytestmark = pytest.mark.anyio


def error_of(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "code"}
    return body["error"]


async def slow(seen):
    await asyncio.sleep(5)


async def test_upstream_4xx_passes_through_unchanged_and_is_not_retried(rig_factory):
    rig = rig_factory(prefill_decode=("http://pd0", "http://pd1"))
    raw = b'{"object":"error","message":"max_tokens too large","code":400}'
    for name in ("pd0", "pd1"):
        rig.fakes.then(name, lambda seen: httpx.Response(400, content=raw))
    for stream in (False, True):
        r = await rig.chat("hi", stream=stream)
        assert (r.status_code, r.content) == (400, raw)
    assert len(rig.fakes.posts("pd")) == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_a_5xx_answer_passes_through_unchanged_and_is_not_retried(rig_factory, stream):
    rig = rig_factory(prefill_decode=("http://pd0", "http://pd1"))
    bad = b'{"error":{"message":"boom","type":"InternalServerError","code":500}}'
    for name in ("pd0", "pd1"):
        rig.fakes.then(name, lambda seen: httpx.Response(500, content=bad))
    r = await rig.chat("hi", stream=stream)
    assert (r.status_code, r.content) == (500, bad)
    assert len(rig.fakes.posts("pd")) == 1
    metrics = (await rig.client.get("/metrics")).text
    assert "epdctl_proxy_retries_total{" not in metrics
    assert 'outcome="upstream_error",route="/v1/chat/completions"} 1.0' in metrics


async def test_no_answer_at_all_is_retried_once_on_another_instance(rig_factory):
    rig = rig_factory(prefill_decode=("http://pd0", "http://pd1"))
    first = rig.proxy.upstreams.pools["prefill_decode"].pick()  # the next pick is the other one
    rig.fakes.down.add("pd1" if first.url.endswith("pd0") else "pd0")
    r = await rig.chat("hi", stream=True)
    assert (r.status_code, r.content) == (200, STREAM)
    refused, answered = rig.fakes.posts("pd")
    assert refused.instance != answered.instance and refused.raw == answered.raw
    metrics = (await rig.client.get("/metrics")).text
    assert 'epdctl_proxy_retries_total{stage="prefill_decode"} 1.0' in metrics


async def test_non_json_5xx_passes_through_unchanged(rig_factory):
    rig = rig_factory()
    rig.fakes.then("pd0", lambda seen: httpx.Response(
        500, content=b"Internal Server Error", headers={"content-type": "text/plain"}))
    r = await rig.chat("hi")
    assert (r.status_code, r.text) == (500, "Internal Server Error")
    assert r.headers["content-type"] == "text/plain"


async def test_connection_error_is_502_naming_the_stage(rig_factory):
    rig = rig_factory()
    rig.fakes.down.add("pd0")
    r = await rig.chat("hi", stream=True)
    assert r.status_code == 502
    err = error_of(r)
    assert (err["code"], err["type"]) == (502, "Bad Gateway")
    assert "prefill_decode instance http://pd0: unavailable" in err["message"]
    assert len(rig.fakes.posts("pd0")) == 2


async def test_an_answer_broken_before_its_end_is_replayed_once_per_instance(rig_factory):
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'{"id": "x", "choi'
            raise httpx.ReadError("connection reset by peer")

    rig = rig_factory(prefill_decode=("http://pd0", "http://pd1"))
    for name in ("pd0", "pd1"):
        rig.fakes.then(name, lambda seen: httpx.Response(200, stream=Broken()))
    r = await rig.chat("hi")
    assert r.status_code == 502 and ": broken: " in error_of(r)["message"]
    assert sorted(s.instance for s in rig.fakes.posts("pd")) == ["pd0", "pd1"]  # replay.py


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_timeout_is_504(rig_factory, stream):
    rig = rig_factory(decode_timeout_s=0.2)
    rig.fakes.then("pd0", slow)
    r = await rig.chat("hi", stream=stream)
    assert r.status_code == 504
    err = error_of(r)
    assert (err["code"], err["type"]) == (504, "Gateway Timeout")
    assert "prefill_decode" in err["message"]
    assert len(rig.fakes.posts("pd0")) == 1  # a timeout is not retried
    assert rig.proxy.upstreams.pools["prefill_decode"].instances[0].outstanding == 0


async def test_prefill_failures(rig_factory):
    # A short deadline only where it is meant to fire (no quick answer has to beat it on a
    # loaded machine); the refusals and the dead P under the default one.
    rig = rig_factory(prefill=("http://p0",), decode=("http://d0",), prefill_timeout_s=0.2)
    rig.fakes.then("p0", slow)
    r = await rig.chat("hi")
    assert r.status_code == 504 and "prefill instance http://p0" in error_of(r)["message"]
    assert rig.fakes.posts("d0") == []
    rig = rig_factory(prefill=("http://p0",), decode=("http://d0",))
    for status in (500, 422):  # P's refusal, unchanged: D never sees the request
        rig.fakes.then("p0", lambda s, n=status: httpx.Response(n, json={"error": {"n": n}}))
        r = await rig.chat("hi")
        assert (r.status_code, r.json()) == (status, {"error": {"n": status}})
    assert rig.fakes.posts("d0") == []
    rig.fakes.down.add("p0")
    r = await rig.chat("hi")
    assert r.status_code == 502 and "prefill instance http://p0" in error_of(r)["message"]
    assert rig.fakes.posts("d0") == []


async def test_sse_error_before_content_is_vllms_stream_passed_on(rig_factory):
    """vLLM answered 200 and streamed an error event: the client gets that, not a retry."""
    rig = rig_factory()
    error = {"error": {"message": "Internal server error", "type": "InternalServerError",
                       "param": None, "code": 500}}
    bad = sse(chat_chunk("", role="assistant"), error, "[DONE]")
    rig.fakes.then("pd0", lambda seen: sse_response(bad))
    r = await rig.chat("hi", stream=True)
    assert (r.status_code, r.content) == (200, bad)
    assert len(rig.fakes.posts("pd0")) == 1


async def test_stream_stall_after_commit_ends_with_an_error_event(rig_factory):
    class Stall(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield sse(chat_chunk("Hi"))
            await asyncio.sleep(5)

    rig = rig_factory(stream_idle_timeout_s=0.2)
    rig.fakes.then("pd0", lambda seen: httpx.Response(200, stream=Stall()))
    r = await rig.chat("hi", stream=True)
    assert r.status_code == 200
    assert r.content.startswith(sse(chat_chunk("Hi")))
    assert b'"type": "Bad Gateway"' in r.content and b"no data in 0.2s" in r.content
    assert rig.proxy.upstreams.pools["prefill_decode"].instances[0].outstanding == 0


async def test_stream_broken_mid_way_ends_with_an_error_event(rig_factory):
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield sse(chat_chunk("Hi"))
            raise httpx.RemoteProtocolError("peer closed connection")

    rig = rig_factory()
    rig.fakes.then("pd0", lambda seen: httpx.Response(200, stream=Broken()))
    r = await rig.chat("hi", stream=True)
    assert r.status_code == 200 and r.content.startswith(sse(chat_chunk("Hi")))
    assert b'"type": "Bad Gateway"' in r.content
    assert b"prefill_decode instance http://pd0: broken: " in r.content


async def test_the_proxy_keeps_serving_after_errors(rig_factory):
    rig = rig_factory(VllmLike())
    assert (await rig.client.post("/v1/chat/completions", content=b"{")).status_code == 400
    assert (await rig.chat("hi", stream=True)).text.endswith("data: [DONE]\n\n")
