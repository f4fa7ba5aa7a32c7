"""What a request is, read from what the client sent: its route, id and stream flag, its
body checked as vLLM would (the model, the messages' and input's shape), its media items.
Pure, over plain dicts; the bodies each stage gets are shape.py's."""

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
    for at, part in checked_parts(value, "input"):
        if part["type"] != RESPONSES_MEDIA_PART:
            continue
        for key in ("image_url", "uuid"):
            if part.get(key) is not None and not isinstance(part[key], str):
                raise bad_request(f"{where('input', at)}.{key} must be a string", "input")


def checked_parts(items: list[Any], name: str
                  ) -> Iterator[tuple[tuple[int, int], dict[str, Any]]]:
    """Each content part of a `messages` or `input` list, checked to be an object with a
    string `type`, with where it is (`where` names it, for the error about it); 400 for a
    malformed item."""
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"{name}[{i}] must be an object", name)
        content = item.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise bad_request(f"{name}[{i}].content must be a string or a list", name)
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(f"{where(name, (i, j))} must be an object with a string "
                                  "`type`", name)
            yield (i, j), part


def where(name: str, at: tuple[int, int]) -> str:
    """A content part's place in a request, for an error: `messages[1].content[0]`."""
    return f"{name}[{at[0]}].content[{at[1]}]"


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list", "messages")
    for at, part in checked_parts(messages, "messages"):
        kind = part["type"]
        if kind not in MEDIA_TYPES:
            continue
        payload = part.get(kind)
        field = "data" if kind == "input_audio" else "url"
        if not isinstance(payload, dict) or not isinstance(payload.get(field), str):
            raise bad_request(f"{where('messages', at)}.{kind}.{field} must be a string",
                              "messages")
        if part.get("uuid") is not None and not isinstance(part["uuid"], str):
            raise bad_request(f"{where('messages', at)}.uuid must be a string", "messages")


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
