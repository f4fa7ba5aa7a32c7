"""`--mix text:0.4,image:0.4,image4:0.15,video:0.05`: a synthetic trace of the workload's
sizes in these proportions, for users who know their mix but have no recording."""

from __future__ import annotations

import random
from dataclasses import dataclass

from epdctl.traces.classes import parse_class
from epdctl.traces.format import MediaItem, Trace, TraceError, TraceRequest


@dataclass(frozen=True)
class Sizes:
    """What each synthetic request's parts measure (the workload's options)."""

    input_len: int = 128
    output_len: int = 64
    image_size: tuple[int, int] = (512, 512)
    video_frames: int = 4
    audio_seconds: float = 2.0


def parse_mix(text: str) -> dict[str, float]:
    """`text:0.4,image:0.6` -> {class: share}, the shares scaled to add up to 1. TraceError in
    one line for a bad entry, an unknown class, a repeated one, or a share not above 0."""
    mix: dict[str, float] = {}
    for entry in (e.strip() for e in text.split(",")):
        name, colon, share = entry.partition(":")
        try:
            value = float(share) if colon else float("nan")
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise TraceError(f"--mix: expected CLASS:SHARE entries with shares above 0 "
                             f"(text:0.4,image:0.6), got {entry!r}")
        parse_class(name)
        if name.strip() in mix:
            raise TraceError(f"--mix: {name.strip()!r} is given twice")
        mix[name.strip()] = value
    total = sum(mix.values())
    return {name: share / total for name, share in mix.items()}


def exact_counts(mix: dict[str, float], requests: int) -> dict[str, int]:
    """`requests` split by the shares, rounded so that they add up (largest remainders)."""
    raw = {name: share * requests for name, share in mix.items()}
    out = {name: int(value) for name, value in raw.items()}
    left = requests - sum(out.values())
    for name in sorted(raw, key=lambda n: (out[n] - raw[n], n))[:left]:
        out[name] += 1
    return out


def synthetic(mix: dict[str, float], requests: int, rate: float, sizes: Sizes,
              seed: int = 0, stream: bool = False) -> Trace:
    """`requests` requests in the mix's proportions, in a seeded random order, arriving as a
    Poisson process of `rate` per second (0 or inf: all at once)."""
    if requests < 1:
        raise TraceError("a synthetic trace needs at least one request")
    rng = random.Random(seed)
    names: list[str] = []
    for name, n in exact_counts(mix, requests).items():
        names += [name] * n
    rng.shuffle(names)
    at, out = 0.0, []
    for name in names:
        out.append(TraceRequest(round(at * 1000, 3), sizes.input_len, sizes.output_len,
                                _media(name, sizes), stream))
        if 0 < rate < float("inf"):
            at += rng.expovariate(rate)
    label = ",".join(f"{n}:{s:.3g}" for n, s in mix.items())
    return Trace(tuple(out), source=f"--mix {label}", kind="mix")


def _media(name: str, sizes: Sizes) -> tuple[MediaItem, ...]:
    width, height = sizes.image_size
    made: list[MediaItem] = []
    for kind, n in parse_class(name).items():
        item = {"image": MediaItem("image", width, height),
                "video": MediaItem("video", width, height, sizes.video_frames),
                "audio": MediaItem("audio", seconds=sizes.audio_seconds)}[kind]
        made += [item] * n
    return tuple(made)


