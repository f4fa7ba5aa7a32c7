"""The app's edges: auth, the in-flight bound, limits, /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import pytest

from epdctl.proxy.transport import Split
from epdctl.proxy.transport.httpx_impl import HttpxUpstream
from epdctl.proxy.transport.raw_impl import RawUpstream
from tests.proxy.fakes import MODEL
from tests.proxy.vllm_like import CARD, VllmLike
from tests.waits import until

pytestmark = pytest.mark.anyio


async def test_api_key_guards_every_route_but_health(rig_factory):
    rig = rig_factory(api_key="s3cret")
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("POST", "/v1/responses"), ("POST", "/tokenize"), ("GET", "/nope"),
                         ("GET", "/v1/models"), ("GET", "/metrics")):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            r = await rig.client.request(method, path, headers=headers, json={})
            assert (r.status_code, r.content) == (401, b'{"error":"Unauthorized"}'), path
    assert rig.fakes.posts("pd") == []
    assert (await rig.client.get("/health")).status_code == 200
    ok = {"authorization": "Bearer s3cret"}
    assert (await rig.client.get("/v1/models", headers=ok)).status_code == 200
    r = await rig.client.post("/v1/chat/completions", headers=ok, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    assert "authorization" not in rig.fakes.posts("pd")[0].headers  # the key stays here


async def test_in_flight_bound_answers_503_with_retry_after(rig_factory):
    rig = rig_factory(max_inflight=2)
    gate = asyncio.Event()

    async def held(seen):
        await gate.wait()

    rig.fakes.then("pd0", held, held)
    first = [asyncio.create_task(rig.chat("hi")) for _ in range(2)]
    await until(lambda: rig.proxy.inflight == 2, "both requests in flight")
    r = await rig.chat("hi")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"] == {"message": "The proxy is at its in-flight limit; retry later",
                                 "type": "ServiceUnavailableError", "param": None, "code": 503}
    gate.set()
    assert [t.status_code for t in await asyncio.gather(*first)] == [200, 200]
    assert rig.proxy.inflight == 0
    assert (await rig.chat("hi")).status_code == 200


async def test_oversize_body_is_413_by_header_and_by_bytes(rig_factory):
    rig = rig_factory(max_body_bytes=100)
    r = await rig.chat("x" * 200)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert r.json()["error"]["type"] == "Request Entity Too Large"

    async def chunks():
        for _ in range(5):
            yield b"x" * 50

    r = await rig.client.post("/v1/chat/completions", content=chunks())  # no content-length
    assert r.status_code == 413
    assert rig.fakes.posts("pd") == []


async def test_what_the_proxy_cannot_orchestrate_gets_vllms_own_answer(rig_factory):
    """A model it does not know, JSON it cannot read, media it cannot key: the body goes to
    PD as it came (E is skipped) and the client gets PD's refusal unchanged."""
    rig = rig_factory(VllmLike(), encode=("http://e0",))
    r = await rig.client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": []})
    assert r.status_code == 404
    assert r.json()["error"] == {"message": f"The model `gpt-4` does not exist. Valid aliases: "
                                            f"{MODEL}.", "type": "NotFoundError",
                                 "param": "model", "code": 404}
    r = await rig.client.post("/v1/completions", content=b'{"prompt": ')
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]
    r = await rig.chat(bad)
    assert r.status_code == 200  # the fake PD takes it; vLLM would answer for it
    assert rig.fakes.posts("e") == []
    assert [s.raw for s in rig.fakes.posts("pd")][-1] == rig.fakes.posts("pd")[-1].raw
    assert rig.fakes.posts("pd")[-1].body["messages"][0]["content"] == bad


async def test_unknown_paths_and_methods_answer_as_vllm_does(rig_factory):
    rig = rig_factory(VllmLike())
    r = await rig.client.get("/v1/nope")
    assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
    r = await rig.client.get("/v1/chat/completions")
    assert (r.status_code, r.json()) == (405, {"detail": "Method Not Allowed"})
    assert r.headers["allow"] == "POST"
    r = await rig.client.post("/health")
    assert (r.status_code, r.json()) == (405, {"detail": "Method Not Allowed"})


async def test_models_is_the_instances_own_card(rig_factory):
    rig = rig_factory(VllmLike(), models=(MODEL, "alias"))
    r = await rig.client.get("/v1/models")
    assert (r.status_code, r.json()) == (200, CARD)
    assert r.headers["content-type"] == "application/json"


