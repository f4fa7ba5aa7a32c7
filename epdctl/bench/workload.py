"""The workload: load points, the `vllm bench serve` argv of each, its result JSON (pure, but
for the dataset `--repeat` writes)."""

from __future__ import annotations

import base64
import json
import math
import random
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from epdctl.bench.arms import Arm, image_limit, max_model_len
from epdctl.bench.images import png
from epdctl.bench.tracefile import TraceFile
from epdctl.errors import BenchError
from epdctl.traces.mix import exact_counts

# Replaces the `vllm bench serve` argv prefix (tests: a stand-in that writes a result).
BENCH_COMMAND_ENV = "EPDCTL_BENCH_COMMAND"
SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = "50,90,99"
# Figure -> the key `vllm bench serve --save-result` writes it under.
RESULT_KEYS = {
    "completed": "completed", "failed": "failed", "duration_s": "duration",
    "request_throughput": "request_throughput", "output_throughput": "output_throughput",
    "request_goodput": "request_goodput",
    "ttft_p50_ms": "p50_ttft_ms", "ttft_p90_ms": "p90_ttft_ms", "ttft_p99_ms": "p99_ttft_ms",
    "tpot_mean_ms": "mean_tpot_ms", "tpot_p90_ms": "p90_tpot_ms", "itl_p99_ms": "p99_itl_ms",
    "e2el_p90_ms": "p90_e2el_ms",
}
WORDS = ("image", "describe", "colour", "shape", "light", "corner", "edge", "left", "right",
         "top", "bottom", "what", "which", "many", "small", "large", "show", "near", "far")


@dataclass(frozen=True)
class LoadPoint:
    """One load level: requests per second (inf: all at once) and a concurrency cap."""

    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int | None = None
    """Its requests' seed in place of the workload's seed plus its index (tune: a rate's
    own, so that every candidate meets the same arrivals at the same rate)."""
    speed: float | None = None
    """A trace's point: its arrival times divided by this (`--speed`)."""

    @property
    def label(self) -> str:
        if self.speed is not None:
            return f"speed {self.speed:g}x"
        parts = [] if math.isinf(self.request_rate) else [f"{self.request_rate:g} req/s"]
        if self.max_concurrency is not None:
            parts.append(f"concurrency {self.max_concurrency}")
        return ", ".join(parts) or "all at once"

    def as_json(self) -> dict[str, Any]:
        rate = "inf" if math.isinf(self.request_rate) else self.request_rate
        out = {"label": self.label, "request_rate": rate,
               "max_concurrency": self.max_concurrency}
        if self.speed is not None:
            out["speed"] = self.speed
        return out if self.seed is None else {**out, "seed": self.seed}


