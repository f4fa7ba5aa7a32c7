"""`epdctl bench`: does EPD pay off here? One workload against the topology and a baseline."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from epdctl.bench.tracefile import DEFAULT_LIMIT
from epdctl.cli._app import App, pass_app
from epdctl.cli._options import point_seconds_option
from epdctl.cli.bench_compare import BenchCommand
from epdctl.launch.readiness import STARTUP_TIMEOUT_S

if TYPE_CHECKING:
    from epdctl.bench.arms import Arm


def _arms(app: App, topology_path: Path, baseline: str, extra: tuple[Path, ...]) -> list[Arm]:
    from epdctl.bench.arms import derive_arms
    from epdctl.errors import AlreadyRunningError
    from epdctl.launch.state import StateDir
    from epdctl.topology.model import load_topology

    topology = load_topology(topology_path)
    others = [(p, load_topology(p)) for p in extra]
    arms = derive_arms(topology, topology_path, baseline, others)  # type: ignore[arg-type]
    for arm in arms:
        if StateDir(app.state_dir(arm.topology.name)).is_running():
            raise AlreadyRunningError(
                f"`{arm.topology.name}` is running; bench starts every arm itself: "
                f"`epdctl down --name {arm.topology.name}` first")
    return arms


@click.command(cls=BenchCommand, epilog="`epdctl bench compare A/report.json B/report.json`: "
               "the same table and verdicts for two saved runs (see its --help).")
@click.argument("topology_path", metavar="TOPOLOGY", type=click.Path(path_type=Path))
@click.option("--baseline", type=click.Choice(["aggregated", "tp", "none"]),
              default="aggregated", show_default=True,
              help="aggregated: no encoder, its devices as PD replicas; tp: one instance over "
              "all devices; none: only the topology and --arm files.")
@click.option("--arm", "extra", multiple=True, type=click.Path(path_type=Path),
              metavar="FILE", help="Another topology of the same model (repeatable).")
@click.option("--reference", "reference_name", metavar="ARM",
              help="Take ratios and verdicts against this arm (its name, as the table shows "
              "it: `epd`, the baseline's, an --arm topology's); default: the baseline.")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path), metavar="FILE",
              help="Replay this trace (docs/traces.md: JSON lines, Mooncake's, Azure's CSV) "
              "at its own arrival times, its lines' shapes and lengths; reported per shape "
              "class too.")
@click.option("--speed", "speeds", metavar="LIST",
              help="--trace: its arrival times divided by each, a load point each (e.g. "
              "1,2,4); default 1.")
@click.option("--limit", type=click.IntRange(1), default=DEFAULT_LIMIT, show_default=True,
              metavar="N", help="--trace: refuse a trace of more requests.")
@click.option("--mix", metavar="CLASS:SHARE,...",
              help="A synthetic trace of these shape classes (text:0.4,image:0.6): "
              "--num-prompts requests of the sizes below, Poisson at each --request-rate.")
@click.option("--request-rate", "rates", metavar="LIST",
              help="Requests per second, e.g. 1,2,4 (a sweep) or inf; default inf.")
@click.option("--max-concurrency", "concurrency", metavar="LIST",
              help="Requests in flight at most, e.g. 1,4,16 (default when neither is given).")
@click.option("--num-prompts", type=click.IntRange(1), default=100, show_default=True,
              help="Requests per load point.")
@point_seconds_option
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the requests (load point i uses seed + i).")
@click.option("--images", type=click.IntRange(0), default=1, show_default=True,
              help="Images per request.")
@click.option("--image-size", default="512x512", show_default=True,
              metavar="WxH", help="Image size in pixels (video frames too; a trace's media "
              "of no size).")
@click.option("--videos", type=click.IntRange(0), default=0, show_default=True,
              help="Videos per request (random MP4s of --video-frames frames).")
@click.option("--video-frames", type=click.IntRange(2), default=4, show_default=True,
              help="Frames per video (a trace's videos of no frame count too).")
@click.option("--audios", type=click.IntRange(0, 1), default=0, show_default=True,
              help="Audio clips per request (1: generated WAVs, vLLM's custom_audio dataset; "
              "no images then).")
@click.option("--input-len", type=click.IntRange(1), default=128, show_default=True,
              help="Text tokens per request (about, for the --repeat dataset).")
@click.option("--output-len", type=click.IntRange(1), default=64, show_default=True,
              help="Tokens generated per request (EOS ignored).")
@click.option("--repeat", type=float, default=0.0, show_default=True, metavar="FRACTION",
              help="Fraction of images that repeat an earlier request's image.")
@click.option("--dataset", type=click.Path(path_type=Path), metavar="FILE",
              help="Your own `vllm bench serve` dataset file instead of random images.")
@click.option("--dataset-name", default="custom_image", show_default=True,
              help="Its `vllm bench serve --dataset-name`.")
@click.option("--slo", metavar="ttft=MS,tpot=MS",
              help="Goodput SLO: requests within it count (vLLM's --goodput).")
@click.option("--rounds", type=click.IntRange(1), metavar="R",
              help="Runs of every load point per arm, arms in alternating order (A B, B A, "
              "...). Default 2, the fewest that give a verdict, on cpu and cuda alike: a "
              "verdict weighs how far one start of an arm lands from the next, which only an "
              "arm brought up again (A, for B A) measures. 2 rounds decide only large "
              "differences, 4 finer ones; 1 gives the figures without a verdict.")
@click.option("--warmup", type=click.IntRange(0), default=3, show_default=True, metavar="N",
              help="Requests sent after each arm starts, at the first load, not counted.")
@click.option("--until-significant", "max_rounds", type=click.IntRange(1), metavar="MAX",
              help="Add rounds, up to MAX in all, until every verdict is decided.")
@click.option("--json", "as_json", is_flag=True, help="The whole report as JSON on stdout.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Write report.json, report.md and plot.png (and the raw results) here.")
@click.option("--dry-run", "is_dry_run", is_flag=True,
              help="Print each arm's plan and workload commands; start nothing.")
@click.option("--timeout", "timeout_s", type=float, default=STARTUP_TIMEOUT_S,
              show_default=True, help="Seconds each arm gets to become ready.")
@pass_app
def bench(app: App, topology_path: Path, baseline: str, extra: tuple[Path, ...],
          reference_name: str | None, rounds: int | None, warmup: int,
          max_rounds: int | None, as_json: bool, out_dir: Path | None, is_dry_run: bool,
          timeout_s: float, **opts: Any) -> None:
    """Compare the topology with aggregated serving on the same devices, under one workload"""
    from epdctl import __version__
    from epdctl.bench import report
    from epdctl.bench.counters import device_names
    from epdctl.bench.runner import Plan, prompts_for_arms, run_arms
    from epdctl.bench.schedule import fewest_rounds
    from epdctl.bench.senders import check
    from epdctl.cli._bench_render import BenchProgress, dry_run, plan_lines
    from epdctl.cli._bench_workload import workload_from
    from epdctl.errors import BenchError
    from epdctl.launch.resolve import vllm_version

    workload = workload_from(opts)
    arms = _arms(app, topology_path, baseline, extra)
    arm_names = [a.name for a in arms]
    if reference_name is not None and reference_name not in arm_names:
        raise BenchError(f"--reference {reference_name}: no such arm (the arms: "
                         f"{', '.join(arm_names)})")
    check(arms, workload)
    # The fewest rounds that measure the spread between starts (`fewest_rounds` says why),
    # the same on every device: a machine whose starts land far apart (a CPU one came out
    # 2.30x apart between two starts of one topology) needs more rounds, never fewer.
    count = rounds or fewest_rounds(len(arms))
    plan = Plan(count, warmup, max(max_rounds, count) if max_rounds else None)
    if is_dry_run:
        return dry_run(app, arms, workload, plan, as_json)
    prompts = prompts_for_arms(arms)
    work_dir = (out_dir or app.state_root / "bench" / arms[0].topology.name).absolute()
    progress = BenchProgress(app)
    for line in plan_lines(arms, workload, plan):
        progress.line(line)

    def undecided(runs: Any) -> bool:
        return report.is_undecided(report.build(runs, workload, prompts, reference_name))

    try:
        runs = run_arms(arms, workload, app.state_root, work_dir, timeout_s=timeout_s,
                        progress=progress, prompts=prompts, plan=plan, undecided=undecided)
    except KeyboardInterrupt:
        progress.close()
        app.err.print("Interrupted; every arm is down.", markup=False)
        sys.exit(130)
    finally:
        progress.close()
    doc = report.build(runs, workload, prompts, reference_name, epdctl_version=__version__,
                       vllm_version=vllm_version(), devices=device_names(arms),
                       command=["epdctl", *sys.argv[1:]], work_dir=str(work_dir),
                       plan={"rounds": count, "warmup": warmup, "until_significant": max_rounds})
    _output(app, doc, out_dir, as_json, work_dir)


def _output(app: App, doc: dict[str, Any], out_dir: Path | None, as_json: bool,
            work_dir: Path) -> None:
    """The report (stdout, --out), failed requests, and the greedy subset's verdict."""
    from epdctl.cli._bench_render import print_results, write_out
    from epdctl.errors import BenchError

    if out_dir is not None:
        write_out(app, doc, out_dir)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        print_results(app, doc)
    if doc["failed_requests"]:
        app.err.print(f"warning: {doc['failed_requests']} request(s) failed; see the "
                      f"`vllm bench serve` logs under {work_dir / 'runs'}", markup=False)
    if not doc["correctness"]["ok"]:
        bad = doc["correctness"]["mismatches"]
        names = ", ".join(sorted({f"{m['arm']}: {m['prompt']}" for m in bad}))
        raise BenchError(f"the greedy subset differs between arms ({names})")
