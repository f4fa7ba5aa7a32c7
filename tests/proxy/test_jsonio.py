"""The bytes the proxy must not change, with orjson (epdctl.proxy.jsonio) as its codec:
vLLM's answers and error bodies pass byte for byte on every path, a body the proxy does not
re-shape reaches PD as the client sent it, a body it does re-shape keeps every value, one it
cannot parse goes to vLLM as it came, and its own errors are written as vLLM writes them."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.responses import JSONResponse

from epdctl.proxy import jsonio
from epdctl.proxy.errors import error_body, vllm_type
from epdctl.proxy.sse import error_event
from tests.proxy.fakes import MODEL, STREAM, image_part

pytestmark = pytest.mark.anyio
# Spacing, key order, escapes and non-ASCII as no JSON library of ours would write them.
ODD_ERROR = ('{ "object" : "error",\n  "message": "max_tokens zu gro\\u00df \u20ac \U0001f600",'
             ' "code":400 , "type" :"BadRequestError" }').encode()
E_PD = {"encode": ("http://e0",)}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("has_image", [False, True], ids=["text", "image"])
async def test_vllms_error_body_passes_byte_for_byte(rig_factory, has_image, stream):
    rig = rig_factory(**E_PD)
    rig.fakes.then("pd0", lambda seen: httpx.Response(
        400, content=ODD_ERROR, headers={"content-type": "application/json"}))
    content = [image_part(), {"type": "text", "text": "x"}] if has_image else "hi"
    r = await rig.chat(content, stream=stream)
    assert (r.status_code, r.content) == (400, ODD_ERROR)


@pytest.mark.parametrize("has_image", [False, True], ids=["text", "image"])
async def test_vllms_stream_passes_byte_for_byte(rig_factory, has_image):
    rig = rig_factory(**E_PD)
    content = [image_part(), {"type": "text", "text": "x"}] if has_image else "hi"
    r = await rig.chat(content, stream=True)
    assert (r.status_code, r.content) == (200, STREAM)
    assert len(rig.fakes.posts("e")) == (1 if has_image else 0)


async def test_a_text_body_reaches_pd_as_the_client_sent_it(rig_factory):
    rig = rig_factory(**E_PD)
    raw = (f'{{"model": "{MODEL}",  "messages":[{{"role":"user","content":"caf\\u00e9 \u20ac"}}],'
           ' "temperature": 1e-05, "max_tokens" : 8}').encode()
    r = await rig.client.post("/v1/chat/completions", content=raw)
    assert r.status_code == 200
    (pd,) = rig.fakes.posts("pd")
    assert pd.raw == raw


async def test_a_reshaped_body_keeps_every_value(rig_factory):
    """An image request's PD body is written anew: the same JSON values, UTF-8, compact."""
    rig = rig_factory(**E_PD)
    extra = {"temperature": 1e-05, "top_p": 0.95, "seed": 2**63 - 1, "stop": ["é€😀"],
             "logit_bias": {"50256": -100}, "user": "naïve", "n": 1}
    r = await rig.chat([image_part(), {"type": "text", "text": "wer ist das? 😀"}], **extra)
    assert r.status_code == 200
    (pd,) = rig.fakes.posts("pd")
    assert {k: pd.body[k] for k in extra} == extra  # type: ignore[index]
    assert pd.body["messages"][0]["content"][1]["text"] == "wer ist das? 😀"  # type: ignore[index]
    assert "😀".encode() in pd.raw and b": " not in pd.raw


@pytest.mark.parametrize("value", [b"NaN", b"123456789012345678901234567890"],
                         ids=["nan", "bigint"])
async def test_a_body_the_codec_refuses_goes_to_vllm_as_it_came(rig_factory, value):
    """The stdlib took NaN and integers past 64 bits, orjson does not: vLLM answers them."""
    rig = rig_factory(**E_PD)
    raw = (b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "seed": %s}'
           % (MODEL.encode(), value))
    r = await rig.client.post("/v1/chat/completions", content=raw)
    assert r.status_code == 200
    (pd,) = rig.fakes.posts("pd")
    assert pd.raw == raw


@pytest.mark.parametrize("message", ["plain", "zu groß € 😀 \"quoted\" \\ \n"])
def test_the_proxys_own_error_body_is_what_vllms_jsonresponse_writes(message):
    error = {"message": message, "type": vllm_type(400), "param": "model", "code": 400}
    assert error_body(message, 400, "model") == JSONResponse({"error": error}).body


