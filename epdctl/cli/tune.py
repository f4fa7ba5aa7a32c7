"""`epdctl tune`: which topology for this workload and SLO? Profile, predict, confirm."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from epdctl.bench.tracefile import DEFAULT_LIMIT
from epdctl.cli._app import App, pass_app
from epdctl.cli._options import point_seconds_option
from epdctl.launch.readiness import STARTUP_TIMEOUT_S
from epdctl.tune.decide import MAX_CONFIRM
from epdctl.tune.search import CONFIRM_POINTS, KNEE_FACTORS, KNEE_STEP, KNEE_STEPS

if TYPE_CHECKING:
    from epdctl.bench.workload import Workload
    from epdctl.topology.model import Topology
    from epdctl.tune.runner import Settings


def _devices(base: Any, gpus: str | None) -> tuple[int, ...]:
    """--gpus as indices; else the base's GPUs (its instance count on `device: cpu`)."""
    from epdctl.bench.arms import devices
    from epdctl.errors import BenchError

    if gpus is not None:
        parts = [p.strip() for p in gpus.split(",")]
        if not parts or not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
            raise BenchError(f"--gpus: expected distinct GPU indices such as 0,1,2,3, "
                             f"got {gpus!r}")
        return tuple(int(p) for p in parts)
    if base.device == "cpu":
        return tuple(range(sum(r.replicas for r in base.roles.values())))
    listed, counted = devices(base)
    picked = [i for i in range(len(listed) + counted) if i not in listed][:counted]
    return tuple(listed) + tuple(picked)


@click.command()
@click.argument("topology_path", metavar="BASE", type=click.Path(path_type=Path))
@click.option("--gpus", metavar="LIST", help="GPU indices tune may use, e.g. 0,1,2,3 "
              "(default: the base topology's; on `device: cpu`, its instance count).")
@click.option("--slo", required=True, metavar="ttft=MS,tpot=MS",
              help="The SLO goodput counts: requests within it.")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path), metavar="FILE",
              help="Tune for this trace (docs/traces.md): profiled at its most frequent "
              "image-bearing class's typical request, predicted over its requests, confirmed "
              "by replaying it at speeds (each at least 60 s of it unless --point-seconds "
              "says otherwise).")
@click.option("--limit", type=click.IntRange(1), default=DEFAULT_LIMIT, show_default=True,
              metavar="N", help="--trace: refuse a trace of more requests.")
@click.option("--mix", metavar="CLASS:SHARE,...",
              help="Tune for a synthetic trace of these shape classes (text:0.4,image:0.6): "
              "--num-prompts requests of the sizes below, Poisson arrivals.")
@click.option("--num-prompts", type=click.IntRange(1), default=100, show_default=True,
              help="Requests per confirmation load point.")
@point_seconds_option
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the requests.")
@click.option("--images", type=click.IntRange(0), default=1, show_default=True,
              help="Images per request.")
@click.option("--image-size", default="512x512", show_default=True, metavar="WxH",
              help="Image size in pixels.")
@click.option("--input-len", type=click.IntRange(1), default=128, show_default=True,
              help="Text tokens per request.")
@click.option("--output-len", type=click.IntRange(1), default=64, show_default=True,
              help="Tokens generated per request.")
@click.option("--budget", "budget", default="45m", show_default=True, metavar="DURATION",
              help="Stop confirming once this is spent (30m, 2h, seconds).")
@click.option("--max-confirm", type=click.IntRange(2), default=MAX_CONFIRM, show_default=True,
              help="Candidates confirmed with bench at most.")
@click.option("--confirm-points", "confirm_points", type=click.IntRange(1, max(KNEE_FACTORS)),
              default=CONFIRM_POINTS, show_default=True,
              help="Load points a confirmation run starts with, around the predicted knee "
              "(1: the knee's grid rate, then one step at a time until the knee is "
              "bracketed; 2-4 spread round it, each run).")
@click.option("--knee-steps", "knee_steps", type=click.IntRange(0, 8),
              default=KNEE_STEPS, show_default=True, help="Load points a confirmation may "
              f"add, each {KNEE_STEP:.2f}x the last, while every rate holds the SLO (or "
              "down while even the lowest misses): the knee bracketed, not a lower bound. "
              "0: none.")
@click.option("--model-facts", "facts_file", type=click.Path(path_type=Path), metavar="FILE",
              help="YAML with a `model:` section (heads, weights, kv_per_token): for a model "
              "that is not a local directory (a simulated machine's cost model qualifies).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Profiles, runs and report.json/report.md here; a rerun reuses profiles.")
@click.option("--write", "write_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the best measured candidate here, ready for `epdctl up`.")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON on stdout.")
@click.option("--timeout", "timeout_s", type=float, default=STARTUP_TIMEOUT_S,
              show_default=True, help="Seconds each topology gets to become ready.")
