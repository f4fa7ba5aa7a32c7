"""Pure request shaping over plain dicts: media items, stage payloads, request ids."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from epdctl.proxy import jsonio
from epdctl.proxy.errors import ProxyError, bad_request

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
RESPONSES_MEDIA_PART = "input_image"
"""The Responses API's image part."""
ORCHESTRATED = (CHAT, COMPLETIONS, RESPONSES)
"""The POST routes the proxy runs through E and P/D; every other route passes through."""
CONTENT_FIELDS = {CHAT: "messages", RESPONSES: "input"}
"""Where a route's content parts (media, and the client's `uuid` on them) are."""
MEDIA_TYPES = {"image_url": "image", "audio_url": "audio", "input_audio": "audio",
               "video_url": "video"}
# Per-request kwargs that vLLM folds into the cache key (contracts §5.5).
MM_KWARGS = ("mm_processor_kwargs", "media_io_kwargs")
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass
class MediaItem:
    """One media part of a chat request, where it sits and the key E and PD will use."""

    msg: int
    part: int
    part_type: str
    modality: str
    ref: str
    """The data URL, http(s) URL, other URL, or input_audio's base64 data."""
    uuid: str | None
    """Client-supplied, or filled in by media.assign_uuids from the content bytes."""
    data_url: str | None = None
    """Set when the proxy fetched a remote URL: the bytes it hashed, sent on instead."""
    keyed: tuple[dict[str, Any], tuple[str | None, str | None], jsonio.Shared] | None = field(
        default=None, init=False, repr=False, compare=False)
    """The part as E and PD get it (_media_part), built once: serialized once for both."""


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def request_id(headers_value: str | None) -> str:
    """The client's x-request-id, or a fresh one as wide as vLLM's own (16 hex digits)."""
    if headers_value and len(headers_value) <= 200 and headers_value.isprintable():
        return headers_value
    return os.urandom(8).hex()


def lax_bool(value: object, name: str) -> bool | None:
    """A boolean field read as vLLM's pydantic models read it: `"yes"`, `1`, `"off"`, ..."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise bad_request(f"`{name}` must be a boolean", name)


def is_stream(body: dict[str, Any]) -> bool:
    """Whether a (checked) body asks for a stream."""
    return bool(lax_bool(body.get("stream"), "stream"))


_ID_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


def header_id(rid: str) -> str:
    """`rid` as an x-request-id header value: as it is when ASCII, else percent-encoded
    (UTF-8). A body's request_id may be any printable text (CJK, emoji) and vLLM takes it,
    but a header is bytes: encoded as it came, it fails the client or turns to mojibake."""
    return rid if rid.isascii() else quote(rid, safe=_ID_SAFE)


def upstream_headers(child_id: str, *, is_main: bool = False) -> dict[str, str]:
    """Headers of a sub-request; identity encoding, because the proxy relays raw bytes.

    x-request-id names the sub-request in vLLM (it takes precedence over the body's
    request_id). The request that gives the client its answer (`is_main`) goes without one
    when its id is not ASCII: vLLM then names the answer by the body's request_id, as it
    does without the proxy."""
    headers = {"content-type": "application/json", "accept-encoding": "identity"}
    if not is_main or child_id.isascii():
        headers["x-request-id"] = header_id(child_id)
    return headers


def parse_body(raw: bytes, route: str, models: tuple[str, ...]) -> dict[str, Any]:
    """Decode and check the fields the proxy relies on; vLLM checks the rest.

    A body refused here is not answered by the proxy: it goes to PD (or D) as it came, so
    the client gets vLLM's own refusal (or, if vLLM takes it, vLLM's answer).
    """
    try:
        body = jsonio.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise bad_request("`model` must be a string", "model")
        if model not in models:
            raise ProxyError(404, f"The model `{model}` does not exist. Valid aliases: "
                             f"{', '.join(models)}.", param="model")
    lax_bool(body.get("stream"), "stream")
    for key in (*MM_KWARGS, "stream_options", "kv_transfer_params", "ec_transfer_params"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise bad_request(f"`{key}` must be an object", key)
    if route == CHAT:
        _check_messages(body.get("messages"))
    elif route == RESPONSES:
        _check_input(body.get("input"))
    elif not isinstance(body.get("prompt"), str | list):
        raise bad_request("`prompt` must be a string or a list", "prompt")
    return body


def _check_input(value: object) -> None:
    """`input`: a string, or a list of items whose media parts the proxy can read."""
    if isinstance(value, str):
        return
    if not isinstance(value, list) or not value:
        raise bad_request("`input` must be a string or a non-empty list", "input")
    for where, part in checked_parts(value, "input"):
        if part["type"] != RESPONSES_MEDIA_PART:
            continue
        for key in ("image_url", "uuid"):
            if part.get(key) is not None and not isinstance(part[key], str):
                raise bad_request(f"{where}.{key} must be a string", "input")


def checked_parts(items: list[Any], name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each content part of a `messages` or `input` list, checked to be an object with a
    string `type`, with where it is (for the error about it); 400 for a malformed item."""
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"{name}[{i}] must be an object", name)
        content = item.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise bad_request(f"{name}[{i}].content must be a string or a list", name)
        for j, part in enumerate(content):
            where = f"{name}[{i}].content[{j}]"
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(f"{where} must be an object with a string `type`", name)
            yield where, part


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list", "messages")
    for where, part in checked_parts(messages, "messages"):
        kind = part["type"]
        if kind not in MEDIA_TYPES:
            continue
        payload = part.get(kind)
        field = "data" if kind == "input_audio" else "url"
        if not isinstance(payload, dict) or not isinstance(payload.get(field), str):
            raise bad_request(f"{where}.{kind}.{field} must be a string", "messages")
        if part.get("uuid") is not None and not isinstance(part["uuid"], str):
            raise bad_request(f"{where}.uuid must be a string", "messages")


