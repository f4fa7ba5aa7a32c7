"""`epdctl rebalance`: would another split of the running topology's devices serve its recent
traffic better, by tune's model? Say which and why; without --dry-run, move there with
`switch` steps (epdctl.rebalance decides, launch.rollout carries out)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from epdctl.cli._app import App, pass_app
from epdctl.cli.change import change_options, run_change
from epdctl.rebalance.decide import MARGIN


@click.command()
@click.option("--profiles", "profiles_dir", required=True, metavar="DIR",
              type=click.Path(file_okay=False, path_type=Path),
              help="The --out of a `tune` run of this model on this machine: its profiles.json "
              "gives each stage's cost.")
@click.option("--slo", required=True, metavar="ttft=MS,tpot=MS",
              help="The SLO the split is chosen for.")
@click.option("--window", default="5m", show_default=True, metavar="DURATION",
              help="The recent traffic judged: the requests the proxy logged this long back.")
@click.option("--interval", default="10m", show_default=True, metavar="DURATION",
              help="How long a move must pay for itself in: what it serves within the SLO "
              "over this, its switches included, against staying.")
@click.option("--margin", type=click.FloatRange(0), default=MARGIN, show_default=True,
              help="How much more a move must be predicted to serve (hysteresis).")
@click.option("--switch-seconds", type=click.FloatRange(0), default=None, metavar="S",
              help="What one switch costs (default: the longest start of the running "
              "instances).")
@click.option("--image-size", default=None, metavar="WxH",
              help="An image the proxy logged without a size (default: the profiles' size).")
@click.option("--model-facts", "facts_file", type=click.Path(path_type=Path), default=None,
              help="The model's facts, as given to `tune` (default: from its config).")
@change_options
@pass_app
def rebalance(app: App, **opts: Any) -> None:
    """Move the running topology's devices between roles when its traffic asks for it

    \b
    The requests the proxy logged over --window (their shapes and arrival times) are run
    through tune's queue model on every split `epdctl switch` can reach (the same GPUs,
    instances moved between roles of one size), with the profiles of a `tune --out`. The
    split that keeps the most of them within --slo wins; a move to it is made only where,
    over --interval and counting what each switch costs, it serves more than --margin more
    than staying. --dry-run (or --json with it) says what it would do, and why.

    \b
    epdctl rebalance --profiles tune-out/ --slo ttft=2000,tpot=100 --dry-run
    """
    decision, names = _decision(app, opts)
    if opts["as_json"] and (opts["dry_run"] or not decision.act):
        app.out.print(json.dumps({**decision.as_json(), "switches": names}), markup=False)
        return
    if not opts["as_json"]:
        _print(app, decision, names)
    if not decision.act or opts["dry_run"]:
        return
    from epdctl.rebalance.judge import switch_plan

    run_change(app, {**opts, "dry_run": False}, f"rebalance: {decision.why}",
               switch_plan(decision))


def _decision(app: App, opts: dict[str, Any]) -> tuple[Any, list[str]]:
    """The options as a Policy, judged on the run."""
    from epdctl.bench.workload import parse_image_size
    from epdctl.errors import BenchError
    from epdctl.launch.run import find
    from epdctl.rebalance.judge import Policy, judge
    from epdctl.topology.model import parse_duration

    try:
        window_s, interval_s = parse_duration(opts["window"]), parse_duration(opts["interval"])
    except ValueError as exc:
        raise BenchError(f"--window/--interval: {exc}") from None
    size = parse_image_size(opts["image_size"]) if opts["image_size"] else None
    policy = Policy(opts["profiles_dir"], opts["slo"], window_s, interval_s, opts["margin"],
                    opts["switch_seconds"], size, opts["facts_file"])
    sdir = find(app.state_root, opts["topology"])
    return judge(sdir, sdir.read(), policy)


def _print(app: App, decision: Any, names: list[str]) -> None:
    from rich.table import Table

    table = Table(title=f"The last traffic: {decision.rate:.3g} req/s", title_justify="left")
    for column in ("split", "within SLO now", "knee (req/s)", ""):
        table.add_column(column, justify="left" if column == "split" else "right")
    for o in decision.options:
        mark = "running" if o is decision.current else "best" if o is decision.best else ""
        table.add_row(o.shape.label, f"{o.share:.0%}", f"{o.knee:.3g}", mark)
    app.out.print(table)
    verb = "Moving" if decision.act else "Staying"
    app.err.print(f"{verb}: {decision.why}", markup=False)
    for line in names if decision.act else []:
        app.out.print(f"  {line}", markup=False)
