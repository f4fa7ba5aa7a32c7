"""`epdctl down`: stop a topology's processes, drop its state and EC store (logs are kept)."""

from __future__ import annotations

from pathlib import Path

import click

from epdctl.cli._app import App, pass_app
from epdctl.launch.processes import STOP_TIMEOUT_S


@click.command()
@click.option("--name", "name", metavar="NAME|FILE",
              help="Topology name or file; default: the only one under the state dir.")
@click.option("--timeout", "timeout_s", type=float, default=STOP_TIMEOUT_S, show_default=True,
              help="Seconds between SIGTERM and SIGKILL (one deadline for all).")
@click.option("--force", "should_scan", is_flag=True,
              help="Also find processes by the markers in their environment "
              "(works when state.json is corrupt or gone).")
@click.option("--keep-cache", "should_keep_cache", is_flag=True,
              help="Keep the EC store files (as `cache.keep_on_down: true` does).")
@pass_app
def down(app: App, name: str | None, timeout_s: float, should_scan: bool,
         should_keep_cache: bool) -> None:
    """Stop a running topology and remove its state"""
    from epdctl.errors import NotRunningError, StateError
    from epdctl.launch.run import find, stop

    sdir = find(app.state_root, name)
    try:
        state = sdir.read()
    except (StateError, NotRunningError):
        if not should_scan:
            raise
        state = None
    result = stop(sdir, state, timeout_s, should_scan=should_scan,
                  should_keep_cache=should_keep_cache)
    topo = sdir.path.name
    if state is None and not (result.stopped or result.killed or result.stale):
        raise NotRunningError(f"nothing of `{topo}` is running")
    if result.stopped or result.killed:
        app.err.print(f"Stopped {topo}: {', '.join(result.stopped + result.killed)}.",
                      markup=False)
    else:
        app.err.print(f"Nothing of {topo} was running; removed its state.", markup=False)
    if result.killed:
        app.err.print(f"Killed with SIGKILL (still running after {timeout_s:g}s): "
                      f"{', '.join(result.killed)}", markup=False)
    if result.stale:
        app.err.print(f"Not signalled (the pid now belongs to another process): "
                      f"{', '.join(result.stale)}", markup=False)
    if state is not None and (should_keep_cache or state.settings.keep_cache_on_down) \
            and Path(state.store_dir).exists():
        what = "EC store" if state.is_our_store else f"{state.ec_connector} files"
        app.err.print(f"Kept the {what} {state.store_dir}", markup=False)
    app.err.print(f"Logs are kept in {sdir.logs_dir}", markup=False)