def find_media(body: dict[str, Any]) -> list[MediaItem]:
    """Every media part in a (checked) chat body, in order."""
    items: list[MediaItem] = []
    for i, msg in enumerate(body.get("messages") or ()):
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part["type"]
            modality = MEDIA_TYPES.get(kind)
            if modality is None:
                continue
            ref = part[kind]["data" if kind == "input_audio" else "url"]
            items.append(MediaItem(i, j, kind, modality, ref, part.get("uuid") or None))
    return items


def _media_part(part: dict[str, Any], item: MediaItem) -> dict[str, Any]:
    """A copy of a media part carrying the item's uuid (and fetched bytes, if any); one
    copy per item, however many bodies carry it (jsonio.Shared: serialized once)."""
    made_for = (item.uuid, item.data_url)
    if item.keyed is not None and item.keyed[0] is part and item.keyed[1] == made_for:
        return item.keyed[2]
    new = jsonio.Shared(part)
    if item.data_url is not None:
        new[item.part_type] = {**part[item.part_type], "url": item.data_url}
    if item.uuid is not None:
        new["uuid"] = item.uuid
    item.keyed = (part, made_for, new)
    return new


def replace_parts(body: dict[str, Any], parts: dict[tuple[int, int], dict[str, Any]],
                  drop: tuple[str, ...] = (), *, field: str = "messages") -> dict[str, Any]:
    """A copy of body with the given (message, part) slots of `field` (chat's `messages`,
    Responses' `input`) replaced; body is not touched."""
    messages = list(body[field])
    for (i, j), new in parts.items():
        if messages[i] is body[field][i]:
            messages[i] = {**messages[i], "content": list(messages[i]["content"])}
        messages[i]["content"][j] = new
    out = {k: v for k, v in body.items() if k not in drop}
    out[field] = messages
    return out


def with_keys(body: dict[str, Any], items: list[MediaItem]) -> dict[str, Any]:
    """The client's body with each media part carrying its key: what PD gets as raw media."""
    parts = {(it.msg, it.part): _media_part(body["messages"][it.msg]["content"][it.part], it)
             for it in items if it.uuid is not None}
    return replace_parts(body, parts) if parts else body


