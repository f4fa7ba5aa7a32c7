"""`verify`'s fixed prompts (`bench` sends them too): their generated media, the chat body
each becomes, and one POST of it."""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_TOKENS = 16


VIDEO_FRAMES = 4
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Prompt:
    """One request of the fixed set: text, the seeds of its generated images (videos, audio
    clips), streamed or not."""

    name: str
    text: str
    images: tuple[int, ...] = ()
    is_streamed: bool = False
    videos: tuple[int, ...] = ()
    audios: tuple[int, ...] = ()

    @property
    def modalities(self) -> set[str]:
        return {m for m, seeds in (("image", self.images), ("video", self.videos),
                                   ("audio", self.audios)) if seeds}


PROMPTS: tuple[Prompt, ...] = (
    Prompt("text only", "Write one sentence about the sea."),
    Prompt("one image", "What is in the image?", (1,)),
    Prompt("two images", "What differs between these two images?", (2, 3)),
    Prompt("same image twice", "Are these two images the same?", (4, 4)),
    # The first image again: E has saved it, so P/PD's load must be a hit. A new question
    # each time, or P could reuse the first prompt's KV (the CPU ExampleConnector's files
    # ignore the cache salt) and never ask for the image.
    Prompt("repeated image", "Describe the image in a few words.", (1,)),
    Prompt("repeated image, streamed", "Which colours does the image show?", (1,),
           is_streamed=True),
    # For a model that takes videos (e.g. Qwen2-VL) or audio (e.g. Qwen2-Audio).
    Prompt("one video", "What happens in the video?", videos=(1,)),
    Prompt("an image and a video", "Does the image appear in the video?", (5,), videos=(2,)),
    Prompt("repeated video, streamed", "Describe the video in a few words.", videos=(1,),
           is_streamed=True),
    Prompt("one audio clip", "What is in the audio?", audios=(1,)),
    Prompt("two audio clips", "Which clip is higher?", audios=(2, 3)),
    Prompt("repeated audio clip, streamed", "Describe the sound.", audios=(1,),
           is_streamed=True),
)


def prompts_for(modalities: set[str]) -> tuple[Prompt, ...]:
    """The fixed prompts whose media are all of these modalities (text only: always)."""
    return tuple(p for p in PROMPTS if p.modalities <= modalities)


def taken_modalities(args: Sequence[str]) -> set[str]:
    """The modalities an engine's `--limit-mm-per-prompt` lets in (a limit above 0); images
    alone without the flag (or with one in a form not read here)."""
    from epdctl.topology.model import flag_value

    value = flag_value(args, "--limit-mm-per-prompt")
    try:
        limits = json.loads(value) if value else None
    except ValueError:
        limits = None
    if not isinstance(limits, dict):
        return {"image"}
    return {m for m, n in limits.items() if m in ("image", "video", "audio")
            and (not isinstance(n, int) or n > 0)}


@dataclass(frozen=True)
class ChatAnswer:
    """What one server said (or why it said nothing), and how long it took."""

    text: str | None
    latency_s: float
    error: str | None = None


def png(seed: int, size: int = 56) -> bytes:
    """A small deterministic RGB gradient PNG (stdlib only); each seed gives another image."""
    rows = bytearray()
    for y in range(size):
        rows.append(0)  # filter type 0 for each scanline
        for x in range(size):
            rows += bytes(((x * 7 + seed * 53) % 256, (y * 5 + seed * 31) % 256,
                           (x * y + seed * 97) % 256))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(bytes(rows))) + chunk(b"IEND", b""))


def chat_body(prompt: Prompt, model: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """The chat completion request for a prompt, at temperature 0, with a fresh cache salt."""
    import base64
    import uuid

    content: str | list[dict[str, Any]] = prompt.text
    if prompt.modalities:
        content = [
            {"type": "image_url",
             "image_url": {"url": "data:image/png;base64," + base64.b64encode(png(s)).decode()}}
            for s in prompt.images
        ]
        content += [{"type": "video_url", "video_url": {"url": video_url(s)}}
                    for s in prompt.videos]
        content += [{"type": "input_audio",
                     "input_audio": {"data": base64.b64encode(wav(s)).decode(), "format": "wav"}}
                    for s in prompt.audios]
        content.append({"type": "text", "text": prompt.text})
    # A salt of its own per request keeps vLLM's prefix cache out of it: a repeated prompt
    # would otherwise be answered from P/PD's KV cache without asking the EC store.
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens, "temperature": 0.0,
                            "cache_salt": f"epdctl-verify-{uuid.uuid4().hex}"}
    if prompt.is_streamed:
        body["stream"] = True
    return body


def video_url(seed: int, frames: int = VIDEO_FRAMES) -> str:
    """A video as vLLM's `video/jpeg` data URL takes it: base64 frames joined by commas (PNG
    frames: vLLM opens each with PIL, whatever the declared type)."""
    import base64

    return "data:video/jpeg;base64," + ",".join(
        base64.b64encode(png(seed * 100 + n)).decode() for n in range(frames))


def wav(seed: int, rate: int = 16000) -> bytes:
    """A 16-bit mono WAV (stdlib only): a tone whose pitch and length follow the seed."""
    import math

    count = rate * (2 + seed % 3) // 4
    pitch = 220.0 * (1 + seed)
    return wav_bytes(struct.pack(f"<{count}h", *(
        int(20000 * math.sin(2 * math.pi * pitch * n / rate)) for n in range(count))), rate)


def wav_bytes(samples: bytes, rate: int) -> bytes:
    """16-bit mono PCM `samples` as a WAV file (stdlib only)."""
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples)
    return buf.getvalue()


def media_keys(prompt: Prompt) -> set[str]:
    """The EC store keys the proxy gives this prompt's media (content hashes)."""
    from epdctl.proxy.request.media import content_key, data_url_bytes

    return ({content_key("image", png(seed)) for seed in prompt.images}
            | {content_key("video", data_url_bytes(video_url(seed), "video"))
               for seed in prompt.videos}
            | {content_key("audio", wav(seed)) for seed in prompt.audios})


Send = Callable[[str, dict[str, Any], Mapping[str, str]], ChatAnswer]


def send_chat(base_url: str, body: dict[str, Any], headers: Mapping[str, str]) -> ChatAnswer:
    """POST /v1/chat/completions; the answer's text (joined deltas when streamed)."""
    import httpx

    start = time.perf_counter()
    url = f"{base_url.rstrip('/')}/v1/chat/completions"
    try:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            if not body.get("stream"):
                reply = client.post(url, json=body, headers=dict(headers))
                if reply.status_code != 200:
                    return ChatAnswer(None, time.perf_counter() - start, _http_error(reply))
                text = reply.json()["choices"][0]["message"]["content"] or ""
                return ChatAnswer(text, time.perf_counter() - start)
            with client.stream("POST", url, json=body, headers=dict(headers)) as reply:
                if reply.status_code != 200:
                    reply.read()
                    return ChatAnswer(None, time.perf_counter() - start, _http_error(reply))
                text = "".join(_deltas(reply.iter_lines()))
            return ChatAnswer(text, time.perf_counter() - start)
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        return ChatAnswer(None, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")


def _http_error(reply: Any) -> str:
    return f"HTTP {reply.status_code}: {reply.text[:300]}"


def _deltas(lines: Any) -> Any:
    for line in lines:
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        for choice in json.loads(line[5:])["choices"]:
            yield (choice.get("delta") or {}).get("content") or ""
