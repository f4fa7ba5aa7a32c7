"""E|PD and E|P|D through the app: payloads, ids, the rewrite and its fallback."""

from __future__ import annotations

import json

import httpx
import pytest

from epdctl.proxy.request.media import content_key
from epdctl.proxy.request.shape import PREFILL_KV
from epdctl.proxy.server import handler as handler_module
from tests.proxy.fakes import MODEL, PNG, STREAM, Fakes, chat_chunk, image_part, sse, sse_response

pytestmark = pytest.mark.anyio
KEY = content_key("image", PNG)
GRID = {"image_grid_thw": [1, 4, 4]}


def fail(status: int, body: object = None):
    return lambda seen: httpx.Response(status, json=body or {"error": {
        "message": "Internal server error", "type": "InternalServerError", "code": status}})


async def test_image_goes_to_e_then_pd_with_the_same_content_key(rig_factory):
    rig = rig_factory(encode=("http://e0",))
    content = [{"type": "text", "text": "what is it?"}, image_part()]
    r = await rig.client.post("/v1/chat/completions", headers={"x-request-id": "req-7"},
                              json={"model": MODEL, "messages": [{"role": "user",
                                                                  "content": content}],
                                    "max_tokens": 5})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello"
    assert r.headers["x-request-id"] == "req-7"
    [enc] = rig.fakes.posts("e")
    assert enc.headers["x-request-id"] == "req-7:enc0"
    assert enc.body == {"model": MODEL, "stream": False, "messages": [
        {"role": "user", "content": [{**image_part(), "uuid": KEY}]}]}
    [pd] = rig.fakes.posts("pd")
    assert pd.headers["x-request-id"] == "req-7"  # the client's: vLLM names the answer by it
    assert pd.body["messages"][0]["content"] == [content[0], {**image_part(), "uuid": KEY}]
    assert pd.body["max_tokens"] == 5
    assert pd.body["ec_transfer_params"] == {KEY: {"item_indices": [0], "metadata": {}}}


async def test_fan_out_one_subrequest_per_distinct_item_across_encoders(rig_factory):
    rig = rig_factory(encode=("http://e0", "http://e1"))
    other = image_part(PNG + b"2")
    r = await rig.chat([image_part(), other, image_part()], mm_processor_kwargs={"k": 1},
                       media_io_kwargs={"image": {"m": 2}})
    assert r.status_code == 200
    encs = rig.fakes.posts("e")  # each to its key's encoder (test_upstreams: affinity)
    assert len(encs) == 2 and {s.instance for s in encs} <= {"e0", "e1"}
    assert sorted(s.headers["x-request-id"].rsplit(":", 1)[1] for s in encs) == ["enc0", "enc1"]
    assert all(s.body["mm_processor_kwargs"] == {"k": 1} for s in encs)
    assert all(s.body["media_io_kwargs"] == {"image": {"m": 2}} for s in encs)
    [pd] = rig.fakes.posts("pd")
    uuids = [p["uuid"] for p in pd.body["messages"][0]["content"]]
    assert uuids == [KEY, content_key("image", PNG + b"2"), KEY]
    assert pd.body["mm_processor_kwargs"] == {"k": 1}  # raw media keeps the kwargs
    metrics = (await rig.client.get("/metrics")).text
    assert "epdctl_proxy_encoder_fanout_items_sum 2.0" in metrics


async def test_text_only_skips_e_and_pd_gets_the_client_bytes_unchanged(rig_factory):
    rig = rig_factory(encode=("http://e0",))
    raw = (b'{"model":"tiny", "messages":[{"role":"user",'
           b'"content":[{"type":"text","text":"hi \xc3\xa9"}]}]}')
    r = await rig.client.post("/v1/chat/completions", content=raw)
    assert r.status_code == 200
    assert rig.fakes.posts("e") == []
    [pd] = rig.fakes.posts("pd")
    assert pd.raw == raw
    r = await rig.client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 200 and rig.fakes.posts("pd")[-1].path == "/v1/completions"