@dataclass(frozen=True)
class Workload:
    """What every arm is sent: the same requests in the same order, per load point."""

    points: tuple[LoadPoint, ...]
    num_prompts: int = 100
    point_seconds: float = 0.0
    """A request-rate point sends at least rate x point_seconds requests (0: num_prompts at
    every load): at a high rate num_prompts alone arrive in a moment, a burst that queues
    absorb within the SLO however little the topology sustains."""
    seed: int = 0
    images: int = 1
    """Images per request (random-mm and the generated dataset)."""
    image_size: tuple[int, int] = (512, 512)
    """Width and height in pixels."""
    input_len: int = 128
    output_len: int = 64
    videos: int = 0
    """Videos per request (random-mm: MP4s of `video_frames` frames of image_size)."""
    video_frames: int = 4
    audios: int = 0
    """Audio clips per request (0 or 1: vLLM's custom_audio dataset sends one, nothing else
    with it); generated WAVs (bench/audio.py)."""
    repeat: float = 0.0
    """Fraction of image items that repeat an earlier request's image (generated dataset)."""
    dataset: Path | None = None
    dataset_name: str = "custom_image"
    slo: tuple[tuple[str, float], ...] = ()
    """(metric, milliseconds) pairs for vLLM's goodput."""
    trace: TraceFile | None = None
    """`--trace`: replayed at each point's speed (epdctl.bench.replay)."""
    mix: tuple[tuple[str, float], ...] = ()
    """`--mix`: (shape class, share) of a synthetic trace per point, of the sizes above."""

    @property
    def kind(self) -> str:
        """random-mm, generated (for --repeat), audio (generated clips), dataset (the
        user's file), trace (--trace) or mix (--mix)."""
        if self.trace is not None:
            return "trace"
        if self.mix:
            return "mix"
        if self.dataset is not None:
            return "dataset"
        if self.audios:
            return "audio"
        return "generated" if self.repeat > 0 else "random-mm"

    def requests_at(self, index: int) -> int:
        """Requests load point `index` sends: num_prompts (a trace's: its requests), or its
        rate x point_seconds when more, a trace cycled (format.cycled) up to its --limit."""
        if (trace := self.trace) is not None:
            wanted = math.ceil(trace.rate * (self.points[index].speed or 1.0)
                               * self.point_seconds)
            return max(trace.requests, min(wanted, trace.limit))
        rate = self.points[index].request_rate
        if not self.point_seconds or math.isinf(rate):
            return self.num_prompts
        return max(self.num_prompts, math.ceil(rate * self.point_seconds))

    def seed_at(self, index: int, round_: int = 0) -> int:
        """Each load point (and each round of it) its own requests, or later points would
        meet earlier points' prefix and encoder caches; every arm gets the same ones. A
        point's own seed (LoadPoint.seed) stands for the workload's seed plus its index."""
        own = self.points[index].seed
        start = self.seed + index if own is None else own
        return start + round_ * len(self.points)

    def warmup_seed(self) -> int:
        """The warm-up's requests: none of any round's (up to a million rounds); vLLM takes
        seeds from 0 to 2**32 - 1."""
        return (self.seed + 1_000_000 * len(self.points)) % 2**32

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind, "num_prompts": self.num_prompts,
            "point_seconds": self.point_seconds, "seed": self.seed,
            "images": self.images, "image_size": list(self.image_size),
            "input_len": self.input_len, "output_len": self.output_len,
            "videos": self.videos, "video_frames": self.video_frames,
            "audios": self.audios, "repeat": self.repeat,
            "dataset": str(self.dataset) if self.dataset else None,
            "dataset_name": self.dataset_name if self.dataset else None,
            "slo_ms": dict(self.slo),
            "points": [{**p.as_json(), "requests": self.requests_at(i)}
                       for i, p in enumerate(self.points)]}
        if self.trace is not None or self.mix:
            out |= {"trace": self.trace.as_json()} if self.trace else {"mix": dict(self.mix)}
            for index, point in enumerate(out["points"]):
                point["classes"] = self.class_counts(index)
        return out

    def class_counts(self, index: int = 0) -> dict[str, int]:
        """A trace's (or a mix's) requests per shape class at load point `index`."""
        if self.trace is not None:
            return dict(self.trace.classes)
        return exact_counts(dict(self.mix), self.requests_at(index)) if self.mix else {}


def parse_list(text: str | None, what: str, kind: type) -> list[Any]:
    """`1,2,inf` -> numbers > 0 (`inf` only for rates)."""
    if text is None:
        return []
    values = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = kind(part)
        except ValueError:
            value = None
        if value is None or not value > 0 or (kind is int and math.isinf(value)):
            raise BenchError(f"{what}: expected a comma-separated list of numbers above 0, "
                             f"got {text!r}")
        values.append(value)
    return values


def load_points(rates: Sequence[float], concurrencies: Sequence[int]) -> tuple[LoadPoint, ...]:
    """The sweep: over the list with more than one value; the other one is fixed."""
    if len(rates) > 1 and len(concurrencies) > 1:
        raise BenchError("sweep one of --request-rate and --max-concurrency; give the other "
                         "one value")
    if not rates and not concurrencies:
        concurrencies = [1, 4, 16]
    if len(rates) > 1 or not concurrencies:
        cap = concurrencies[0] if concurrencies else None
        return tuple(LoadPoint(r, cap) for r in rates)
    rate = rates[0] if rates else math.inf
    return tuple(LoadPoint(rate, c) for c in concurrencies)


def parse_slo(text: str | None) -> tuple[tuple[str, float], ...]:
    """`ttft=500,tpot=50ms` or `e2el=2s` -> ((metric, ms), ...)."""
    if not text:
        return ()
    slo = []
    for part in text.split(","):
        key, _, value = part.strip().partition("=")
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|s)?", value.strip())
        if key not in SLO_METRICS or not match or float(match[1]) <= 0:
            raise BenchError(f"--slo: expected METRIC=TIME pairs (metrics {', '.join(SLO_METRICS)}"
                             f"; 500 or 500ms or 0.5s), got {part.strip()!r}")
        slo.append((key, float(match[1]) * (1000.0 if match[2] == "s" else 1.0)))
    return tuple(slo)


