"""`epdctl restart NAME...`: restart instances one at a time while the others serve."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from epdctl.cli._app import App, pass_app
from epdctl.launch.drain import DRAIN_S
from epdctl.launch.readiness import STARTUP_TIMEOUT_S


@click.command()
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@click.option("--name", "topology", metavar="NAME|FILE",
              help="Topology name or file; default: the only one under the state dir.")
@click.option("--drain", "drain_s", type=click.FloatRange(min=0), default=DRAIN_S,
              show_default=True, metavar="SECONDS",
              help="How long an instance's requests in flight may take to finish before it "
              "stops (the proxy sends it nothing new from the start).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0),
              default=STARTUP_TIMEOUT_S, show_default=True,
              metavar="SECONDS", help="Seconds each instance may take to be ready again.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_app
def restart(app: App, names: tuple[str, ...], topology: str | None, drain_s: float,
            timeout_s: float, as_json: bool) -> None:
    """Restart engine instances, one at a time, while the others serve

    \b
    For each NAME (see `epdctl status`): the proxy sends it nothing new (its role's other
    instances take its requests; where it is the only one, they wait up to the proxy's
    replay_wait), its requests in flight finish (up to --drain), the supervisor stops and
    starts it (not a crash: no backoff, no restart budget spent), and once it is ready the
    proxy sends it requests again.
    """
    from epdctl.launch.live import one_change_at_a_time
    from epdctl.launch.restart_one import check_names
    from epdctl.launch.run import find

    sdir = find(app.state_root, topology)
    with one_change_at_a_time(sdir):
        state = sdir.read()
        check_names(state, list(names))
        done = _restart_each(app, sdir, state, names, drain_s, timeout_s, as_json)
    if as_json:
        app.out.print(json.dumps({"restarted": done}), markup=False)


def _restart_each(app: App, sdir: Any, state: Any, names: tuple[str, ...], drain_s: float,
                  timeout_s: float, as_json: bool) -> list[dict[str, Any]]:
    from epdctl.launch.drain import admit_instance, drain_instance
    from epdctl.launch.restart_one import request, wait_restarted

    done = []
    for name in names:
        url = next(s.url for s in state.engines if s.name == name)
        started = time.monotonic()
        with app.err.status(f"Draining {name} (up to {drain_s:g}s)..."):
            drained = drain_instance(state, url, drain_s)
        try:
            request(sdir, name)
            with app.err.status(f"Restarting {name}: waiting until it is ready..."):
                record = wait_restarted(sdir, name, state.records[name], timeout_s)
        finally:
            admit_instance(state, url)  # a dead one is the health probes' to eject
        took = time.monotonic() - started
        done.append({"name": name, "pid": record.pid, "seconds": round(took, 1),
                     "finished": drained.finished if drained else None,
                     "cut": drained.in_flight if drained else None})
        if not as_json:
            what = f"; {drained.line(name)}" if drained else ""
            app.err.print(f"Restarted {name} in {took:.1f}s{what}", markup=False)
    return done
