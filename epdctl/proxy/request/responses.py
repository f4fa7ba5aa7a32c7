"""The Responses API (`POST /v1/responses`): its media parts, E's view of them, PD's body.

vLLM 0.32 reads `input_text` and `input_image` parts (an `image_url` string, a `uuid` kept);
it has no parser for `input_file`, so such parts go to PD untouched and PD answers for them.
Its Responses schema takes no `*_embeds` parts, so there is no metadata rewrite here: PD
gets each image with its key and loads E's encoding from the store.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from epdctl.proxy.request.parse import MM_KWARGS, RESPONSES_MEDIA_PART, MediaItem
from epdctl.proxy.request.shape import with_ec_params


def find_media(body: dict[str, Any]) -> list[MediaItem]:
    """Every `input_image` with an `image_url` in a (checked) body, in order."""
    items: list[MediaItem] = []
    inputs = body.get("input")
    if not isinstance(inputs, list):
        return items
    for i, item in enumerate(inputs):
        content = item.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part["type"] == RESPONSES_MEDIA_PART and isinstance(part.get("image_url"), str):
                items.append(MediaItem(i, j, RESPONSES_MEDIA_PART, "image", part["image_url"],
                                       part.get("uuid") or None))
    return items


def encoder_view(body: dict[str, Any], items: list[MediaItem]
                 ) -> tuple[dict[str, Any], list[MediaItem]]:
    """A chat body holding the (keyed) items as `image_url` parts, and items pointing into it:
    E is sent what it is sent for chat, so its key is the one PD computes for the input."""
    parts = [{"type": "image_url", "image_url": {"url": it.ref}} for it in items]
    view: dict[str, Any] = {"messages": [{"role": "user", "content": parts}]}
    for key in ("model", *MM_KWARGS):
        if body.get(key) is not None:
            view[key] = body[key]
    moved = [dataclasses.replace(it, msg=0, part=n, part_type="image_url")
             for n, it in enumerate(items)]
    return view, moved


def pd_body(body: dict[str, Any], items: list[MediaItem], params: dict[str, Any]
            ) -> dict[str, Any]:
    """A copy of body whose images carry their keys (and the fetched bytes), plus E's
    transfer params; the client's body is not touched."""
    inputs = list(body["input"])
    for it in items:
        if it.uuid is None:
            continue
        if inputs[it.msg] is body["input"][it.msg]:
            inputs[it.msg] = {**inputs[it.msg], "content": list(inputs[it.msg]["content"])}
        part = {**inputs[it.msg]["content"][it.part], "uuid": it.uuid}
        if it.data_url is not None:
            part["image_url"] = it.data_url
        inputs[it.msg]["content"][it.part] = part
    return with_ec_params({**body, "input": inputs}, params)


def needs_prefill(body: dict[str, Any]) -> bool:
    """False for what only the final instance can run: a continuation of a response it
    stored (P never saw it), or a background response (answered before it is generated)."""
    return not body.get("previous_response_id") and not body.get("background")