def encoder_body(body: dict[str, Any], item: MediaItem) -> dict[str, Any]:
    """One item alone, non-streaming, with the kwargs that change its cache key."""
    part = _media_part(body["messages"][item.msg]["content"][item.part], item)
    out: dict[str, Any] = {"messages": [{"role": "user", "content": [part]}], "stream": False}
    if body.get("model") is not None:
        out["model"] = body["model"]
    for key in MM_KWARGS:
        if body.get(key) is not None:
            out[key] = body[key]
    return out


def push_body(request: dict[str, Any], consumer_zmq: str, transfer_id: str) -> dict[str, Any]:
    """E's one-item body for Mooncake: push the encoding to this consumer under this id.

    vLLM's producer matches `ec_items` to the request's items by position; the key is left
    out because the engine may fold mm kwargs into it (mooncake/scheduler.py).
    """
    params = {"consumer_zmq": consumer_zmq, "ec_items": [{"transfer_id": transfer_id}]}
    return {**request, "ec_transfer_params": params}


def flat_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """One flat list per field: PD rejects the nested `[[1, 4, 4]]` form."""
    out = {}
    for key, value in metadata.items():
        if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            value = [x for v in value for x in v]
        out[key] = value
    return out


def rewrite_media(
    body: dict[str, Any], items: list[MediaItem], reported: dict[str, tuple[str, dict]]
) -> dict[str, Any] | None:
    """Replace media by `*_embeds` metadata parts where E reported metadata; None if none.

    `reported` maps an item's uuid to (E's key, its metadata). A modality is rewritten only
    when every one of its items has metadata: vLLM rejects a request mixing raw and embeds
    parts of one modality. With per-request mm kwargs, all items or none, because the kwargs
    are dropped from a rewritten request (they would re-hash E's key into another one).
    """
    ready: dict[str, bool] = {}
    for it in items:
        ok = it.uuid is not None and bool(reported.get(it.uuid, ("", {}))[1])
        ready[it.modality] = ready.get(it.modality, True) and ok
    has_kwargs = any(body.get(k) for k in MM_KWARGS)
    if not any(ready.values()) or (has_kwargs and not all(ready.values())):
        return None
    parts = {}
    for it in items:
        if not ready[it.modality]:
            parts[(it.msg, it.part)] = _media_part(
                body["messages"][it.msg]["content"][it.part], it)
            continue
        key, metadata = reported[it.uuid]  # type: ignore[index]
        kind = f"{it.modality}_embeds"
        parts[(it.msg, it.part)] = {"type": kind, kind: flat_metadata(metadata), "uuid": key}
    return replace_parts(body, parts, drop=MM_KWARGS)


def with_ec_params(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """E's ec_transfer_params merged into the PD body, for connectors that locate data by it."""
    if not params:
        return body
    return {**body, "ec_transfer_params": {**(body.get("ec_transfer_params") or {}), **params}}


def pd_body(body: dict[str, Any], items: list[MediaItem], reported: dict[str, Any],
            params: dict[str, Any], should_rewrite: bool) -> tuple[dict[str, Any], bool]:
    """The one PD (or P) body builder, for both EC protocols: media replaced by E's
    `*_embeds` metadata where possible (should_rewrite), else the media with their keys; E's
    transfer params attached. Returns the body and whether it was rewritten."""
    if should_rewrite:
        rewritten = rewrite_media(body, items, reported)
        if rewritten is not None:
            return with_ec_params(rewritten, params), True
    return with_ec_params(with_keys(body, items), params), False


def prefill_body(body: dict[str, Any], route: str) -> dict[str, Any]:
    """P's copy: one token, no streaming, asking P to keep the KV for a remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(kv_transfer_params=dict(PREFILL_KV), stream=False)
    if route == RESPONSES:
        out.update(max_output_tokens=1, store=False)  # D's answer is the one to keep
    else:
        out["max_tokens"] = 1
    if route == CHAT:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], kv_params: object) -> dict[str, Any]:
    """D's copy: P's returned kv_transfer_params, so D pulls the KV instead of prefilling."""
    if not isinstance(kv_params, dict) or not kv_params:
        return body
    return {**body, "kv_transfer_params": kv_params}


def dumps(body: dict[str, Any]) -> bytes:
    return jsonio.dumps(body)
