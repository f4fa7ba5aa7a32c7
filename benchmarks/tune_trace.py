"""benchmarks/tune.py --trace FILE: `epdctl tune --trace` against an exhaustive sweep that
replays the trace, and the same trace tuned as its average single shape.

    .venv/bin/python benchmarks/tune_trace.py FILE [--requests N] [--seed S]

writes the benchmark's mixed trace (MIX: text-only chats that decode long answers, one-image
questions, four-image albums that load the encoder; bursty arrivals, BURST_SHAPE) to FILE.

With --trace, benchmarks/tune.py runs each cost model as it does for one shape, except that:
the candidates are those `tune --trace` considers (memory for the trace's longest request);
the sweep replays the trace at speeds (one start per candidate: the trace's mean rate
TRACE_TOP first, then the ladder of mean rates, as the single-shape sweep does: its
`wanted`); `tune --trace FILE` is what is timed and scored; pick_ratio's one measure replays
the trace. Each row also has `avg_pick` (the pick of `tune` given the trace's average
single shape: its mean images, prompt and answer lengths) and `avg_ratio` (that pick's
goodput on the trace over the mix-tuned pick's, both measured again by one method,
alternating: what tuning for the mix gains). The summary line adds avg_ratio= (worst).
"""

from __future__ import annotations

import argparse
import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epdctl.traces.format import MediaItem, Trace, TraceRequest, write_trace
from epdctl.traces.mix import exact_counts

MIX = {"text": (0.4, 384, 128, 0), "image": (0.4, 64, 32, 1), "image4": (0.2, 32, 16, 4)}
"""class: (share, prompt text tokens, answer tokens, 512x512 images). A text chat skips the
encoder and decodes the longest; an album costs the encoder four images for a short
answer."""
IMAGE = (512, 512)
BURST_SHAPE = 0.25
"""Inter-arrival times are Gamma(k, 1/k) seconds (mean 1 s at speed 1): k = 0.25 gives a
coefficient of variation of 2 (Poisson: 1), requests in bursts with lulls between."""
REQUESTS = 120
TRACE_TOP = 512.0
"""The sweep's first point: the trace at a mean rate of 512 req/s, a burst of it all (a
replay's speed is finite: bench.replay), as the single-shape sweep sends all at once."""


def mixed_trace(requests: int = REQUESTS, seed: int = 0) -> Trace:
    """`requests` of MIX, in a seeded order, streamed, arriving in bursts (BURST_SHAPE)."""
    rng = random.Random(seed)
    names: list[str] = []
    for name, n in exact_counts({k: v[0] for k, v in MIX.items()}, requests).items():
        names += [name] * n
    rng.shuffle(names)
    at, out = 0.0, []
    for name in names:
        _, text, answer, images = MIX[name]
        media = (MediaItem("image", *IMAGE),) * images
        out.append(TraceRequest(round(at * 1000, 3), text, answer, media, stream=True))
        at += rng.gammavariate(BURST_SHAPE, 1 / BURST_SHAPE)
    return Trace(tuple(out), source="benchmarks/tune_trace.py", kind="mix")


def average_shape(trace: Trace) -> dict[str, int]:
    """The trace as one request shape: its mean images (rounded), prompt text and answer
    tokens (what a user who knows only the averages would give tune)."""
    n = len(trace.requests)
    return {"images": round(sum(r.count("image") for r in trace.requests) / n),
            "input_len": max(1, round(sum(r.input_length for r in trace.requests) / n)),
            "output_len": max(1, round(sum(r.output_length for r in trace.requests) / n))}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@dataclass
class TraceJob:
    """What the sweep, tune and the one measure of a run send, for a trace."""

    path: Path
    replay: Any
    """The workload confirmations replay (cli._tune_trace.replayed)."""
    rate: float
    """The trace's mean rate at speed 1 (what a rate's speed is reckoned from)."""
    kept: list[Any]
    """The candidates `tune --trace` considers."""

    def confirmer(self, state: Path, out: Path, progress: Any) -> Any:
        from epdctl.tune.live import LiveConfirmer

        return LiveConfirmer(self.replay, state, out, timeout_s=120, progress=progress,
                             trace_rate=self.rate)


def tune_args(path: Path) -> list[str]:
    """tune's workload options for the trace at `path` (its images of no size: IMAGE)."""
    return ["--trace", str(path), "--image-size", "x".join(map(str, IMAGE))]


def job(path: Path, base: Any, gpus: int, facts: Any, sizes: Any) -> TraceJob:
    """The trace at `path` as tune --trace takes it, on `base` with `gpus` devices: each
    speed played for TRACE_POINT_SECONDS at least, as tune confirms (the sweep in
    results/tune/*-mixed ran before that default, the trace once a speed, and is kept: its
    knees pick the sweep's best, which the one measure then confirms as tune does)."""
    from dataclasses import replace

    from epdctl.bench.tracefile import load_trace
    from epdctl.cli._tune_trace import TRACE_POINT_SECONDS, replayed
    from epdctl.traces.format import read_trace
    from epdctl.tune.candidates import candidates, limits_for, request_tokens
    from epdctl.tune.traced import for_trace

    profiled, traced = for_trace(read_trace(path), load_trace(path),
                                 replace(sizes, point_seconds=TRACE_POINT_SECONDS), facts)
    tokens = request_tokens(facts, profiled.images, profiled.image_size, profiled.input_len,
                            profiled.output_len)
    longest = max(a.request.prompt_tokens + a.request.output_tokens
                  for a in traced.model.arrivals)
    limits = limits_for(base, facts, 80 << 30, max(tokens, longest))
    kept, _ = candidates(base, list(range(gpus)), facts, limits)
    return TraceJob(path, replayed(profiled, traced), traced.model.rate, kept)


def average_args(path: Path, num_prompts: int, point_seconds: float) -> list[str]:
    """tune's workload options for the trace's average single shape."""
    from epdctl.traces.format import read_trace

    shape = average_shape(read_trace(path))
    return ["--images", str(shape["images"]), "--image-size", "x".join(map(str, IMAGE)),
            "--input-len", str(shape["input_len"]), "--output-len", str(shape["output_len"]),
            "--num-prompts", str(num_prompts), "--point-seconds", str(point_seconds)]


def main() -> None:
    parser = argparse.ArgumentParser(description="write the benchmark's mixed trace")
    parser.add_argument("file", type=Path)
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    trace = mixed_trace(args.requests, args.seed)
    write_trace(args.file, trace.requests)
    from epdctl.traces.classes import describe

    print(describe(trace.requests))


if __name__ == "__main__":
    main()
