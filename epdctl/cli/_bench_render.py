"""`epdctl bench` output: progress on stderr, the results table, --dry-run, --out files."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table
from rich.text import Text

from epdctl.cli._app import App
from epdctl.cli.views import Progress

if TYPE_CHECKING:
    from rich.status import Status

    from epdctl.bench.arms import Arm
    from epdctl.bench.runner import Plan
    from epdctl.bench.workload import Workload
    from epdctl.launch.state import RunState

TICK_EVERY_S = 30.0
"""How often a non-interactive stderr hears that a load point is still running."""


class BenchProgress:
    """Arm, load point, elapsed / estimate: live on a TTY, a line now and then elsewhere."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.starting: Progress | None = None
        self.status: Status | None = None
        self.last_tick = 0.0

    def line(self, text: str) -> None:
        self._stop_status()
        self.app.err.print(text, markup=False)

    def tick(self, text: str) -> None:
        if self.app.err.is_interactive:
            if self.status is None:
                self.status = self.app.err.status(Text(text))
                self.status.start()
            else:
                self.status.update(Text(text))
        elif time.monotonic() - self.last_tick >= TICK_EVERY_S:
            self.last_tick = time.monotonic()
            self.app.err.print(text, markup=False)

    def on_change(self, state: RunState) -> None:
        if self.starting is None:
            self.starting = Progress(self.app)
        self.starting.update(state)

    def done_starting(self) -> None:
        if self.starting is not None:
            self.starting.close()
            self.starting = None

    def _stop_status(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None

    def close(self) -> None:
        self.done_starting()
        self._stop_status()


def results_table(doc: Mapping[str, Any], width: int = 80) -> str:
    """The table as text, as wide as it needs (wider than most terminals: never clipped)."""
    from epdctl.bench.report import table_rows

    return _text_table(table_rows(doc), "ms / per second; ± half the 95 % interval; n<N: a "
                       "percentile that needs N requests; x ref = over "
                       f"`{doc.get('reference') or 'the earlier run'}`", 2, width)


def class_table(doc: Mapping[str, Any], width: int = 80) -> str | None:
    """A trace's per shape class table as text (None: not a trace)."""
    from epdctl.bench.report import class_rows

    rows = class_rows(doc)
    if len(rows) < 2:
        return None
    return _text_table(rows, "per shape class: its requests alone; req/s and goodput are "
                       "theirs per second of the run", 3, width)


def _text_table(rows: list[list[str]], caption: str, left: int, width: int) -> str:
    from rich.console import Console

    table = Table(box=None, pad_edge=False, title_justify="left", caption=caption,
                  caption_justify="left")
    for i, header in enumerate(rows[0]):
        table.add_column(header, justify="left" if i < left else "right", no_wrap=True)
    for row in rows[1:]:
        table.add_row(*(Text(c) for c in row))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    console = Console(width=max(width, sum(widths) + 2 * len(widths)), no_color=True,
                      highlight=False)
    with console.capture() as capture:
        console.print(table)
    return capture.get().rstrip("\n")


def print_results(app: App, doc: Mapping[str, Any]) -> None:
    """The table (a trace's per shape class too), how the arms took turns, and one verdict
    per load point and arm (and class)."""
    from epdctl.bench.report import order_line, verdict_line, workload_line

    app.out.print(results_table(doc, app.out.width), markup=False)
    shaped = class_table(doc, app.out.width)
    if shaped is not None:
        app.out.print(shaped, markup=False)
        app.out.print(f"workload: {workload_line(doc['workload'])}", markup=False)
    if doc.get("order"):
        app.out.print(order_line(doc), markup=False)
    for note in doc.get("notes") or []:
        app.out.print(f"note: {note}", markup=False)
    for v in doc["verdicts"]:
        app.out.print(verdict_line(v), markup=False)


def plan_lines(arms: Sequence[Arm], workload: Workload, plan: Plan) -> list[str]:
    """What the bench will run and whether it can give a verdict (stderr before it starts,
    and --dry-run)."""
    from epdctl.bench.schedule import describe

    return describe([a.name for a in arms],
                    [workload.requests_at(i) for i in range(len(workload.points))],
                    plan.rounds, plan.warmup, plan.max_rounds)


def plan_json(arms: Sequence[Arm], workload: Workload, plan: Plan) -> dict[str, Any]:
    """--dry-run --json's `plan`: rounds, each arm's starts, load-point runs, a verdict."""
    from epdctl.bench.schedule import fewest_rounds, starts

    names = [a.name for a in arms]
    return {"rounds": plan.rounds, "warmup": plan.warmup, "until_significant": plan.max_rounds,
            "starts": starts(names, plan.rounds),
            "runs": len(workload.points) * len(names) * plan.rounds,
            "can_decide": len(names) > 1 and max(plan.rounds, plan.max_rounds or 0)
            >= fewest_rounds(len(names))}


def dry_run(app: App, arms: Sequence[Arm], workload: Workload, plan: Plan,
            as_json: bool) -> None:
    """Each arm's plan and the workload commands it would get; nothing starts."""
    from epdctl.bench.senders import argv
    from epdctl.launch.run import prepare

    docs = []
    warned: set[str] = set()

    def warn(text: str) -> None:  # once, not once per arm
        if text not in warned:
            warned.add(text)
            app.err.print(Text(text, style="yellow"))

    for arm in arms:
        run = prepare(arm.path, app.state_root, is_dry_run=True, topology=arm.topology,
                      warn=warn)
        commands = []
        for index in range(len(workload.points)):
            dataset = Path(f"<work dir>/datasets/point-{index}.jsonl") \
                if workload.kind in ("generated", "audio", "mix") else None
            commands.append(argv(arm, workload, index, url=run.plan.proxy.url,
                                 model=arm.topology.model,
                                 served_model_name=run.plan.model_name,
                                 result_dir=Path("<work dir>/runs"),
                                 result_name=f"{arm.name}-{index}.json", dataset=dataset))
        docs.append({"arm": arm.name, "topology": arm.topology.name, "mode": arm.topology.mode,
                     "notes": list(arm.notes), "instances": [s.shell() for s in run.plan.specs],
                     "workload": commands})
    if as_json:
        click.echo(json.dumps({"workload": workload.as_json(), "arms": docs,
                               "plan": plan_json(arms, workload, plan)}, indent=2))
        return
    for line in plan_lines(arms, workload, plan):
        app.out.print(f"# {line}", markup=False)
    for doc in docs:
        notes = "".join(f"\n#   {n}" for n in doc["notes"])
        app.out.print(f"## arm `{doc['arm']}`: {doc['topology']} ({doc['mode']}){notes}",
                      markup=False)
        for spec in doc["instances"]:
            app.out.print(spec, markup=False)
        for index, command in enumerate(doc["workload"]):
            app.out.print(f"# load point {index + 1}: {workload.points[index].label}\n"
                          f"{shlex.join(command)}", markup=False)


def write_out(app: App, doc: Mapping[str, Any], out_dir: Path) -> None:
    """report.json, report.md and (with matplotlib) plot.png."""
    from epdctl.bench.plot import write_plot
    from epdctl.bench.report import markdown
    from epdctl.errors import BenchError

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown(doc))
    (out_dir / "plot.png").unlink(missing_ok=True)
    try:
        write_plot(doc, out_dir / "plot.png")
    except BenchError as exc:
        app.err.print(Text(str(exc), style="yellow"))
    app.err.print(f"Wrote {out_dir}/report.json, report.md"
                  + (", plot.png" if (out_dir / "plot.png").exists() else ""), markup=False)
