"""`epdctl bench compare A B`: two saved bench runs, the same table and verdicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from epdctl.cli._app import App, pass_app


@click.command()
@click.argument("earlier", type=click.Path(path_type=Path), metavar="A")
@click.argument("later", type=click.Path(path_type=Path), metavar="B")
@click.option("--arm", "arms", multiple=True, metavar="NAME",
              help="Only this arm (repeatable); default every arm both runs have.")
@click.option("--json", "as_json", is_flag=True, help="The comparison as JSON on stdout.")
@pass_app
def compare(app: App, earlier: Path, later: Path, arms: tuple[str, ...], as_json: bool) -> None:
    """Compare two saved bench runs (report.json, or the --out dir): B's figures over A's

    Each arm both runs have, at each load point: the figures with their intervals, B over A,
    and a verdict where the difference is significant (a regression shows as `A:arm` better
    than `B:arm`). Runs of one round each have one start per arm: figures only, no verdict.
    The load points must be the same; other workload differences are listed.
    """
    from epdctl.bench.compare import compare as compare_docs
    from epdctl.bench.compare import load
    from epdctl.cli._bench_render import print_results

    doc = compare_docs(load(earlier), load(later), arms=arms)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    app.out.print(f"A = {earlier}\nB = {later}", markup=False)
    for note in doc["workload_differences"]:
        app.err.print(f"note: the workloads differ, {note}", markup=False)
    print_results(app, doc)


class BenchCommand(click.Command):
    """`bench TOPOLOGY ...`, and `bench compare A B` (a topology file named `compare`:
    write `./compare`)."""

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        if args and args[0] == "compare":
            return compare.make_context(f"{info_name} compare", args[1:], parent, **extra)
        return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        if ctx.command is not self:
            return ctx.command.invoke(ctx)
        return super().invoke(ctx)
