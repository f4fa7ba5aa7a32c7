"""The body each stage gets, shaped from the client's: E's (one item), PD's (media keyed,
or rewritten to E's metadata, with E's transfer params), P's and D's, a Mooncake push's, and
the headers of every sub-request. Pure, over plain dicts."""

from __future__ import annotations

from typing import Any

from epdctl.proxy import jsonio
from epdctl.proxy.request.parse import CHAT, MM_KWARGS, RESPONSES, MediaItem, header_id

PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


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
