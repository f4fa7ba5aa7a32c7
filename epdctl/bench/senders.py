"""What sends a workload's requests, and what it checks first: `vllm bench serve`, or for a
trace (`bench --trace FILE`, `--mix`) epdctl's replayer (epdctl.bench.replay; vLLM's bench
replays no media), with the media kinds and lengths an arm must take to serve the trace, and
a mix's synthetic trace per load point."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from epdctl.bench.arms import Arm, image_limit, max_model_len
from epdctl.bench.audio import AUDIO_SECONDS
from epdctl.bench.workload import Workload, bench_command
from epdctl.bench.workload import argv as bench_argv
from epdctl.bench.workload import check as bench_check
from epdctl.errors import BenchError
from epdctl.traces.classes import parse_class
from epdctl.traces.format import Trace, write_trace
from epdctl.traces.mix import Sizes, synthetic

KINDS = ("trace", "mix")
REPLAYER = ("-m", "epdctl.bench.replay")


def sizes(workload: Workload) -> Sizes:
    """A mix's request sizes: the workload's options."""
    return Sizes(workload.input_len, workload.output_len, workload.image_size,
                 workload.video_frames, AUDIO_SECONDS)


def mix_trace(workload: Workload, index: int, round_: int = 0, count: int | None = None,
              seed: int | None = None) -> Trace:
    """Load point `index`'s synthetic trace in round `round_` (every arm the same): the
    point's requests (or `count`), Poisson at its rate, streamed."""
    rate = workload.points[index].request_rate
    return synthetic(dict(workload.mix), count or workload.requests_at(index), rate,
                     sizes(workload), workload.seed_at(index, round_) if seed is None else seed,
                     stream=True)


def write_mix(workload: Workload, index: int, path: Path, round_: int = 0,
              count: int | None = None, seed: int | None = None) -> Trace:
    trace = mix_trace(workload, index, round_, count, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_trace(path, trace.requests)
    return trace


def check(arms: Sequence[Arm], workload: Workload) -> None:
    """Refuse a workload an arm cannot serve, before anything starts."""
    if workload.kind in KINDS:
        _check_trace(arms, workload)
    else:
        bench_check(arms, workload)


def argv(arm: Arm, workload: Workload, index: int, **where: Any) -> list[str]:
    """The command line of load point `index` against `arm` (epdctl.bench.workload.argv's
    keywords: url, model, served_model_name, result_dir, result_name, dataset, round_,
    warmup): `vllm bench serve` (or what $EPDCTL_BENCH_COMMAND puts in its place), or for a
    trace the replayer, in epdctl's own Python (it needs nothing of vLLM's)."""
    if workload.kind in KINDS:
        return replay_argv(workload, index, **where)
    return bench_argv(bench_command(arm), workload, index, **where)


def _check_trace(arms: Sequence[Arm], workload: Workload) -> None:
    """A class with media an arm does not take (its --limit-mm-per-prompt), lines longer
    than its --max-model-len."""
    trace = workload.trace
    where = f"{trace.path}: " if trace else "--mix: "
    total = trace.requests if trace else workload.requests_at(0)
    for name, n in workload.class_counts().items():
        for kind, items in parse_class(name).items():
            for arm in arms:
                limit = image_limit(arm.topology, kind)
                if limit is not None and items > limit:
                    lines = f"{n} of its {total} lines are" if trace else \
                        f"{n} of {total} requests per point are"
                    raise BenchError(f"{where}{lines} `{name}` requests, {items} {kind}(s) "
                                     f"each; `{arm.name}` accepts at most {limit} "
                                     "(--limit-mm-per-prompt)")
    lengths = trace.lengths if trace else (workload.input_len + workload.output_len,)
    for arm in arms:
        most = max_model_len(arm.topology)
        over = [n for n in lengths if most is not None and n > most]
        if over:
            lines = f"{len(over)} of its {len(lengths)} lines ask" if trace else "requests ask"
            raise BenchError(f"{where}{lines} for more text tokens (input + output, up to "
                             f"{max(over)}) than `{arm.name}`'s --max-model-len {most}")


def replay_argv(workload: Workload, index: int, *, url: str, model: str,
                served_model_name: str, result_dir: Path, result_name: str,
                dataset: Path | None = None, round_: int = 0, warmup: int = 0) -> list[str]:
    """The replayer's command line for load point `index` (round `round_`); a mix's trace
    is `dataset` (the runner writes it). `warmup` > 0: the first that many lines, seeds of
    their own."""
    point = workload.points[index]
    seed = workload.warmup_seed() if warmup else workload.seed_at(index, round_)
    path = workload.trace.path if workload.trace is not None else dataset
    if path is None:
        raise BenchError("a --mix load point needs its trace written first")
    width, height = workload.image_size
    args = [sys.executable, *REPLAYER, "--trace", str(path), "--speed", f"{point.speed or 1.0:g}",
            "--base-url", url, "--model", model, "--served-model-name", served_model_name,
            "--seed", str(seed), "--image-size", f"{width}x{height}",
            "--video-frames", str(workload.video_frames),
            "--audio-seconds", f"{AUDIO_SECONDS:g}", "--result-dir", str(result_dir),
            "--result-filename", result_name]
    if workload.trace is not None:
        args += ["--limit", str(workload.trace.limit)]
    if warmup:
        args += ["--num-prompts", str(warmup)]
    elif workload.trace is not None and workload.requests_at(index) != workload.trace.requests:
        args += ["--num-prompts", str(workload.requests_at(index))]  # cycled
    if workload.slo:
        args += ["--goodput", *(f"{k}:{v:g}" for k, v in workload.slo)]
    return args


def estimate_s(workload: Workload, index: int) -> float | None:
    """How long a trace point's arrivals last (None: not a trace, or all at once)."""
    point, trace = workload.points[index], workload.trace
    if trace is None or not trace.duration_s:
        return None
    passes = workload.requests_at(index) / trace.requests  # more than 1: cycled
    return trace.duration_s * passes / (point.speed or 1.0)
