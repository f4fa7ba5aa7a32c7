"""The chat request a trace line becomes when it is replayed (pure but for the media it
generates): a prompt of `input_length` words (one word is about one token), the line's media
generated at its sizes, `max_tokens` its output_length with EOS ignored, temperature 0,
streamed as the line says.

Media: images are PNGs (bench's generator); videos are what vLLM's `video/jpeg` data URL
takes, base64 PNG frames joined by commas (as `verify`'s videos are; no codec needed); audio
clips are WAVs (bench.audio). Every item has a seed of its own and pixels of its own: no two
requests share an image (a trace does not say which would), or vLLM's encoder cache and the
EC store would serve one from another.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from typing import Any

from epdctl.bench.audio import AUDIO_SECONDS, wav
from epdctl.bench.images import png
from epdctl.bench.workload import WORDS
from epdctl.traces.format import MediaItem, TraceRequest

REQUEST_SEEDS = 1_000_003
"""Requests one seed can replay before its requests' seeds meet the next seed's."""
ITEM_SEEDS = 2**16
"""Seeds per request, one per image or video frame: no item's meets another request's."""


@dataclass(frozen=True)
class Defaults:
    """Sizes for what a trace line leaves out (bench's workload options)."""

    image_size: tuple[int, int] = (512, 512)
    video_frames: int = 4
    audio_seconds: float = AUDIO_SECONDS


def request_seed(seed: int, index: int) -> int:
    """Request `index`'s seed in a replay of seed `seed`."""
    return seed * REQUEST_SEEDS + index


def body(request: TraceRequest, seed: int, model: str,
         defaults: Defaults = Defaults()) -> dict[str, Any]:
    """The chat completion of one trace line; `seed` is the request's own."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(request.input_length))
    parts: list[dict[str, Any]] = []
    item_seed = seed * ITEM_SEEDS
    for item in request.media:
        parts.append(part(item, item_seed, defaults))
        item_seed += (item.frames or defaults.video_frames) if item.type == "video" else 1
    content: str | list[dict[str, Any]] = [*parts, {"type": "text", "text": text}] \
        if parts else text
    out: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}],
                           "max_tokens": request.output_length, "ignore_eos": True,
                           "temperature": 0.0}
    if request.stream:  # usage in the last chunk: output tokens as the server counts them
        out |= {"stream": True, "stream_options": {"include_usage": True}}
    return out


def part(item: MediaItem, seed: int, defaults: Defaults = Defaults()) -> dict[str, Any]:
    """One media item as a content part."""
    width, height = (item.width, item.height) if item.width and item.height \
        else defaults.image_size
    if item.type == "image":
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                   + _b64(_png(width, height, seed))}}
    if item.type == "video":
        frames = item.frames or defaults.video_frames
        url = "data:video/jpeg;base64," + ",".join(
            _b64(_png(width, height, seed + n)) for n in range(frames))
        return {"type": "video_url", "video_url": {"url": url}}
    seconds = item.seconds if item.seconds is not None else defaults.audio_seconds
    return {"type": "input_audio", "input_audio": {"data": _b64(wav(seconds, seed)),
                                                   "format": "wav"}}


def _png(width: int, height: int, seed: int) -> bytes:
    # The seed in the first pixels (six of them): distinct seeds, distinct pixels.
    return png(width, height, seed, tag=(seed % 2**128).to_bytes(16, "big"))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
