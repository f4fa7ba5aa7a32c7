"""Content-derived cache keys for media items.

Choice for remote URLs: the proxy fetches an http(s) URL once (with a timeout and a size
cap), hashes the bytes, and sends those bytes on to E and PD as a data URL. Hashing the URL
string, as vLLM's example proxy does, would serve stale embeddings when the content behind
a URL changes; fetching once also means E and PD cannot see two different versions of it.
An unreachable URL is the client's problem: 400. Other schemes (file:, ...) get no key
and skip E; PD handles (or rejects) them itself.

Client-supplied `uuid`s: vLLM uses a part's `uuid` as the item's mm_hash, which keys E's
store entry, PD's encoder and processor caches and its prefix cache. So no raw client uuid
goes on to E or PD: `scope_client_uuids` rewrites every one in the body, before anything
else reads it, into `client_key(uuid, modality)`, a key of its own space (content keys are bare hex;
client keys start with `client-`), so a client uuid only ever matches the same client uuid
and can never alias another client's content-keyed item. With `--no-client-uuids` they
are dropped instead, and every item is keyed by its content.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
from typing import Any

from epdctl.proxy.errors import ProxyError, UpstreamError, bad_request
from epdctl.proxy.request.parse import MEDIA_TYPES, MediaItem
from epdctl.proxy.request.shape import replace_parts
from epdctl.proxy.transport import Upstream

B64_PIECE_CHARS = 1 << 20
"""base64 decoded per hash update (a multiple of 4): what hashing a large item costs."""
CLIENT_PREFIX = "client-"
"""Starts every key made from a client uuid; never in a content key (lower-case hex)."""


def content_key(modality: str, data: bytes) -> str:
    """sha256 over modality and bytes: same bytes, same key, on every instance."""
    digest = _digest(modality)
    digest.update(data)
    return digest.hexdigest()


def _digest(modality: str) -> Any:
    """The content key's hash, fed the modality so far: the bytes follow."""
    return hashlib.sha256(modality.encode() + b"\0")


def client_key(uuid: str, modality: str = "image") -> str:
    """The key of a client-supplied uuid on an item of `modality`: same uuid and modality,
    same key; never equal to a content key, nor to the same uuid on another modality's item
    (a video and an image under one uuid are two entries, as their content keys are)."""
    material = b"epdctl client uuid\0" + modality.encode() + b"\0" + uuid.encode()
    return CLIENT_PREFIX + hashlib.sha256(material).hexdigest()


def part_modality(part_type: str) -> str:
    """The modality a content part's `uuid` keys: `video_url` and `video_embeds` -> video,
    `audio_url`, `input_audio` and `audio_embeds` -> audio; image for every other type."""
    if part_type in MEDIA_TYPES:
        return MEDIA_TYPES[part_type]
    kind = part_type.removesuffix("_embeds")
    return kind if kind in ("video", "audio") else "image"


