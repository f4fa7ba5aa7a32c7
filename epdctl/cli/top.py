"""`epdctl top`: a live view of a running topology from its /metrics (or --once --json)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import click

from epdctl.cli._app import App, pass_app

if TYPE_CHECKING:
    from epdctl.launch.state import RunState, StateDir

REFRESH_S = 1.0


def _latest(sdir: StateDir, state: RunState) -> RunState:
    """state.json as the supervisor wrote it last; the one we had once it is gone (`down`)."""
    from epdctl.errors import EpdctlError

    try:
        return sdir.read()
    except EpdctlError:
        return state


@click.command()
@click.option("--name", "name", metavar="NAME|FILE",
              help="Topology name or file; default: the only one under the state dir.")
@click.option("--once", "is_once", is_flag=True,
              help="Sample twice, --interval apart, print once and exit (latency since start).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--interval", "interval_s", type=click.FloatRange(min=0.1), default=REFRESH_S,
              show_default=True, help="Seconds between samples.")
@pass_app
def top(app: App, name: str | None, is_once: bool, as_json: bool, interval_s: float) -> None:
    """Watch requests, queues, latencies and the encoder cache live"""
    from epdctl.launch.state import find_state_dir
    from epdctl.top import sample, summary, view

    sdir = find_state_dir(app.state_root, name)
    state = sdir.read()
    if is_once or as_json:
        first = sample.take(state)
        time.sleep(interval_s)
        doc = summary.summarize(state, [first, sample.take(state)], latency_window_s=None)
        if as_json:
            click.echo(json.dumps(doc, indent=2))
        else:
            app.out.print(view.render(doc))
        return
    from rich.live import Live

    history = [sample.take(state)]
    keep_s = summary.LATENCY_WINDOW_S + 2 * interval_s
    try:
        with Live(view.render(summary.summarize(state, history)), console=app.out,
                  auto_refresh=False) as live:
            while True:
                time.sleep(interval_s)
                state = _latest(sdir, state)  # an instance may have failed meanwhile
                history.append(sample.take(state))
                while history[0].at < history[-1].at - keep_s:
                    history.pop(0)
                live.update(view.render(summary.summarize(state, history)), refresh=True)
    except KeyboardInterrupt:
        pass
