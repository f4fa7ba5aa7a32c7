"""The audio workload's requests: generated WAV clips and vLLM's custom_audio dataset."""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path

from epdctl.bench.workload import WORDS, Workload

AUDIO_SECONDS = 1.0
AUDIO_RATE = 16000


def wav(seconds: float, seed: int, rate: int = AUDIO_RATE) -> bytes:
    """A deterministic 16-bit mono WAV: a tone with noise; every seed gives other bytes."""
    from epdctl.verifier.prompts import wav_bytes

    rng = random.Random(seed)
    pitch, count = rng.uniform(110.0, 880.0), int(seconds * rate)
    return wav_bytes(struct.pack(f"<{count}h", *(
        int(12000 * math.sin(2 * math.pi * pitch * n / rate) + rng.randint(-2000, 2000))
        for n in range(count))), rate)


def write_audio_dataset(workload: Workload, seed: int, count: int, path: Path
                        ) -> dict[str, int]:
    """vLLM's custom_audio JSON lines at `path`: `count` requests, each a prompt of about
    input_len words and its own clip (a WAV file beside it, as custom_audio reads files)."""
    rng = random.Random(seed)
    clips = path.with_suffix("")
    clips.mkdir(parents=True, exist_ok=True)
    lines = []
    for request in range(count):
        clip = clips / f"{request}.wav"
        clip.write_bytes(wav(AUDIO_SECONDS, seed * 1_000_003 + request))
        words = " ".join(rng.choice(WORDS) for _ in range(workload.input_len))
        lines.append(json.dumps({"prompt": f"{request}: {words}", "audio": str(clip)}))
    path.write_text("\n".join(lines) + "\n")
    return {"requests": count, "audios": count}
