"""`epdctl up`: plan a topology, start it, and supervise it (here, or detached)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.text import Text

from epdctl.cli._app import App, pass_app
from epdctl.cli.views import Progress, summary
from epdctl.host.interrupts import unwinding
from epdctl.launch.readiness import STARTUP_TIMEOUT_S

if TYPE_CHECKING:
    from epdctl.launch.run import Run
    from epdctl.launch.state import RunState
    from epdctl.topology.model import Topology


def _warn(app: App) -> Callable[[str], None]:
    return lambda text: app.err.print(Text(text, style="yellow"))


def _rebalancer(app: App, state: RunState) -> None:
    """Say that the rebalancer runs (the supervisor started it: `epdctl logs rebalancer`)."""
    section = state.settings.rebalance
    if section is not None:
        app.err.print(f"Rebalancing every {section.every:g}s on the last {section.window:g}s "
                      "of traffic (rebalance.jsonl; its moves in changes.jsonl).", markup=False)


def _check_rebalance(topology: Topology) -> None:
    """What the rebalancer needs, refused in one line before anything starts."""
    from epdctl.rebalance.judge import Policy
    from epdctl.tune.runner import saved_profile

    saved_profile(Policy.of(topology.rebalance).profiles)


def _foreground(app: App, run: Run, timeout_s: float) -> int:
    from epdctl.launch.run import start_foreground

    progress = Progress(app)

    def ready(state: RunState) -> None:
        progress.close()
        app.out.print(summary(state))
        _rebalancer(app, state)
        app.err.print("Ctrl+C drains (the requests in flight finish), then stops everything; "
                      "twice stops at once.", markup=False)

    try:
        return start_foreground(run, timeout_s, on_change=progress.update, on_ready=ready)
    finally:
        progress.close()


@unwinding()  # SIGTERM and SIGHUP too abandon the start, as Ctrl+C does
def _detached(app: App, run: Run, timeout_s: float) -> None:
    from epdctl.launch.run import start_detached

    progress = Progress(app)
    try:
        state = start_detached(run, timeout_s, on_change=progress.update)
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        progress.close()
    app.out.print(summary(state))
    _rebalancer(app, state)
    app.err.print(f"Detached; `epdctl down --name {state.name}` stops it.", markup=False)


@click.command()
@click.argument("topology_path", metavar="TOPOLOGY", type=click.Path(path_type=Path))
@click.option("-d", "--detach", "is_detached", is_flag=True,
              help="Return once everything is ready; a background supervisor keeps watching.")
@click.option("--timeout", "timeout_s", type=float, default=STARTUP_TIMEOUT_S,
              show_default=True, help="Seconds every instance gets to become ready.")
@click.option("--dry-run", "is_dry_run", is_flag=True,
              help="Print each instance's command and environment; start nothing.")
@click.option("--rebalance", "is_rebalanced", is_flag=True,
              help="Move GPUs between roles as the traffic shifts, by the topology's "
              "`rebalance:` section (its profiles and SLO; docs/live.md).")
@pass_app
def up(app: App, topology_path: Path, is_detached: bool, timeout_s: float,
       is_dry_run: bool, is_rebalanced: bool) -> None:
    """Start a topology and wait until every instance is ready"""
    from dataclasses import replace

    from epdctl.launch.run import prepare
    from epdctl.topology.model import load_topology

    topology = load_topology(topology_path)
    if (is_rebalanced or topology.rebalance.enabled) and not is_dry_run:
        _check_rebalance(topology)
    run = prepare(topology_path, app.state_root, is_dry_run=is_dry_run, warn=_warn(app),
                  topology=topology)
    run = replace(run, is_rebalanced=is_rebalanced)
    if is_dry_run:
        for spec in run.plan.specs:
            app.out.print(f"# {spec.name} ({spec.role})\n{spec.shell()}", markup=False)
        for note in run.plan.notes:
            app.out.print(f"# note: {note}", markup=False, soft_wrap=True)
        return
    if is_detached:
        return _detached(app, run, timeout_s)
    sys.exit(_foreground(app, run, timeout_s))