def parse_image_size(text: str) -> tuple[int, int]:
    """`512` or `640x480` (width x height) -> (width, height)."""
    match = re.fullmatch(r"(\d+)(?:x(\d+))?", text.strip())
    if not match or int(match[1]) < 1 or (match[2] and int(match[2]) < 1):
        raise BenchError(f"--image-size: expected PIXELS or WIDTHxHEIGHT, got {text!r}")
    return int(match[1]), int(match[2] or match[1])


def check(arms: Sequence[Arm], workload: Workload) -> None:
    """Refuse a workload an arm cannot serve, before anything starts."""
    if workload.audios and workload.kind == "audio" and (workload.images or workload.videos):
        raise BenchError("--audios sends one clip and text per request (vLLM's custom_audio "
                         "dataset): give no --images or --videos with it")
    if workload.audios > 1:
        raise BenchError(f"--audios {workload.audios}: vLLM's custom_audio dataset sends one "
                         "clip per request")
    images = workload.images if workload.kind != "dataset" else dataset_images(workload)
    for arm in arms:
        limit = image_limit(arm.topology)
        if images is not None and limit is not None and images > limit:
            raise BenchError(f"the workload sends {images} image(s) per request; `{arm.name}` "
                             f"accepts at most {limit} (--limit-mm-per-prompt)")
        clips = image_limit(arm.topology, "audio")
        if workload.audios and clips is not None and workload.audios > clips:
            raise BenchError(f"the workload sends {workload.audios} audio clip(s) per request; "
                             f"`{arm.name}` accepts at most {clips} (--limit-mm-per-prompt)")
        videos = image_limit(arm.topology, "video")
        if workload.videos and videos is not None and workload.videos > videos:
            raise BenchError(f"the workload sends {workload.videos} video(s) per request; "
                             f"`{arm.name}` accepts at most {videos} (--limit-mm-per-prompt)")
        length = max_model_len(arm.topology)
        need = workload.input_len + workload.output_len
        if workload.kind != "dataset" and length is not None and need > length:
            raise BenchError(f"--input-len {workload.input_len} + --output-len "
                             f"{workload.output_len} is more than `{arm.name}`'s "
                             f"--max-model-len {length}")


def dataset_images(workload: Workload) -> int | None:
    """The most images one request of a custom_image JSONL file has (None: not one)."""
    path = workload.dataset
    if path is None or workload.dataset_name != "custom_image" or path.suffix != ".jsonl":
        return None
    most = 0
    try:
        for line in path.read_text().splitlines():
            if line.strip():
                item = json.loads(line)
                parts = item.get("content") or []
                count = len(item.get("image_files") or []) + sum(
                    1 for p in parts if isinstance(p, dict) and p.get("type") != "text")
                most = max(most, count)
    except (OSError, ValueError, AttributeError) as exc:
        raise BenchError(f"--dataset {path}: cannot read it as JSON lines: {exc}") from None
    return most


def bench_command(arm: Arm, environ: dict[str, str] | None = None) -> list[str]:
    """`vllm bench serve` of the arm's engine (the CPU build's wrapper on `device: cpu`)."""
    import os
    import shlex

    override = (environ if environ is not None else os.environ).get(BENCH_COMMAND_ENV)
    if override:
        return shlex.split(override)
    command = arm.topology.engine.command
    if command and command[-1] == "serve":
        return [*command[:-1], "bench", "serve"]
    if arm.topology.device == "cpu":
        return [sys.executable, "-m", "epdctl.engines.vllm_cpu", "bench", "serve"]
    return ["vllm", "bench", "serve"]


def argv(command: Sequence[str], workload: Workload, index: int, *, url: str, model: str,
         served_model_name: str, result_dir: Path, result_name: str,
         dataset: Path | None = None, round_: int = 0, warmup: int = 0) -> list[str]:
    """The `vllm bench serve` command line of load point `index` (round `round_`) against one
    arm; `warmup` > 0: that many warm-up requests at the point's load, seeds of their own."""
    point = workload.points[index]
    rate = "inf" if math.isinf(point.request_rate) else f"{point.request_rate:g}"
    count, seed = (warmup, workload.warmup_seed()) if warmup else (
        workload.requests_at(index), workload.seed_at(index, round_))
    args = [*command, "--backend", "openai-chat", "--base-url", url,
            "--endpoint", "/v1/chat/completions", "--model", model,
            "--served-model-name", served_model_name,
            "--num-prompts", str(count), "--seed", str(seed), "--request-rate", rate]
    if point.max_concurrency is not None:
        args += ["--max-concurrency", str(point.max_concurrency)]
    if warmup and workload.kind == "audio":
        args += _dataset_args(workload, dataset)  # the runner's warm-up clips
    elif warmup and workload.kind == "generated":  # random images of the same size instead
        args += _dataset_args(replace(workload, repeat=0.0), None)
    else:
        args += _dataset_args(workload, dataset)
    args += ["--ignore-eos", "--temperature", "0",
             "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", PERCENTILES,
             "--save-result", "--save-detailed", "--result-dir", str(result_dir),
             "--result-filename", result_name,
             "--disable-tqdm"]
    if workload.slo:
        args += ["--goodput", *(f"{k}:{v:g}" for k, v in workload.slo)]
    return args


