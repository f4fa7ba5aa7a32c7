"""`epdctl scale`, `switch` and `apply`: change a running topology's instances while it serves
(launch.change plans, launch.rollout carries out)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from epdctl.cli._app import App, pass_app
from epdctl.launch.drain import DRAIN_S
from epdctl.launch.readiness import STARTUP_TIMEOUT_S


def change_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """What every live change takes."""
    for option in reversed([
        click.option("--name", "topology", metavar="NAME",
                     help="Topology name; default: the only one under the state dir."),
        click.option("--drain", "drain_s", type=click.FloatRange(min=0), default=DRAIN_S,
                     show_default=True, metavar="SECONDS",
                     help="How long an instance that goes may finish its requests in flight "
                     "(the proxy sends it nothing new from the start)."),
        click.option("--timeout", "timeout_s", type=click.FloatRange(min=0),
                     default=STARTUP_TIMEOUT_S, show_default=True, metavar="SECONDS",
                     help="Seconds a new instance may take to be ready."),
        click.option("--dry-run", is_flag=True, help="Print the steps; change nothing."),
        click.option("--json", "as_json", is_flag=True, help="Machine-readable output."),
    ]):
        command = option(command)
    return command


def run_change(app: App, opts: dict[str, Any], reason: str,
         plan: Callable[[Any, Any], list[Any]], topology_file: Path | None = None) -> None:
    """Plan with the running topology's Placer (`plan(placer, sdir)`), then carry out."""
    from epdctl.errors import ChangeError
    from epdctl.launch.change import placer
    from epdctl.launch.live import one_change_at_a_time
    from epdctl.launch.rollout import Rollout
    from epdctl.launch.run import find
    from epdctl.topology.model import load_topology

    sdir = find(app.state_root, opts["topology"])
    with one_change_at_a_time(sdir):
        state = sdir.read()
        if state.phase != "running":
            raise ChangeError(f"`{state.name}` is {state.phase}, not running")
        topology = load_topology(topology_file or Path(state.topology_path))
        steps = plan(placer(topology, state, sdir.path), state)
        if opts["dry_run"] or not steps:
            _print_steps(app, steps, opts["as_json"], dry=opts["dry_run"])
            return
        began = time.monotonic()
        status = app.err.status("...")
        with status:
            rollout = Rollout(sdir, reason, opts["drain_s"], opts["timeout_s"],
                              say=lambda text: status.update(text), topology_path=topology_file)
            done = rollout.run(steps)
    if opts["as_json"]:
        app.out.print(json.dumps({"steps": done}), markup=False)
        return
    for d in done:
        cut = f", {d['cut']} cut" if d["cut"] else ""
        drained = f" ({d['finished']} request(s) finished{cut})" if d["finished"] else ""
        app.err.print(f"{d['step']:>8} {d['name']} ({d['role']}) in {d['seconds']:.1f}s"
                      f"{drained}", markup=False)
    app.err.print(f"`{state.name}` changed in {time.monotonic() - began:.1f}s: "
                  "`epdctl status` shows it", markup=False)


def _print_steps(app: App, steps: list[Any], as_json: bool, *, dry: bool) -> None:
    if as_json:
        app.out.print(json.dumps({"dry_run": dry, "steps": [
            {"step": s.kind, "name": s.name, "describe": s.describe()} for s in steps]}),
            markup=False)
        return
    if not steps:
        app.err.print("Nothing to change: the topology runs as asked.", markup=False)
    for s in steps:
        app.out.print(s.describe(), markup=False)


def _unchanged_file(placer: Any, state: Any) -> None:
    """scale and switch place new instances as the run's file defines them: refused where it
    no longer defines the running ones."""
    from epdctl.errors import PlanError

    if changed := placer.changed():
        raise PlanError(f"{state.topology_path} was edited since `{state.name}` started "
                        f"({', '.join(changed)} would differ): `epdctl apply "
                        f"{state.topology_path}` brings the topology to it")


@click.command()
@click.argument("counts", nargs=-1, required=True, metavar="ROLE=N...")
@change_options
@pass_app
def scale(app: App, counts: tuple[str, ...], **opts: Any) -> None:
    """Add or remove instances of a role while the topology serves

    \b
    ROLE is encode (e), prefill_decode (pd), prefill (p) or decode (d); N its instances.
    New instances take free GPUs (and free ports), as the topology file defines the role;
    once ready, the proxy sends them requests. Going down, the newest go: the proxy sends
    them nothing new, their requests in flight finish (up to --drain), then they stop.
    A change that cannot fit (GPUs, ports) is refused before anything starts or stops.

    \b
    epdctl scale pd=2            one more prefill+decode instance
    epdctl scale e=2 pd=1        one more encoder, one PD fewer
    """
    from epdctl.errors import PlanError
    from epdctl.launch.change import role_of
    from epdctl.launch.rollout import scale_steps

    wanted: dict[str, int] = {}
    for item in counts:
        role, sep, n = item.partition("=")
        if not sep or not n.isdigit():
            raise PlanError(f"{item!r}: expected ROLE=N, e.g. pd=2")
        wanted[role_of(role)] = int(n)

    def plan(placer: Any, state: Any) -> list[Any]:
        _unchanged_file(placer, state)
        return scale_steps(placer, wanted)

    run_change(app, opts, "scale " + " ".join(counts), plan)


@click.command()
@click.argument("name", metavar="NAME")
@click.argument("role", metavar="ROLE")
@change_options
@pass_app
def switch(app: App, name: str, role: str, **opts: Any) -> None:
    """Move an instance's GPUs to another role while the topology serves

    \b
    The proxy sends NAME nothing new and its requests in flight finish (up to --drain);
    it stops, and an instance of ROLE (e, pd, p, d) starts on the same GPUs; once ready,
    the proxy sends it requests. Where it is not ready within --timeout, NAME is started
    again as it was. NAME cannot be the last instance of its role.

    \b
    epdctl switch pd-1 encode    one PD's GPU to the encoders
    """
    from epdctl.launch.change import role_of
    from epdctl.launch.rollout import switch_steps

    target = role_of(role)

    def plan(placer: Any, state: Any) -> list[Any]:
        _unchanged_file(placer, state)
        return switch_steps(placer, name, target)

    run_change(app, opts, f"switch {name} {target}", plan)


@click.command()
@click.argument("file", type=click.Path(path_type=Path), metavar="FILE")
@change_options
@pass_app
def apply(app: App, file: Path, **opts: Any) -> None:
    """Bring a running topology to an edited file, while it serves

    \b
    Only what changed restarts: an instance the file now defines otherwise (its role's
    args, env, memory fraction) is drained and restarted in place, one at a time; each
    role is then scaled to its replicas. What a running topology cannot change (its
    roles, model, the encoder cache's namespace, the proxy's settings) is refused, before
    anything stops: `epdctl down` and `up` change those. Later changes follow FILE.
    """
    from epdctl.launch.rollout import apply_steps

    run_change(app, opts, f"apply {file}", lambda placer, state: apply_steps(placer), file)
