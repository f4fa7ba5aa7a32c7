"""`epdctl logs`: every instance's log, multiplexed with a prefix; -f follows."""

from __future__ import annotations

import sys

import click

from epdctl.cli._app import App, pass_app


@click.command()
@click.argument("instances", nargs=-1, metavar="[INSTANCE]...")
@click.option("-f", "--follow", "should_follow", is_flag=True, help="Keep printing new lines.")
@click.option("-n", "--lines", "lines", type=click.IntRange(min=0), default=10, show_default=True,
              help="Lines of history per instance.")
@click.option("--name", "name", metavar="NAME|FILE",
              help="Topology name or file; default: the only one under the state dir.")
@pass_app
def logs(app: App, instances: tuple[str, ...], should_follow: bool, lines: int,
         name: str | None) -> None:
    """Print instance logs, multiplexed as `time instance | line`"""
    from epdctl.errors import EpdctlError, NotRunningError, StateError
    from epdctl.logs import Printer, follow, show, wants_colour
    from epdctl.state import RunState, find_state_dir

    sdir = find_state_dir(app.state_root, name, past_runs=True)
    state: RunState | None
    try:
        state = sdir.read()
    except (NotRunningError, StateError):
        state = sdir.last_run()  # after `down`, or with a corrupt state.json
    if state is not None:
        order = [s.name for s in state.specs]
    else:
        order = sorted(p.stem for p in sdir.logs_dir.glob("*.log") if p.stem != "supervisor")
    if (sdir.logs_dir / "supervisor.log").exists():
        order.append("supervisor")
    if not order:
        raise NotRunningError(f"no logs in {sdir.logs_dir}")
    unknown = [i for i in instances if i not in order]
    if unknown:
        raise EpdctlError(f"no instance `{unknown[0]}` in {sdir.path.name} "
                          f"(instances: {', '.join(order)})")
    shown = list(instances) or order
    out = sys.stdout
    printer = Printer(order, out, is_colour=wants_colour(out, app.color), shown=shown)
    files = [(n, sdir.logs_dir / f"{n}.log") for n in shown]
    show(printer, files, lines)
    if should_follow:
        try:
            follow(printer, files)
        except KeyboardInterrupt:
            pass
