"""What a request asks of a fake instance: its images' sizes, prompt and output tokens."""

from __future__ import annotations

import base64
import binascii
import struct
from dataclasses import dataclass, field
from typing import Any

from epdctl.sim.costmodel import ModelFacts

DEFAULT_PIXELS = 512 * 512
"""An image whose size cannot be read (a remote URL, embeddings): counted as 512x512."""
DEFAULT_OUTPUT_TOKENS = 16
_HEADER_CHARS = 65536  # base64 characters decoded to find an image's size


@dataclass(frozen=True)
class Work:
    mpixels: list[float] = field(default_factory=list)
    prompt_tokens: int = 1
    output_tokens: int = DEFAULT_OUTPUT_TOKENS


def image_pixels(url: str) -> int:
    """Width x height of a data: URL's PNG or JPEG; DEFAULT_PIXELS when it cannot tell."""
    head, _, data = url.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64"):
        return DEFAULT_PIXELS
    chunk = data[:_HEADER_CHARS]
    try:
        raw = base64.b64decode(chunk[: len(chunk) - len(chunk) % 4])
    except (binascii.Error, ValueError):
        return DEFAULT_PIXELS
    size = _png_size(raw) or _jpeg_size(raw)
    return size[0] * size[1] if size else DEFAULT_PIXELS


def _png_size(raw: bytes) -> tuple[int, int] | None:
    if raw[:8] != b"\x89PNG\r\n\x1a\n" or len(raw) < 24:
        return None
    width, height = struct.unpack(">II", raw[16:24])
    return width, height


def _jpeg_size(raw: bytes) -> tuple[int, int] | None:
    if raw[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 9 < len(raw):
        if raw[i] != 0xFF:
            i += 1
            continue
        marker = raw[i + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7 or marker == 0xFF:
            i += 1 if marker == 0xFF else 2
            continue
        length = struct.unpack(">H", raw[i + 2:i + 4])[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width = struct.unpack(">HH", raw[i + 5:i + 9])
            return width, height
        i += 2 + length
    return None


def _media_pixels(part: dict[str, Any]) -> int | None:
    """Pixels of one content part, None for a text part."""
    kind = part.get("type")
    if kind == "text":
        return None
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        return image_pixels(url) if isinstance(url, str) else DEFAULT_PIXELS
    return DEFAULT_PIXELS  # image_embeds, image_pil, other media: their size is not read


def _output_tokens(body: dict[str, Any]) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return DEFAULT_OUTPUT_TOKENS


def parse_work(body: dict[str, Any], chat: bool, facts: ModelFacts) -> Work:
    """The images, prompt tokens and output tokens of a chat or text completion body."""
    chars = 0
    pixels: list[int] = []
    prompt_ids = 0
    if chat:
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    if not isinstance(part, dict):
                        continue
                    media = _media_pixels(part)
                    if media is None:
                        chars += len(str(part.get("text") or ""))
                    else:
                        pixels.append(media)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            chars = len(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            prompt_ids = len(prompt)
        elif isinstance(prompt, list):
            chars = sum(len(str(p)) for p in prompt)
    mpixels = [p / 1e6 for p in pixels]
    tokens = prompt_ids + round(chars / facts.chars_per_token) + round(
        sum(mp * facts.image_tokens_per_mpixel for mp in mpixels))
    return Work(mpixels, max(tokens, 1), _output_tokens(body))