async def test_health_says_which_instances_are_out(rig_factory):
    rig = rig_factory(encode=("http://e0", "http://e1"), eject_after=1)
    rig.fakes.down.add("e1")
    await rig.proxy.upstreams.probe_all(lambda url: rig.proxy.client.probe(url, 1.0))
    r = await rig.client.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "degraded" and body["mode"] == "E|PD"
    assert body["roles"]["encode"] == {"in": ["http://e0"], "out": ["http://e1"]}
    rig.fakes.down.add("pd0")
    await rig.proxy.upstreams.probe_all(lambda url: rig.proxy.client.probe(url, 1.0))
    r = await rig.client.get("/health")
    assert r.status_code == 503 and r.json()["roles"]["prefill_decode"]["out"] == ["http://pd0"]
    metrics = (await rig.client.get("/metrics")).text
    assert 'epdctl_proxy_instance_up{role="encode",url="http://e1"} 0.0' in metrics
    rig.fakes.down.clear()
    await rig.proxy.upstreams.probe_all(lambda url: rig.proxy.client.probe(url, 1.0))
    assert (await rig.client.get("/health")).json()["status"] == "ok"


async def test_ejected_instance_gets_no_requests_while_a_healthy_one_exists(rig_factory):
    rig = rig_factory(prefill_decode=("http://pd0", "http://pd1"), eject_after=2)
    rig.fakes.down.add("pd1")
    for _ in range(2):
        await rig.proxy.upstreams.probe_all(lambda url: rig.proxy.client.probe(url, 1.0))
    rig.fakes.down.clear()  # back, but not yet re-admitted
    for _ in range(6):
        assert (await rig.chat("hi")).status_code == 200
    assert {s.instance for s in rig.fakes.posts("pd")} == {"pd0"}
    await rig.proxy.upstreams.probe_all(lambda url: rig.proxy.client.probe(url, 1.0))
    for _ in range(6):
        await rig.chat("hi")
    assert {s.instance for s in rig.fakes.posts("pd")} == {"pd0", "pd1"}


async def test_metrics_has_every_family(rig_factory):
    rig = rig_factory(VllmLike(), encode=("http://e0",))
    from tests.proxy.fakes import image_part

    await rig.chat([image_part()], stream=True)
    await rig.client.post("/v1/chat/completions", content=b"{")
    await rig.client.post("/tokenize", json={"prompt": "hi"})
    text = (await rig.client.get("/metrics")).text
    for needle in (
        'epdctl_proxy_requests_total{outcome="ok",route="/v1/chat/completions"} 1.0',
        'epdctl_proxy_requests_total{outcome="client_error",route="/v1/chat/completions"} 1.0',
        'epdctl_proxy_stage_seconds_count{stage="encode"} 1.0',
        'epdctl_proxy_stage_seconds_count{stage="decode"} 1.0',
        'epdctl_proxy_stage_seconds_count{stage="total"} 3.0',
        'epdctl_proxy_requests_total{outcome="ok",route="passthrough"} 1.0',
        "epdctl_proxy_encoder_fanout_items_count 1.0",
        "# TYPE epdctl_proxy_fallbacks_total counter",
        "# TYPE epdctl_proxy_retries_total counter",
        "epdctl_proxy_inflight_requests 0.0",
    ):
        assert needle in text, needle


async def test_two_apps_in_one_process_keep_separate_metrics(rig_factory):
    a, b = rig_factory(), rig_factory()
    await a.chat("hi")
    assert 'outcome="ok"' in (await a.client.get("/metrics")).text
    assert 'outcome="ok"' not in (await b.client.get("/metrics")).text


async def test_request_log_line_names_stages(rig_factory, caplog):
    rig = rig_factory(encode=("http://e0",), prefill=("http://p0",), decode=("http://d0",))
    from tests.proxy.fakes import image_part

    with caplog.at_level("INFO", logger="epdctl.proxy"):
        await rig.client.post("/v1/chat/completions", headers={"x-request-id": "trace-me"},
                              json={"messages": [{"role": "user", "content": [image_part()]}]})
    [line] = [r.getMessage() for r in caplog.records if "rid=trace-me " in r.getMessage()]
    for field in ("status=200", "encode_ms=", "prefill_ms=", "decode_ms=", "total_ms=",
                  "items=1", "prefill=http://p0", "decode=http://d0"):
        assert field in line, field


async def test_upstream_client_is_shared_and_left_open(rig_factory, transport):
    """The app sends on the client it was given (its owner closes it), of the kind chosen."""
    rig = rig_factory()
    client = rig.proxy.client
    if transport == "httpx":
        assert isinstance(client, HttpxUpstream)
        wrapped = client._client
    else:  # POSTs on the proxy's own pools, the rest on the aiohttp session
        assert isinstance(client, Split) and isinstance(client.posts, RawUpstream)
        wrapped = client.rest._session
    kind = httpx.AsyncClient if transport == "httpx" else aiohttp.ClientSession
    assert wrapped is rig.upstream and isinstance(wrapped, kind)
    await rig.chat("hi")
    assert not (rig.upstream.is_closed if transport == "httpx" else rig.upstream.closed)
