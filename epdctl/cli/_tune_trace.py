"""`epdctl tune --trace FILE` / `--mix CLASS:SHARE,...`: the options -> the shape profiled, the
trace as the model sees it, and the workload confirmations replay; the options that cannot
go with them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from epdctl.bench.workload import LoadPoint, Workload
from epdctl.cli._bench_workload import FLAGS, _given
from epdctl.errors import BenchError
from epdctl.tune.facts import ModelFacts
from epdctl.tune.traced import TraceTune

MIX_FILE = "mix.jsonl"
"""--mix's synthetic trace, written to --out (what the confirmations replay)."""
MIX_RATE = 1.0
"""--mix's Poisson arrivals at speed 1 (req/s): speeds scale them to any rate."""
TRACE_POINT_SECONDS = 60.0
"""--trace and --mix without --point-seconds: a confirmation speed plays at least this long of
the trace (again from its start past its end). A short trace at a high speed is a burst of a
few seconds: two candidates' knee points then differ by less than bench's interval can
tell, and tune gives the undecided race to the simpler topology (benchmarks/tune.py
--trace: 120 requests a point left 2E~2P+1D 25 % above aggregated undecided)."""
# What a trace's lines (or a mix's classes and its fixed arrivals) say instead.
NOT_WITH_TRACE = ("mix", "images", "num_prompts", "input_len", "output_len")
NOT_WITH_MIX = ("images", "limit")


def _refuse(names: tuple[str, ...], what: str, why: str, opts: dict[str, Any]) -> None:
    given = [FLAGS[n] for n in names if (n == "mix" and opts[n] is not None) or _given(n)]
    if given:
        raise BenchError(f"{what} cannot go with {', '.join(given)}: {why}")


def trace_workloads(opts: dict[str, Any], sizes: Workload, facts: ModelFacts, out_dir: Path
                    ) -> tuple[Workload, TraceTune] | None:
    """None without --trace or --mix; else the workload the probes send (the trace's
    typical image-bearing request) and the trace as tuned. BenchError or TraceError in one
    line for options that do not go together and for a trace tune cannot model."""
    from epdctl.bench.tracefile import load_trace
    from epdctl.traces.format import read_trace
    from epdctl.tune.traced import for_trace

    if opts["trace_path"] is not None or opts["mix"] is not None:
        if not _given("point_seconds"):
            sizes = replace(sizes, point_seconds=TRACE_POINT_SECONDS)
    if opts["trace_path"] is not None:
        _refuse(NOT_WITH_TRACE, "--trace", "a trace's lines give each request's shape, "
                "length and arrival", opts)
        path, limit = Path(opts["trace_path"]), opts["limit"]
    elif opts["mix"] is not None:
        _refuse(NOT_WITH_MIX, "--mix", "its classes give each request's media, its "
                "arrivals are a trace replayed at speeds", opts)
        path, limit = _write_mix(opts, sizes, out_dir), sizes.num_prompts
    else:
        if _given("limit"):
            raise BenchError("--limit applies to a trace: give --trace FILE")
        return None
    return for_trace(read_trace(path, limit), load_trace(path, limit), sizes, facts)


def _write_mix(opts: dict[str, Any], sizes: Workload, out_dir: Path) -> Path:
    """--num-prompts requests of the mix, Poisson at MIX_RATE (seeded by --seed), streamed,
    of the workload options' sizes."""
    from epdctl.traces.format import write_trace
    from epdctl.traces.mix import Sizes, parse_mix, synthetic

    mix = parse_mix(opts["mix"])
    trace = synthetic(mix, sizes.num_prompts, MIX_RATE,
                      Sizes(sizes.input_len, sizes.output_len, sizes.image_size),
                      seed=sizes.seed, stream=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / MIX_FILE
    write_trace(path, trace.requests)
    return path


def replayed(sizes: Workload, trace: TraceTune) -> Workload:
    """What confirmations send: the trace, replayed (the points: LiveConfirmer's speeds);
    images of no size at --image-size, as the model took them."""
    return replace(sizes, points=(LoadPoint(speed=1.0),), num_prompts=trace.replay.requests,
                   point_seconds=trace.model.point_seconds, images=0,
                   image_size=trace.unsized_image,
                   trace=trace.replay)
