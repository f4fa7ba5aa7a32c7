"""/v1/responses shaping: its images found, E's chat view of them, PD's keyed copy."""

from __future__ import annotations

import copy

from epdctl.proxy.request.responses import encoder_view, find_media, needs_prefill, pd_body
from epdctl.proxy.request.shape import encoder_body

URL = "data:image/png;base64,AAAA"


def body(*parts: dict, **extra: object) -> dict:
    return {"model": "tiny", "input": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "what?"}, *parts]}],
        **extra}


def image(url: str = URL, **extra: object) -> dict:
    return {"type": "input_image", "image_url": url, "detail": "auto", **extra}


def test_find_media_takes_input_images_with_a_url_in_order():
    b = body(image(), {"type": "input_file", "file_data": URL}, image("https://x/y.png", uuid="u"),
             {"type": "input_image", "file_id": "file-1"})
    items = find_media(b)
    assert [(i.msg, i.part, i.ref, i.uuid) for i in items] == [
        (1, 1, URL, None), (1, 3, "https://x/y.png", "u")]
    assert all(i.modality == "image" for i in items)
    assert find_media({"input": "just text"}) == []


def test_the_encoder_gets_the_chat_request_it_gets_for_chat():
    b = body(image(), mm_processor_kwargs={"a": 1}, media_io_kwargs={"image": {"b": 2}},
             instructions="ignored by E")
    items = find_media(b)
    items[0].uuid = "k0"
    items[0].data_url = "data:image/png;base64,BBBB"
    view, moved = encoder_view(b, items)
    assert encoder_body(view, moved[0]) == {
        "model": "tiny", "stream": False, "mm_processor_kwargs": {"a": 1},
        "media_io_kwargs": {"image": {"b": 2}}, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"},
             "uuid": "k0"}]}]}


def test_pd_body_keys_the_images_and_never_touches_the_client_body():
    b = body(image(), image("https://x/y.png"))
    before = copy.deepcopy(b)
    items = find_media(b)
    items[0].uuid, items[1].uuid = "k0", "k1"
    items[1].data_url = "data:image/png;base64,CCCC"
    out = pd_body(b, items, {"k0": {"handle": 1}})
    assert b == before
    parts = out["input"][1]["content"]
    assert parts[1] == {**image(), "uuid": "k0"}
    assert parts[2] == {**image("data:image/png;base64,CCCC"), "uuid": "k1"}
    assert parts[0] is b["input"][1]["content"][0] and out["input"][0] is b["input"][0]
    assert out["ec_transfer_params"] == {"k0": {"handle": 1}}


def test_continuations_and_background_responses_skip_prefill():
    assert needs_prefill(body())
    assert not needs_prefill(body(previous_response_id="resp_1"))
    assert not needs_prefill(body(background=True))