def scope_client_uuids(body: dict[str, Any], is_honoured: bool, *,
                       field: str = "messages") -> tuple[dict[str, Any], int]:
    """The body with every content part's `uuid` made a client key (or dropped), and how many.

    Every part of `field` (chat's `messages`, Responses' `input`), not only the media the
    proxy keys: vLLM reads a `uuid` on any part carrying media or embeddings. An empty uuid
    counts as none and is dropped. body is not touched.
    """
    parts: dict[tuple[int, int], dict[str, Any]] = {}
    messages = body.get(field)
    for i, msg in enumerate(messages if isinstance(messages, list) else ()):
        content = msg.get("content") if isinstance(msg, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or "uuid" not in part or part["uuid"] is None:
                continue
            new = {k: v for k, v in part.items() if k != "uuid"}
            uuid = str(part["uuid"])  # as vLLM reads it
            if uuid and is_honoured:
                new["uuid"] = client_key(uuid, part_modality(str(part.get("type"))))
            parts[(i, j)] = new
    if not parts:
        return body, 0
    counted = sum(1 for new in parts.values() if "uuid" in new)
    return replace_parts(body, parts, field=field), counted


def b64decode(text: str, what: str) -> bytes:
    """Strict base64 (whitespace tolerated); a 400 for anything else."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{what} is not valid base64") from None


def data_url_bytes(url: str, what: str) -> bytes:
    """The decoded payload of a `data:<mime>;base64,<data>` URL (the bytes data_url_key
    hashes; verify.py's reference, the proxy hashes without decoding it whole).

    vLLM's `video/jpeg` form is a list of base64 frames joined by commas: its bytes are each
    frame's, length-prefixed (so no two frame lists give the same bytes)."""
    head, sep, data = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise bad_request(f"{what}: only base64 data URLs are supported")
    if head[5:].lower() == "video/jpeg;base64" and "," in data:
        frames = [b64decode(frame, what) for frame in data.split(",")]
        payload = b"".join(len(f).to_bytes(8, "big") + f for f in frames)
        if not all(frames):
            raise bad_request(f"{what} has an empty frame")
        return payload
    payload = b64decode(data, what)
    if not payload:
        raise bad_request(f"{what} is empty")
    return payload


def data_url_key(modality: str, url: str, what: str) -> str:
    """content_key of data_url_bytes(url), piece by piece: the payload is never copied out
    of the URL nor decoded whole (a video of tens of MiB costs one piece, not a copy)."""
    comma = url.find(",")
    head = url[:comma] if comma >= 0 else url
    if comma < 0 or not head.endswith(";base64"):
        raise bad_request(f"{what}: only base64 data URLs are supported")
    start = comma + 1
    if head[5:].lower() == "video/jpeg;base64" and url.find(",", start) >= 0:
        digest = _digest(modality)
        while start <= len(url):
            end = url.find(",", start)
            end = len(url) if end < 0 else end
            frame = b64decode(url[start:end], what)  # one frame at a time
            if not frame:
                raise bad_request(f"{what} has an empty frame")
            digest.update(len(frame).to_bytes(8, "big"))
            digest.update(frame)
            start = end + 1
        return str(digest.hexdigest())
    return b64_key(modality, url, what, start)


def b64_key(modality: str, text: str, what: str, start: int = 0) -> str:
    """content_key of the base64 text[start:] (strict; whitespace tolerated), decoded a
    piece at a time; a 400 if it is not base64 or is empty."""
    digest = _digest(modality)
    try:
        size = _feed(digest, text, start)
    except (binascii.Error, ValueError):
        # Wrapped base64 (MIME-style lines) is rare: strip it and hash from the start.
        digest = _digest(modality)
        try:
            size = _feed(digest, "".join(text[start:].split()), 0)
        except (binascii.Error, ValueError):
            raise bad_request(f"{what} is not valid base64") from None
    if not size:
        raise bad_request(f"{what} is empty")
    return str(digest.hexdigest())


def _feed(digest: Any, text: str, start: int) -> int:
    """Decode text[start:] as strict base64 into digest in B64_PIECE_CHARS pieces; the bytes.

    Pieces are whole 4-character groups, so decoding them one by one is decoding the whole,
    but for padding, which only the last may have (binascii checks the rest). binascii reads
    an ASCII str in place, so a piece is the only copy."""
    size = 0
    for pos in range(start, len(text), B64_PIECE_CHARS):
        piece = text[pos:pos + B64_PIECE_CHARS]
        if pos + B64_PIECE_CHARS < len(text) and piece.endswith("="):
            raise binascii.Error("padding before the end")
        data = binascii.a2b_base64(piece, strict_mode=True)
        digest.update(data)
        size += len(data)
    return size


async def assign_uuids(items: list[MediaItem], client: Upstream, timeout_s: float,
                       max_bytes: int) -> int:
    """Give every item without a (scoped) client uuid a key from its content bytes, in
    place; how many got one.

    A remote URL is fetched once per request however many items name it (and each item of it
    shares the one data URL); an inline item is hashed once per request however many items
    carry it. The fetched media together may not exceed `max_bytes` (the proxy's body cap):
    past it, the proxy's own 400 (MediaTooLarge), since E and PD would get them inlined.
    """
    remote: dict[tuple[str, str], list[MediaItem]] = {}
    inline: dict[tuple[str, str, bool], str] = {}  # one hash per distinct inline item
    count = 0
    for n, item in enumerate(items):
        if item.uuid is not None:
            continue
        is_audio_data = item.part_type == "input_audio"
        if is_audio_data or item.ref.startswith("data:"):
            seen = (item.modality, item.ref, is_audio_data)
            if seen not in inline:
                what = f"{item.part_type} #{n}"
                inline[seen] = b64_key(item.modality, item.ref, what) if is_audio_data \
                    else data_url_key(item.modality, item.ref, what)
            item.uuid = inline[seen]
        elif item.ref.startswith(("http://", "https://")):
            remote.setdefault((item.modality, item.ref), []).append(item)
        else:
            continue
        count += 1
    if remote:
        sizes = await asyncio.gather(*(_fetch(same, client, timeout_s, max_bytes)
                                       for same in remote.values()))
        if sum(sizes) > max_bytes:
            raise MediaTooLarge(f"the {len(remote)} media URLs fetched together are "
                            f"{sum(sizes)} bytes", max_bytes)
    return count


class MediaTooLarge(ProxyError):
    """Fetched media past the proxy's cap: a 400 the proxy answers itself (PD would fetch the
    same bytes again), naming the cap and the flag that sets it."""

    def __init__(self, what: str, max_bytes: int) -> None:
        super().__init__(400, f"{what}: more than the proxy's limit of {max_bytes} bytes "
                         "(--max-body-bytes)")


async def _fetch(same: list[MediaItem], client: Upstream, timeout_s: float,
                 max_bytes: int) -> int:
    """Fetch one URL for every item naming it; the bytes fetched."""
    item = same[0]
    what = f"{item.part_type} {item.ref}"
    try:
        status, mime, data = await client.fetch(item.ref, timeout_s, max_bytes)
    except UpstreamError as exc:
        if exc.kind == "too large":
            raise MediaTooLarge(what, max_bytes) from None
        raise bad_request(f"{what}: could not fetch it: {exc.detail}") from None
    if status != 200 or not data:
        raise bad_request(f"{what}: fetching it gave HTTP {status}")
    mime = mime.split(";", 1)[0].strip() or "application/octet-stream"
    size = len(data)
    uuid = content_key(item.modality, data)
    # Inlined for E and PD: the fetched bytes go as soon as they are base64, which goes as
    # soon as it is text (at most the bytes and two encodings of them at once).
    encoded = binascii.b2a_base64(data, newline=False)
    del data
    text = encoded.decode("ascii")
    del encoded
    data_url = f"data:{mime};base64," + text
    del text
    for it in same:
        it.uuid, it.data_url = uuid, data_url
    return size