def test_the_proxys_own_error_event_is_written_as_vllm_writes_its_stream_errors():
    """vLLM's create_streaming_error_response: `json.dumps` of the error, stdlib defaults."""
    message = "prefill_decode instance http://pd0: no data in 0.2s (é)"
    error = {"message": message, "type": "Bad Gateway", "param": None, "code": 502}
    assert error_event(message) == b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


def test_the_codec_round_trips_what_the_stdlib_reads():
    doc = {"a": [1, 2.5, -0.0, 1e-05, 2**63 - 1, -(2**63)], "s": "é€😀\"\\\n\t",
           "n": None, "t": True, "o": {}}
    assert jsonio.loads(jsonio.dumps(doc)) == doc == json.loads(jsonio.dumps(doc))
    with pytest.raises(ValueError):
        jsonio.loads(b"{not json")


def test_a_keyed_media_part_is_serialized_once_for_e_and_pd(monkeypatch):
    """E's body and PD's (and P's, D's) carry the same keyed part: written once, spliced."""
    import orjson

    from epdctl.proxy.request.parse import find_media
    from epdctl.proxy.request.shape import encoder_body, prefill_body, with_keys

    made: list[bytes] = []
    real = orjson.Fragment

    def counting(data: bytes) -> orjson.Fragment:
        made.append(data)
        return real(data)

    monkeypatch.setattr(orjson, "Fragment", counting)
    body = {"model": MODEL, "messages": [{"role": "user", "content": [
        image_part(), {"type": "text", "text": "was ist das? 😀"}]}]}
    (item,) = find_media(body)
    item.uuid = "k" * 64
    e_raw = jsonio.dumps(encoder_body(body, item))
    pd = with_keys(body, [item])
    pd_raw, p_raw = jsonio.dumps(pd), jsonio.dumps(prefill_body(pd, "/v1/chat/completions"))
    assert len(made) == 1 and made[0] in e_raw and made[0] in pd_raw and made[0] in p_raw
    assert json.loads(pd_raw) == {**body, "messages": [{"role": "user", "content": [
        {**image_part(), "uuid": item.uuid}, {"type": "text", "text": "was ist das? 😀"}]}]}
    assert json.loads(e_raw)["messages"][0]["content"] == [{**image_part(), "uuid": item.uuid}]


PAD = b" " * jsonio.LARGE_BYTES  # past it: the stdlib parses, as orjson would


@pytest.mark.parametrize("doc", [
    b'{"a": [1, -9223372036854775808, 18446744073709551615, 18446744073709551616, 1.5e3]}',
    b'{"s": "\\u00e9\\ud83d\\ude00 \\"q\\" \\\\ \\n", "n": null, "t": true, "o": {}}',
    b'{"a": NaN}', b'{"a": -Infinity}', b'{"a": 1e400}', b'{"s": "\\ud800"}',
    b'\xef\xbb\xbf{}', b'{"s": "\xed\xa0\x80"}', b"[" * 2000 + b"]" * 2000, b"{not json",
], ids=["numbers", "escapes", "nan", "infinity", "overflow", "lone-surrogate", "bom",
        "raw-surrogate", "deep", "broken"])
def test_a_large_document_reads_as_orjson_reads_it(doc):
    import orjson

    try:
        expected = orjson.loads(doc + PAD)
    except ValueError:
        with pytest.raises(ValueError):
            jsonio.loads(doc + PAD)
        return
    assert jsonio.loads(doc + PAD) == expected


@pytest.mark.parametrize("url", ["data:video/mp4;base64," + "QUJD" * (jsonio.LARGE_BYTES // 4),
                                 "data:x," + "é\"\\\n" * (jsonio.LARGE_BYTES // 4)],
                         ids=["plain", "escaped"])
def test_a_shared_part_with_a_large_string_is_written_as_orjson_writes_it(url):
    import orjson

    part = {"type": "video_url", "video_url": {"url": url, "detail": "é\"x"}, "uuid": "k"}
    body = {"messages": [{"role": "user", "content": [jsonio.Shared(part), "t"]}]}
    plain = {"messages": [{"role": "user", "content": [part, "t"]}]}
    assert jsonio.dumps(body) == orjson.dumps(plain)
