"""Pure request shaping: validation, media extraction, stage payloads, the rewrite."""

from __future__ import annotations

import copy
import json

import pytest

from epdctl.proxy.errors import ProxyError
from epdctl.proxy.request.parse import (
    CHAT,
    COMPLETIONS,
    RESPONSES,
    find_media,
    is_stream,
    parse_body,
    request_id,
)
from epdctl.proxy.request.shape import (
    PREFILL_KV,
    decode_body,
    encoder_body,
    flat_metadata,
    prefill_body,
    rewrite_media,
    with_keys,
)

MODELS = ("tiny",)


def parse(body: object, route: str = CHAT) -> dict:
    return parse_body(json.dumps(body).encode(), route, MODELS)


def chat(*parts: dict, **extra: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": list(parts)}], **extra}


ALL_MEDIA = chat(
    {"type": "text", "text": "describe"},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}, "uuid": "v1"},
)


@pytest.mark.parametrize(("raw", "status", "needle"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": 3, "messages": []}', 400, "`model` must be a string"),
    (b'{"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}', 404, "gpt-4"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": "maybe"}', 400, "`stream`"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stream": 2}', 400, "`stream`"),
    (b'{"messages": []}', 400, "non-empty list"),
    (b'{"messages": ["hi"]}', 400, "messages[0] must be an object"),
    (b'{"messages": [{"role": "user", "content": 5}]}', 400, "content must be"),
    (b'{"messages": [{"role": "user", "content": [{"text": "x"}]}]}', 400, "string `type`"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}',
     400, "image_url.url must be a string"),
    (b'{"messages": [{"role": "user", "content": "x"}], "mm_processor_kwargs": [1]}', 400,
     "mm_processor_kwargs"),
    (b"\xff\xfe", 400, "not valid JSON"),
])
def test_parse_body_rejects_with_a_status_and_a_reason(raw, status, needle):
    with pytest.raises(ProxyError) as info:
        parse_body(raw, CHAT, MODELS)
    assert info.value.status == status
    assert needle in info.value.message
    error = json.loads(info.value.body())["error"]
    assert error["message"] == info.value.message
    assert (error["code"], error["type"]) == (
        status, {400: "BadRequestError", 404: "NotFoundError"}[status])  # vLLM's shape


@pytest.mark.parametrize(("value", "expected"), [
    (True, True), ("yes", True), ("On", True), ("1", True), (1, True), (1.0, True),
    (False, False), ("no", False), ("off", False), (0, False), (None, False)])
def test_stream_is_read_as_vllm_reads_it(value, expected):
    assert is_stream(parse({"stream": value, **chat()})) is expected


def test_responses_bodies_are_checked_where_the_proxy_reads_them():
    assert parse({"input": "hi"}, RESPONSES) == {"input": "hi"}
    image = {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "uuid": "u"}
    assert parse({"input": [{"role": "user", "content": [image]}]}, RESPONSES)
    for bad in (None, [], ["x"], [{"content": 3}], [{"content": [{"text": "x"}]}],
                [{"content": [{**image, "image_url": {"url": "u"}}]}],
                [{"content": [{**image, "uuid": 5}]}]):
        with pytest.raises(ProxyError, match="input"):
            parse({"input": bad}, RESPONSES)


def test_completions_need_a_prompt_and_model_may_be_omitted():
    assert parse({"prompt": "hi"}, COMPLETIONS) == {"prompt": "hi"}
    with pytest.raises(ProxyError):
        parse({"model": "tiny"}, COMPLETIONS)


def test_find_media_covers_every_media_type_in_order():
    items = find_media(parse(ALL_MEDIA))
    assert [(i.part_type, i.modality, i.part) for i in items] == [
        ("image_url", "image", 1), ("audio_url", "audio", 2), ("input_audio", "audio", 3),
        ("video_url", "video", 4)]
    assert items[2].ref == "UklGRg=="
    assert items[3].uuid == "v1"
    assert [i.uuid for i in items[:3]] == [None, None, None]


def test_text_only_and_string_content_have_no_media():
    assert find_media(parse(chat({"type": "text", "text": "x"}))) == []
    assert find_media(parse({"messages": [{"role": "user", "content": "x"}]})) == []


def test_encoder_body_is_one_item_with_its_uuid_and_cache_key_kwargs():
    body = parse(chat(*ALL_MEDIA["messages"][0]["content"], max_tokens=9,
                      mm_processor_kwargs={"fps": 2}, media_io_kwargs={"video": {"n": 1}}))
    item = find_media(body)[0]
    item.uuid = "k0"
    out = encoder_body(body, item)
    assert out == {"model": "tiny", "stream": False, "mm_processor_kwargs": {"fps": 2},
                   "media_io_kwargs": {"video": {"n": 1}},
                   "messages": [{"role": "user", "content": [
                       {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"},
                        "uuid": "k0"}]}]}


