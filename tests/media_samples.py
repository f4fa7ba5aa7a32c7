"""Deterministic videos and audio clips for tests, and chat parts carrying them.

Videos are MP4 (OpenCV's `mp4v`, which vLLM's default OpenCV video loader decodes): a few
frames of coloured blocks, so each seed gives another video and another greedy answer.
Clips are 16 kHz mono WAV: a tone whose pitch and length follow the seed, plus noise.
"""

from __future__ import annotations

import base64
import io
import os
import tempfile
import wave
from collections.abc import Mapping, Sequence
from typing import Any

from tests.harness import image_data_url, make_image

Part = dict[str, Any]


def make_video(seed: int, frames: int = 4, size: int = 56) -> bytes:
    """An MP4 of `frames` frames of `size` px blocks; different seeds differ."""
    import cv2
    import numpy as np

    rng = np.random.default_rng(seed)
    fd, path = tempfile.mkstemp(suffix=".mp4", prefix="epdctl-test-video-")
    os.close(fd)
    try:
        fourcc = cv2.VideoWriter_fourcc(*"mp4v")  # type: ignore[attr-defined]
        writer = cv2.VideoWriter(path, fourcc, 2, (size, size))
        for _ in range(frames):
            blocks = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
            tile = np.ones((size // 4, size // 4, 1), dtype=np.uint8)
            writer.write(np.kron(blocks, tile))
        writer.release()
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def make_wav(seed: int, rate: int = 16000) -> bytes:
    """A 16-bit mono WAV: a tone of 200 + 150*seed Hz for 0.5 + (seed % 4) / 4 s."""
    import numpy as np

    rng = np.random.default_rng(seed)
    seconds = 0.5 + (seed % 4) / 4
    t = np.arange(int(rate * seconds)) / rate
    wave_ = 0.6 * np.sin(2 * np.pi * (200 + 150 * seed) * t) + 0.05 * rng.standard_normal(len(t))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.clip(wave_, -1, 1) * 32000).astype("<i2").tobytes())
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def video_part(data: bytes, uuid: str | None = None) -> Part:
    part: Part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + b64(data)}}
    return {**part, "uuid": uuid} if uuid is not None else part


def image_part(seed: int) -> Part:
    return {"type": "image_url", "image_url": {"url": image_data_url(make_image(seed))}}


def audio_url_part(data: bytes) -> Part:
    return {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + b64(data)}}


def input_audio_part(data: bytes) -> Part:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": "wav"}}


def chat_parts(base_url: str, model: str, parts: Sequence[Part], *, stream: bool = False,
               text: str = "What is this?", max_tokens: int = 12,
               extra_body: Mapping[str, object] | None = None, timeout_s: float = 180) -> str:
    """One chat completion at temperature 0 with these parts and the text; its text."""
    from openai import OpenAI

    url = base_url.rstrip("/")
    url = url if url.endswith("/v1") else url + "/v1"
    messages: Any = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    with OpenAI(base_url=url, api_key="EMPTY", timeout=timeout_s, max_retries=0) as client:
        kwargs: Any = {"model": model, "messages": messages, "temperature": 0.0,
                       "max_tokens": max_tokens, "extra_body": dict(extra_body or {})}
        if not stream:
            return client.chat.completions.create(**kwargs).choices[0].message.content or ""
        pieces = []
        with client.chat.completions.create(**kwargs, stream=True) as chunks:
            for chunk in chunks:
                pieces += [c.delta.content for c in chunk.choices if c.delta.content]
        return "".join(pieces)