async def test_client_body_is_never_mutated(rig_factory, monkeypatch):
    parsed = []
    real = handler_module.parse_body

    def spy(raw, route, models):
        parsed.append((real(raw, route, models), json.loads(raw)))
        return parsed[-1][0]

    monkeypatch.setattr(handler_module, "parse_body", spy)
    fakes = Fakes(encoder_metadata=GRID)
    fakes.then("pd0", fail(500))
    rig = rig_factory(fakes, encode=("http://e0",))
    r = await rig.chat([image_part(), {"type": "text", "text": "x"}], stream=False,
                       mm_processor_kwargs={"a": 1})
    assert r.status_code == 200
    [(body, original)] = parsed
    assert body == original


async def test_e_p_d_passes_kv_transfer_params_from_p_to_d(rig_factory):
    rig = rig_factory(encode=("http://e0",), prefill=("http://p0",), decode=("http://d0",))
    r = await rig.client.post("/v1/chat/completions", headers={"x-request-id": "r1"}, json={
        "model": MODEL, "stream": True, "max_tokens": 30, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": [image_part()]}]})
    assert r.status_code == 200 and r.content == STREAM
    [p] = rig.fakes.posts("p0")
    assert p.headers["x-request-id"] == "r1:prefill"
    assert p.body["kv_transfer_params"] == PREFILL_KV
    assert (p.body["stream"], p.body["max_tokens"], p.body["max_completion_tokens"]) == (
        False, 1, 1)
    assert "stream_options" not in p.body
    assert p.body["messages"][0]["content"][0]["uuid"] == KEY
    [d] = rig.fakes.posts("d0")
    assert d.headers["x-request-id"] == "r1"
    assert d.body["kv_transfer_params"] == rig.fakes.kv_params
    assert (d.body["stream"], d.body["max_tokens"]) == (True, 30)
    assert d.body["stream_options"] == {"include_usage": True}


async def test_p_d_text_completions(rig_factory):
    rig = rig_factory(prefill=("http://p0",), decode=("http://d0",))
    r = await rig.client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                       "max_tokens": 4})
    assert r.status_code == 200
    [p] = rig.fakes.posts("p0")
    assert p.path == "/v1/completions" and "max_completion_tokens" not in p.body
    [d] = rig.fakes.posts("d0")
    assert d.body == {"model": MODEL, "prompt": "hi", "max_tokens": 4,
                      "kv_transfer_params": rig.fakes.kv_params}


async def test_metadata_rewrite_sends_embeds_parts_to_p_and_d(rig_factory):
    fakes = Fakes(encoder_metadata={"image_grid_thw": [[1, 4, 4]]})
    rig = rig_factory(fakes, encode=("http://e0",), prefill=("http://p0",),
                      decode=("http://d0",))
    r = await rig.chat([image_part(), {"type": "text", "text": "x"}],
                       mm_processor_kwargs={"a": 1})
    assert r.status_code == 200
    embeds = {"type": "image_embeds", "image_embeds": GRID, "uuid": KEY}
    for seen in (*rig.fakes.posts("p0"), *rig.fakes.posts("d0")):
        assert seen.body["messages"][0]["content"][0] == embeds
        assert "mm_processor_kwargs" not in seen.body
    assert rig.fakes.posts("e0")[0].body["mm_processor_kwargs"] == {"a": 1}


async def test_no_metadata_rewrite_keeps_the_media(rig_factory):
    rig = rig_factory(Fakes(encoder_metadata=GRID), encode=("http://e0",),
                      metadata_rewrite=False)
    assert (await rig.chat([image_part()])).status_code == 200
    [pd] = rig.fakes.posts("pd")
    assert pd.body["messages"][0]["content"][0]["type"] == "image_url"


async def test_rewrite_fallback_on_500_resends_raw_media(rig_factory):
    fakes = Fakes(encoder_metadata=GRID)
    fakes.then("pd0", fail(500))
    rig = rig_factory(fakes, encode=("http://e0",))
    r = await rig.chat([image_part()])
    assert r.status_code == 200
    first, second = rig.fakes.posts("pd")
    assert first.body["messages"][0]["content"][0]["type"] == "image_embeds"
    assert second.body["messages"][0]["content"][0] == {**image_part(), "uuid": KEY}
    metrics = (await rig.client.get("/metrics")).text
    assert 'epdctl_proxy_fallbacks_total{reason="rewrite"} 1.0' in metrics