def test_with_keys_copies_and_never_mutates_the_client_body():
    body = parse(ALL_MEDIA)
    before = copy.deepcopy(body)
    items = find_media(body)
    items[0].uuid, items[1].uuid = "k0", "k1"
    items[1].data_url = "data:audio/wav;base64,UklGRg=="
    out = with_keys(body, items)
    assert body == before
    parts = out["messages"][0]["content"]
    assert parts[1]["uuid"] == "k0"
    assert parts[2] == {"type": "audio_url", "audio_url": {"url": items[1].data_url},
                        "uuid": "k1"}
    assert parts[0] is body["messages"][0]["content"][0]  # untouched parts are shared


def test_prefill_and_decode_bodies():
    body = parse(chat({"type": "text", "text": "x"}, stream=True, max_tokens=50, min_tokens=5,
                      stream_options={"include_usage": True}))
    p = prefill_body(body, CHAT)
    assert p["kv_transfer_params"] == PREFILL_KV
    assert (p["stream"], p["max_tokens"], p["max_completion_tokens"]) == (False, 1, 1)
    assert "stream_options" not in p and "min_tokens" not in p
    assert body["stream"] is True and "kv_transfer_params" not in body
    assert "max_completion_tokens" not in prefill_body({"prompt": "x"}, COMPLETIONS)
    p = prefill_body({"input": "x", "stream": True, "max_output_tokens": 9}, RESPONSES)
    assert p == {"input": "x", "stream": False, "max_output_tokens": 1, "store": False,
                 "kv_transfer_params": PREFILL_KV}
    kv = {"remote_block_ids": [1], "do_remote_prefill": True}
    assert decode_body(body, kv) == {**body, "kv_transfer_params": kv}
    assert decode_body(body, None) is body


def _items(body: dict, uuids: list[str]) -> list:
    items = find_media(body)
    for item, key in zip(items, uuids, strict=True):
        item.uuid = key
    return items


IMG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
AUD = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}}


def test_rewrite_replaces_media_by_embeds_metadata_with_e_reported_key():
    body = parse(chat({"type": "text", "text": "x"}, IMG, IMG))
    items = _items(body, ["a", "b"])
    reported = {"a": ("A", {"image_grid_thw": [1, 4, 4]}),
                "b": ("B", {"image_grid_thw": [[1, 2, 2]]})}
    out = rewrite_media(body, items, reported)
    assert out is not None
    assert out["messages"][0]["content"][1:] == [
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": "A"},
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": "B"},
    ]
    assert body["messages"][0]["content"][1] == IMG


def test_rewrite_is_all_or_none_per_modality():
    body = parse(chat(IMG, IMG, AUD))
    items = _items(body, ["a", "b", "c"])
    reported = {"a": ("a", {"image_grid_thw": [1, 4, 4]}), "b": ("b", {}),
                "c": ("c", {"audio_num_tokens": 7})}
    out = rewrite_media(body, items, reported)
    assert out is not None
    parts = out["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url", "image_url", "audio_embeds"]
    assert parts[0]["uuid"] == "a"  # raw media still carries its key
    assert rewrite_media(body, items, {"a": ("a", {}), "b": ("b", {}), "c": ("c", {})}) is None


def test_rewrite_drops_mm_kwargs_and_needs_every_item_when_they_are_present():
    body = parse(chat(IMG, AUD, mm_processor_kwargs={"x": 1}, media_io_kwargs={"image": {}}))
    items = _items(body, ["a", "c"])
    full = {"a": ("ha", {"image_grid_thw": [1, 4, 4]}), "c": ("hc", {"audio_num_tokens": 7})}
    out = rewrite_media(body, items, full)
    assert out is not None and "mm_processor_kwargs" not in out and "media_io_kwargs" not in out
    assert body["mm_processor_kwargs"] == {"x": 1}
    assert rewrite_media(body, items, {**full, "c": ("hc", {})}) is None


def test_flat_metadata_flattens_nested_lists_only():
    assert flat_metadata({"g": [[1, 4, 4]], "n": 7, "t": [0.5, 1.0]}) == {
        "g": [1, 4, 4], "n": 7, "t": [0.5, 1.0]}


def test_request_id_keeps_a_sane_client_id_and_makes_one_otherwise():
    assert request_id("abc-1") == "abc-1"
    assert len(request_id(None)) == 16  # as wide as vLLM's random_uuid()
    assert request_id("x" * 500) != "x" * 500
    assert request_id("bad\nid") != "bad\nid"
