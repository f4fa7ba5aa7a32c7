"""`epdctl bench`'s workload options -> a Workload: generated requests, a dataset, a trace
(`--trace`, at each `--speed`) or a mix (`--mix`), and the options that cannot go together."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import click

from epdctl.bench.workload import (
    LoadPoint,
    Workload,
    load_points,
    parse_image_size,
    parse_list,
    parse_slo,
)
from epdctl.errors import BenchError

# Option dest -> its flag, for the refusals.
FLAGS = {"trace_path": "--trace", "mix": "--mix", "speeds": "--speed", "limit": "--limit",
         "dataset": "--dataset", "dataset_name": "--dataset-name", "images": "--images",
         "videos": "--videos", "audios": "--audios", "repeat": "--repeat",
         "rates": "--request-rate", "concurrency": "--max-concurrency",
         "num_prompts": "--num-prompts", "point_seconds": "--point-seconds",
         "input_len": "--input-len", "output_len": "--output-len"}
# What a trace's own lines or a mix's classes say, or what does not apply to them.
NOT_WITH_TRACE = ("mix", "dataset", "dataset_name", "images", "videos", "audios", "repeat",
                  "rates", "concurrency", "num_prompts", "input_len", "output_len")
NOT_WITH_MIX = ("trace_path", "dataset", "dataset_name", "images", "videos", "audios",
                "repeat", "concurrency", "speeds", "limit")


def _given(name: str) -> bool:
    """Whether the option was given (on the command line or by its envvar), not defaulted."""
    context = click.get_current_context(silent=True)
    source = context.get_parameter_source(name) if context is not None else None
    return source not in (click.core.ParameterSource.DEFAULT, None)


def workload_from(opts: dict[str, Any]) -> Workload:
    """The workload the options describe; BenchError in one line for options that do not
    go together."""
    if opts["trace_path"] is not None:
        return _trace(opts)
    if opts["mix"] is not None:
        return _mix(opts)
    for name in ("speeds", "limit"):
        if _given(name):
            raise BenchError(f"{FLAGS[name]} applies to a replayed trace: give --trace FILE")
    return _generated(opts)


def _refuse(opts: dict[str, Any], names: tuple[str, ...], what: str, why: str) -> None:
    given = [FLAGS[n] for n in names if _given(n) or (n in ("trace_path", "mix")
                                                      and opts[n] is not None)]
    if given:
        raise BenchError(f"{what} cannot go with {', '.join(given)}: {why}")


def _trace(opts: dict[str, Any]) -> Workload:
    from epdctl.bench.tracefile import load_trace

    _refuse(opts, NOT_WITH_TRACE, "--trace", "a trace's lines give each request's shape, "
            "length and arrival (--speed scales the arrivals)")
    speeds = parse_list(opts["speeds"], "--speed", float) or [1.0]
    if any(math.isinf(s) for s in speeds):
        raise BenchError("--speed: expected finite numbers above 0 (2: twice the trace's pace)")
    trace = load_trace(opts["trace_path"], opts["limit"])
    return Workload(points=tuple(LoadPoint(speed=s) for s in speeds),
                    num_prompts=trace.requests, point_seconds=opts["point_seconds"],
                    seed=opts["seed"], image_size=parse_image_size(opts["image_size"]),
                    video_frames=opts["video_frames"], images=0,
                    slo=parse_slo(opts["slo"]), trace=trace)


def _mix(opts: dict[str, Any]) -> Workload:
    from epdctl.traces.mix import parse_mix

    _refuse(opts, NOT_WITH_MIX, "--mix", "its classes give each request's media (e.g. "
            "text:0.4,image2:0.6), Poisson arrivals at each --request-rate")
    mix = parse_mix(opts["mix"])
    rates = parse_list(opts["rates"], "--request-rate", float) or [math.inf]
    return Workload(points=load_points(rates, []), num_prompts=opts["num_prompts"],
                    point_seconds=opts["point_seconds"], seed=opts["seed"], images=0,
                    image_size=parse_image_size(opts["image_size"]),
                    input_len=opts["input_len"], output_len=opts["output_len"],
                    video_frames=opts["video_frames"], slo=parse_slo(opts["slo"]),
                    mix=tuple(mix.items()))


def _generated(opts: dict[str, Any]) -> Workload:
    repeat, dataset, images = opts["repeat"], opts["dataset"], opts["images"]
    if opts["audios"] and not _given("images"):
        images = 0  # an audio workload's requests are text and one clip
    opts = {**opts, "images": images}
    if not 0 <= repeat < 1:
        raise BenchError(f"--repeat: expected a fraction from 0 to below 1, got {repeat:g}")
    if repeat and (dataset is not None or opts["images"] == 0):
        raise BenchError("--repeat needs images (--images 1 or more) and no --dataset")
    if dataset is not None and not Path(dataset).is_file():
        raise BenchError(f"--dataset {dataset}: no such file")
    points = load_points(parse_list(opts["rates"], "--request-rate", float),
                         parse_list(opts["concurrency"], "--max-concurrency", int))
    return Workload(points=points, num_prompts=opts["num_prompts"],
                    point_seconds=opts["point_seconds"], seed=opts["seed"],
                    images=opts["images"], image_size=parse_image_size(opts["image_size"]),
                    input_len=opts["input_len"], output_len=opts["output_len"], repeat=repeat,
                    videos=opts["videos"], video_frames=opts["video_frames"],
                    audios=opts["audios"],
                    dataset=dataset.absolute() if dataset else None,
                    dataset_name=opts["dataset_name"], slo=parse_slo(opts["slo"]))
