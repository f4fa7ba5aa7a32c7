"""`epdctl down`: stop a topology's processes, drop its state and EC store (logs are kept)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from epdctl.cli._app import App, pass_app
from epdctl.launch.drain import DRAIN_S
from epdctl.launch.processes import STOP_TIMEOUT_S

if TYPE_CHECKING:
    from epdctl.launch.state import RunState


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
@click.option("--drain", "drain_s", type=click.FloatRange(min=0), default=DRAIN_S,
              show_default=True, metavar="SECONDS",
              help="First let the requests in flight finish, for up to SECONDS: the proxy "
              "admits nothing new meanwhile (503 with Retry-After).")
@click.option("--no-drain", "drain_s", flag_value=0.0,
              help="Stop at once: requests in flight are cut.")
@pass_app
def down(app: App, name: str | None, timeout_s: float, should_scan: bool,
         should_keep_cache: bool, drain_s: float) -> None:
    """Stop a running topology and remove its state (after a drain: see --drain)"""
    from epdctl.errors import NotRunningError, StateError
    from epdctl.launch.run import find, stop

    sdir = find(app.state_root, name)
    try:
        state = sdir.read()
    except (StateError, NotRunningError):
        if not should_scan:
            raise
        state = None
    if state is not None and drain_s > 0:
        _drain(app, state, drain_s)
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


def _drain(app: App, state: RunState, seconds: float) -> None:
    """The proxy's requests in flight answered before the stop (nothing where it is gone)."""
    from epdctl.launch.drain import drain_proxy

    with app.err.status(f"Draining {state.name}: the requests in flight finish "
                        f"(up to {seconds:g}s)..."):
        drained = drain_proxy(state, seconds)
    if drained is not None and (drained.finished or drained.in_flight):
        app.err.print(drained.line(state.name), markup=False)
