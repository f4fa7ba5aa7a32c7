"""Every failure reaches the client as JSON with a status, before any streamed byte."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.proxy.fakes import STREAM, chat_chunk, sse, sse_response

pytestmark = pytest.mark.anyio


def error_of(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "code"}
    return body["error"]


async def slow(seen):
    await asyncio.sleep(5)


async def test_upstream_4xx_passes_through_unchanged_and_is_not_retried(rig_factory):
    rig = rig_factory(pd=("http://pd0", "http://pd1"))
    raw = b'{"object":"error","message":"max_tokens too large","code":400}'
    for name in ("pd0", "pd1"):
        rig.fakes.then(name, lambda seen: httpx.Response(400, content=raw))
    for stream in (False, True):
        r = await rig.chat("hi", stream=stream)
        assert (r.status_code, r.content) == (400, raw)
    assert len(rig.fakes.posts("pd")) == 2


async def test_5xx_is_retried_once_on_another_instance(rig_factory):
    rig = rig_factory(pd=("http://pd0", "http://pd1"))
    bad = b'{"error":{"message":"boom","type":"InternalServerError","code":500}}'
    for name in ("pd0", "pd1"):
        rig.fakes.then(name, lambda seen: httpx.Response(500, content=bad))
    r = await rig.chat("hi")  # both fail: the last upstream error, unchanged
    assert (r.status_code, r.content) == (500, bad)
    first, second = rig.fakes.posts("pd")
    assert first.instance != second.instance
    assert first.raw == second.raw
    metrics = (await rig.client.get("/metrics")).text
    assert 'epdctl_proxy_retries_total{stage="prefill_decode"} 1.0' in metrics
    assert 'outcome="upstream_error",route="/v1/chat/completions"} 1.0' in metrics


async def test_one_5xx_then_success_answers_200(rig_factory):
    rig = rig_factory()
    rig.fakes.then("pd0", lambda seen: httpx.Response(503, json={"error": {"message": "x"}}))
    r = await rig.chat("hi", stream=True)
    assert (r.status_code, r.content) == (200, STREAM)
    assert len(rig.fakes.posts("pd0")) == 2


async def test_non_json_5xx_gets_the_openai_error_shape(rig_factory):
    rig = rig_factory()
    for _ in range(2):
        rig.fakes.then("pd0", lambda seen: httpx.Response(502, content=b"Bad Gateway"))
    r = await rig.chat("hi")
    assert r.status_code == 502
    assert "Bad Gateway" in error_of(r)["message"]


async def test_connection_error_is_502_naming_the_stage(rig_factory):
    rig = rig_factory()
    rig.fakes.down.add("pd0")
    r = await rig.chat("hi", stream=True)
    assert r.status_code == 502
    err = error_of(r)
    assert err["code"] == "upstream_unavailable"
    assert "prefill_decode instance http://pd0" in err["message"]
    assert len(rig.fakes.posts("pd0")) == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_timeout_is_504(rig_factory, stream):
    rig = rig_factory(decode_timeout_s=0.2)
    rig.fakes.then("pd0", slow)
    r = await rig.chat("hi", stream=stream)
    assert r.status_code == 504
    err = error_of(r)
    assert err["code"] == "upstream_timeout" and "prefill_decode" in err["message"]
    assert len(rig.fakes.posts("pd0")) == 1  # a timeout is not retried
    assert rig.proxy.upstreams.pools["pd"].instances[0].outstanding == 0


async def test_prefill_failures(rig_factory):
    rig = rig_factory(prefill=("http://p0",), decode=("http://d0",), prefill_timeout_s=0.2)
    rig.fakes.then("p0", slow)
    r = await rig.chat("hi")
    assert r.status_code == 504 and "prefill instance http://p0" in error_of(r)["message"]
    assert rig.fakes.posts("d0") == []
    rig.fakes.then("p0", lambda s: httpx.Response(500, json={"error": {"message": "x"}}))
    assert (await rig.chat("hi")).status_code == 200  # retried
    rig.fakes.then("p0", lambda s: httpx.Response(422, json={"error": {"message": "bad"}}))
    r = await rig.chat("hi")
    assert r.status_code == 422 and r.json() == {"error": {"message": "bad"}}


async def test_sse_error_before_content_becomes_a_status(rig_factory):
    rig = rig_factory()
    error = {"error": {"message": "Internal server error", "type": "InternalServerError",
                       "param": None, "code": 500}}
    bad = sse(chat_chunk("", role="assistant"), error, "[DONE]")
    for _ in range(2):
        rig.fakes.then("pd0", lambda seen: sse_response(bad))
    r = await rig.chat("hi", stream=True)
    assert r.status_code == 500 and r.json() == error
    assert len(rig.fakes.posts("pd0")) == 2
    bad400 = sse({"error": {"message": "too long", "type": "BadRequestError", "code": 400}})
    rig.fakes.then("pd0", lambda seen: sse_response(bad400))
    r = await rig.chat("hi", stream=True)
    assert r.status_code == 400 and error_of(r)["message"] == "too long"


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
    assert b'"type": "upstream_error"' in r.content and b"no data in 0.2s" in r.content
    assert rig.proxy.upstreams.pools["pd"].instances[0].outstanding == 0


async def test_stream_broken_mid_way_ends_with_an_error_event(rig_factory):
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield sse(chat_chunk("Hi"))
            raise httpx.RemoteProtocolError("peer closed connection")

    rig = rig_factory()
    rig.fakes.then("pd0", lambda seen: httpx.Response(200, stream=Broken()))
    r = await rig.chat("hi", stream=True)
    assert r.status_code == 200 and b"peer closed connection" in r.content


async def test_the_proxy_keeps_serving_after_errors(rig_factory):
    rig = rig_factory()
    assert (await rig.client.post("/v1/chat/completions", content=b"{")).status_code == 400
    assert (await rig.chat("hi", stream=True)).content == STREAM
