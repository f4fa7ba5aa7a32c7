"""Talking to a running server: test images, chat messages, chat completions at temperature 0
through the official openai client."""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openai import OpenAI
    from openai.types.chat import ChatCompletion


def make_image(seed: int, size: int | tuple[int, int] = 56) -> bytes:
    """A deterministic PNG: coloured blocks and noise from `seed`; different seeds differ."""
    import numpy as np
    from PIL import Image

    width, height = (size, size) if isinstance(size, int) else size
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    pixels = np.kron(blocks, np.ones((height // 4 + 1, width // 4 + 1, 1), dtype=np.uint8))
    pixels = pixels[:height, :width]
    noise = rng.integers(-24, 25, size=pixels.shape)
    pixels = np.clip(pixels.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def image_data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def chat_messages(text: str, image_urls: Sequence[str] = ()) -> list[dict]:
    """One user message: the images first, then the text (OpenAI content parts)."""
    if not image_urls:
        return [{"role": "user", "content": text}]
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def _client(base_url: str, api_key: str, timeout_s: float) -> OpenAI:
    from openai import OpenAI

    if not base_url.rstrip("/").endswith("/v1"):
        base_url = base_url.rstrip("/") + "/v1"
    return OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)


def chat_completion(
    base_url: str,
    model: str,
    *,
    image_urls: Sequence[str] = (),
    text: str = "What is in the image?",
    max_tokens: int = 16,
    api_key: str = "EMPTY",
    timeout_s: float = 120.0,
    extra_body: Mapping[str, object] | None = None,
) -> ChatCompletion:
    """One non-streaming chat completion at temperature 0; the whole response (usage too)."""
    with _client(base_url, api_key, timeout_s) as client:
        return client.chat.completions.create(
            model=model, messages=chat_messages(text, image_urls), temperature=0.0,
            max_tokens=max_tokens, extra_body=dict(extra_body or {}),
        )


def chat(
    base_url: str,
    model: str,
    *,
    image_urls: Sequence[str] = (),
    text: str = "What is in the image?",
    stream: bool = False,
    max_tokens: int = 16,
    api_key: str = "EMPTY",
    timeout_s: float = 120.0,
    extra_body: Mapping[str, object] | None = None,
) -> str:
    """One chat completion at temperature 0 through the official openai client; its text."""
    if not stream:
        response = chat_completion(
            base_url, model, image_urls=image_urls, text=text, max_tokens=max_tokens,
            api_key=api_key, timeout_s=timeout_s, extra_body=extra_body,
        )
        return response.choices[0].message.content or ""
    pieces = []
    with _client(base_url, api_key, timeout_s) as client:
        chunks = client.chat.completions.create(
            model=model, messages=chat_messages(text, image_urls), temperature=0.0,
            max_tokens=max_tokens, extra_body=dict(extra_body or {}), stream=True,
        )
        with chunks:
            for chunk in chunks:
                for choice in chunk.choices:
                    if choice.delta.content:
                        pieces.append(choice.delta.content)
    return "".join(pieces)