async def test_rewrite_fallback_on_sse_error_before_content(rig_factory):
    fakes = Fakes(encoder_metadata=GRID)
    error = {"error": {"message": "Internal server error", "type": "InternalServerError",
                       "param": None, "code": 500}}
    bad = sse(chat_chunk("", role="assistant"), error, "[DONE]")
    fakes.then("pd0", lambda seen: sse_response(bad))
    rig = rig_factory(fakes, encode=("http://e0",))
    r = await rig.chat([image_part()], stream=True)
    assert r.status_code == 200 and r.content == STREAM
    assert [s.body["messages"][0]["content"][0]["type"] for s in rig.fakes.posts("pd")] == [
        "image_embeds", "image_url"]


async def test_encoder_failure_falls_back_to_raw_media_on_pd(rig_factory):
    fakes = Fakes(encoder_metadata=GRID)
    fakes.down.add("e0")
    rig = rig_factory(fakes, encode=("http://e0",))
    r = await rig.chat([image_part()])
    assert r.status_code == 200
    assert len(rig.fakes.posts("e0")) == 2  # one retry (no other encoder), then fallback
    [pd] = rig.fakes.posts("pd")
    assert pd.body["messages"][0]["content"][0] == {**image_part(), "uuid": KEY}
    assert "ec_transfer_params" not in pd.body
    metrics = (await rig.client.get("/metrics")).text
    assert 'epdctl_proxy_fallbacks_total{reason="encoder"} 1.0' in metrics
    assert 'epdctl_proxy_retries_total{stage="encode"} 1.0' in metrics


async def test_encoder_5xx_falls_back_and_a_refused_connection_retries(rig_factory):
    fakes = Fakes(encoder_metadata=GRID)
    rig = rig_factory(fakes, encode=("http://e0", "http://e1"))
    first = rig.proxy.upstreams.pools["encode"].pick()  # the one the request will not get
    other = "e0" if first.url.endswith("e1") else "e1"
    fakes.then(other, fail(503))
    assert (await rig.chat([image_part()])).status_code == 200
    assert [s.instance for s in rig.fakes.posts("e")] == [other]  # an answer is not resent
    [pd] = rig.fakes.posts("pd")
    assert pd.body["messages"][0]["content"][0] == {**image_part(), "uuid": KEY}

    fakes = Fakes(encoder_metadata=GRID)
    rig = rig_factory(fakes, encode=("http://e0", "http://e1"))
    first = rig.proxy.upstreams.pools["encode"].pick()
    fakes.down.add("e0" if first.url.endswith("e1") else "e1")  # refuses the connection
    assert (await rig.chat([image_part()])).status_code == 200
    assert sorted(s.instance for s in rig.fakes.posts("e")) == ["e0", "e1"]
    [pd] = rig.fakes.posts("pd")
    assert pd.body["messages"][0]["content"][0]["type"] == "image_embeds"


async def test_encoder_timeout_falls_back(rig_factory):
    import asyncio

    async def slow(seen):
        await asyncio.sleep(5)

    fakes = Fakes(encoder_metadata=GRID)
    fakes.then("e0", slow)
    rig = rig_factory(fakes, encode=("http://e0",), encode_timeout_s=0.2)
    r = await rig.chat([image_part()])
    assert r.status_code == 200
    [pd] = rig.fakes.posts("pd")
    assert pd.body["messages"][0]["content"][0]["type"] == "image_url"
    assert rig.proxy.upstreams.pools["encode"].instances[0].outstanding == 0


async def test_encoder_400_falls_back_so_pd_can_answer(rig_factory):
    fakes = Fakes()
    fakes.then("e0", fail(400))
    rig = rig_factory(fakes, encode=("http://e0",))
    assert (await rig.chat([image_part()])).status_code == 200
    assert len(rig.fakes.posts("e0")) == 1  # a 4xx is not retried


async def test_all_encoders_ejected_skips_e_and_pd_encodes(rig_factory):
    fakes = Fakes(encoder_metadata=GRID)
    rig = rig_factory(fakes, encode=("http://e0",), eject_after=1)
    fakes.down.add("e0")
    await rig.proxy.upstreams.probe_all(lambda url: rig.proxy.client.probe(url, 1.0))
    seen_before = len(rig.fakes.posts("e0"))
    r = await rig.chat([image_part()])
    assert r.status_code == 200
    assert len(rig.fakes.posts("e0")) == seen_before  # no attempt on an ejected encoder
    [pd] = rig.fakes.posts("pd")
    assert pd.body["messages"][0]["content"][0] == {**image_part(), "uuid": KEY}