def _dataset_args(workload: Workload, dataset: Path | None) -> list[str]:
    items = workload.images + workload.videos
    if workload.kind == "random-mm" and items == 0:
        return ["--dataset-name", "random", "--random-input-len", str(workload.input_len),
                "--random-output-len", str(workload.output_len)]
    if workload.kind == "random-mm":
        width, height = workload.image_size
        # A bucket is (height, width, frames): 1 frame is an image, more a video; the
        # per-modality limit makes the counts exact (vLLM moves on from a full modality).
        buckets = {1: workload.images / items, workload.video_frames: workload.videos / items}
        config = ", ".join(f"({height}, {width}, {frames}): {share}"
                           for frames, share in buckets.items() if share)
        return ["--dataset-name", "random-mm", "--random-input-len", str(workload.input_len),
                "--random-output-len", str(workload.output_len),
                "--random-mm-base-items-per-request", str(items),
                "--random-mm-num-mm-items-range-ratio", "0",
                "--random-mm-limit-mm-per-prompt",
                json.dumps({"image": workload.images, "video": workload.videos}),
                "--random-mm-bucket-config", f"{{{config}}}"]
    if workload.kind == "audio":
        # custom_audio reads the clips' files; chat-based audio models get each as an
        # `input_audio` part beside the prompt only with --enable-multimodal-chat.
        return ["--dataset-name", "custom_audio", "--dataset-path", str(dataset),
                "--custom-output-len", str(workload.output_len), "--enable-multimodal-chat",
                "--disable-shuffle"]
    name = "custom_image" if workload.kind == "generated" else workload.dataset_name
    args = ["--dataset-name", name, "--dataset-path", str(dataset or workload.dataset),
            "--custom-output-len", str(workload.output_len)]
    # The generated file's order is what makes a repeat follow its first use.
    return args + ["--disable-shuffle"] if workload.kind == "generated" else args


def parse_result(path: Path) -> dict[str, float | int | None]:
    """The figures of one `vllm bench serve --save-result` file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"{path}: no `vllm bench serve` result ({exc})") from None
    if not isinstance(data, dict) or "completed" not in data:
        raise BenchError(f"{path}: not a `vllm bench serve` result (no `completed`)")
    figures: dict[str, float | int | None] = {}
    for name, key in RESULT_KEYS.items():
        value = data.get(key)
        figures[name] = value if isinstance(value, int | float) else None
    if figures["ttft_p50_ms"] is None and isinstance(data.get("median_ttft_ms"), int | float):
        figures["ttft_p50_ms"] = data["median_ttft_ms"]
    return figures


def write_dataset(workload: Workload, index: int, path: Path, round_: int = 0
                  ) -> dict[str, int]:
    """The `--repeat` dataset of load point `index` in round `round_` (vLLM's custom_image
    JSON lines): each image item is new or, for a `repeat` fraction of them, an earlier
    request's image."""
    seed = workload.seed_at(index, round_)
    rng = random.Random(seed)
    width, height = workload.image_size
    requests = workload.requests_at(index)
    total = requests * workload.images
    wanted = min(round(workload.repeat * total), max(total - 1, 0))
    repeats_at = set(rng.sample(range(1, total), wanted)) if wanted else set()
    pool: list[str] = []
    repeated = 0
    lines = []
    for request in range(requests):
        urls: list[str] = []
        for item in range(workload.images):
            earlier = [u for u in pool if u not in urls]
            if request * workload.images + item in repeats_at and earlier:
                urls.append(rng.choice(earlier))
                repeated += 1
                continue
            data = png(width, height, seed * 1_000_003 + len(pool))
            pool.append("data:image/png;base64," + base64.b64encode(data).decode())
            urls.append(pool[-1])
        words = " ".join(rng.choice(WORDS) for _ in range(workload.input_len))
        lines.append(json.dumps({"prompt": f"{request}: {words}", "image_files": urls}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return {"requests": requests, "images": total, "distinct_images": len(pool),
            "repeated_images": repeated}