@pass_app
def tune(app: App, topology_path: Path, gpus: str | None, slo: str, budget: str,
         max_confirm: int, confirm_points: int, knee_steps: int, facts_file: Path | None,
         out_dir: Path | None, write_path: Path | None, as_json: bool, timeout_s: float,
         **opts: Any) -> None:
    """Recommend a topology for a workload and an SLO: profile, predict, confirm with bench"""
    from epdctl.cli._tune_render import write_out
    from epdctl.topology.model import load_topology
    from epdctl.tune import live
    from epdctl.tune.candidates import request_tokens
    from epdctl.tune.probes import Bodies
    from epdctl.tune.runner import tune as run_tune

    base = load_topology(topology_path)
    settings = _settings(app, base, gpus, slo, budget, max_confirm, facts_file, out_dir, opts)
    workload, out = settings.workload, settings.out_dir
    tokens = request_tokens(settings.facts, workload.images, workload.image_size,
                            workload.input_len, workload.output_len) - workload.output_len

    class _Err:
        def line(self, text: str) -> None:
            app.err.print(text, markup=False)

    progress = _Err()
    live.use_sim_bench_command()
    profiler = live.LiveProfiler(app.state_root, out, Bodies(workload, base.model_name),
                                 tokens, timeout_s=timeout_s, tpot_ms=settings.slo.tpot_ms)
    confirmer = live.LiveConfirmer(_confirmed(settings, topology_path), app.state_root, out,
                                   timeout_s=timeout_s, progress=progress,
                                   points=confirm_points, steps=knee_steps,
                                   trace_rate=settings.trace.model.rate if settings.trace
                                   else None)
    try:
        doc = run_tune(settings, profiler, confirmer, progress)
    except KeyboardInterrupt:
        app.err.print(f"Interrupted; profiles so far are kept in {out}", markup=False)
        sys.exit(130)
    write_out(doc, out)
    if write_path is not None and doc["best"]:
        best = next(c for c in doc["candidates"] if c["name"] == doc["best"])
        source = out / "candidates" / f"{best['name']}.yaml"
        write_path.write_text(source.read_text())
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    _print_report(app, doc)


def _settings(app: App, base: Topology, gpus: str | None, slo: str, budget: str,
              max_confirm: int, facts_file: Path | None, out_dir: Path | None,
              opts: dict[str, Any]) -> Settings:
    """The options as the tune loop's settings (--out defaults to <state>/tune/<name>)."""
    from epdctl.bench.workload import LoadPoint, Workload, parse_image_size, parse_slo
    from epdctl.cli._tune_trace import trace_workloads
    from epdctl.errors import BenchError
    from epdctl.topology.model import parse_duration
    from epdctl.tune.facts import model_facts
    from epdctl.tune.model import Slo
    from epdctl.tune.runner import Settings

    pairs = parse_slo(slo)
    limits = dict(pairs)
    if "e2el" in limits:
        raise BenchError("--slo: tune takes ttft and tpot (goodput's SLO), not e2el")
    try:
        budget_s = parse_duration(budget)
    except ValueError as exc:
        raise BenchError(f"--budget: {exc}") from None
    workload = Workload(points=(LoadPoint(),), num_prompts=opts["num_prompts"],
                        point_seconds=opts["point_seconds"], seed=opts["seed"],
                        images=opts["images"],
                        image_size=parse_image_size(opts["image_size"]),
                        input_len=opts["input_len"], output_len=opts["output_len"], slo=pairs)
    facts = model_facts(base.model, facts_file)
    out = (out_dir or app.state_root / "tune" / base.name).absolute()
    traced = trace_workloads(opts, workload, facts, out)
    if traced is not None:
        workload = traced[0]
    memory = None
    if base.device == "cuda":
        from epdctl.host.gpus import describe_gpus

        memory = min((g.total_bytes for g in describe_gpus() if g.total_bytes), default=None)
    return Settings(base=base, gpus=_devices(base, gpus), workload=workload,
                    slo=Slo(limits.get("ttft"), limits.get("tpot")), facts=facts,
                    gpu_memory=memory, out_dir=out, budget_s=budget_s,
                    max_confirm=max_confirm, trace=traced[1] if traced else None)


def _confirmed(settings: Settings, topology_path: Path) -> Workload:
    """What confirmations send: the workload, or the trace replayed (refused in one line
    where the base's engine cannot take its requests: the candidates share its args)."""
    from epdctl.bench.arms import Arm
    from epdctl.bench.senders import check
    from epdctl.cli._tune_trace import replayed

    if settings.trace is None:
        return settings.workload
    workload = replayed(settings.workload, settings.trace)
    check([Arm(settings.base.name, "extra", settings.base, topology_path)], workload)
    return workload


def _print_report(app: App, doc: dict[str, Any]) -> None:
    """The report as text on stdout: the table, the verdict, what was left out, hints."""
    from epdctl.cli._tune_render import hints, left_out, text_table, trace_line

    if trace_line(doc):
        app.out.print(trace_line(doc), markup=False)
    app.out.print(text_table(doc), markup=False)
    app.out.print(f"best measured: {doc['best'] or '-'}; stopped: {doc['stop_reason']}",
                  markup=False)
    if doc.get("best_reason"):
        app.out.print(f"  ({doc['best_reason']})", markup=False)
    for line in left_out(doc) + hints(doc):
        app.out.print(line, markup=False)
