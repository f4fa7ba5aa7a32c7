"""`epdctl logs`: every instance's log in time order with true times; -f follows, --request
follows one request across the proxy and the instances, --export-trace writes what the proxy
served as a trace."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from epdctl.cli._app import App, pass_app

if TYPE_CHECKING:
    from epdctl.launch.state import RunState, StateDir
    from epdctl.logs import Writer

DEFAULT_LINES = 10
HINT = ("instances name requests in their logs only with `engine.log_requests: true` in the "
        "topology (vLLM's --enable-log-requests)")


def _age(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    from epdctl.topology.model import parse_duration

    try:
        return None if value is None else parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _pattern(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    try:
        return None if value is None else re.compile(value)
    except re.error as exc:
        raise click.BadParameter(f"not a regular expression: {exc}") from None


@click.command()
@click.argument("instances", nargs=-1, metavar="[INSTANCE]...")
@click.option("-f", "--follow", "should_follow", is_flag=True, help="Keep printing new lines.")
@click.option("-n", "--lines", "lines", type=click.IntRange(min=0), default=None,
              help=f"Lines of history per instance  [default: {DEFAULT_LINES}; all with "
                   "--since or --request]")
@click.option("--since", "since_s", callback=_age, metavar="AGE",
              help="Only lines of the last AGE (10m, 90s, 2h).")
@click.option("--grep", "pattern", callback=_pattern, metavar="PATTERN",
              help="Only lines matching this regular expression.")
@click.option("--all", "show_probes", is_flag=True,
              help="Also the access lines of health and metrics probes.")
@click.option("--request", "request_id", metavar="ID",
              help="One request: the proxy's line, then every line naming it, in time order "
                   "(its x-request-id or response id).")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object per line: time, instance, text, time_source.")
@click.option("--export-trace", "trace_path", metavar="FILE",
              type=click.Path(dir_okay=False, path_type=Path),
              help="Write the requests the proxy served (running or stopped) to FILE as a "
                   "trace instead (JSON lines, docs/traces.md): arrival, prompt text tokens "
                   "(estimated), media sizes, output tokens, stream; failed requests left "
                   "out. Takes --since (requests of the last AGE), --json and --name.")
@click.option("--name", "name", metavar="NAME|FILE",
              help="Topology name or file; default: the only one under the state dir.")
@pass_app
def logs(app: App, instances: tuple[str, ...], should_follow: bool, lines: int | None,
         since_s: float | None, pattern: re.Pattern[str] | None, show_probes: bool,
         request_id: str | None, as_json: bool, trace_path: Path | None,
         name: str | None) -> None:
    """Print instance logs in time order, as `time instance | line`"""
    from epdctl.launch.state import find_state_dir
    from epdctl.logs import JsonPrinter, Printer, follow, matcher, show, wants_colour

    if request_id is not None and should_follow:
        raise click.UsageError("--request and --follow do not go together")
    if trace_path is not None:
        _export(app, name, trace_path, since_s, as_json)
        return
    sdir = find_state_dir(app.state_root, name, past_runs=True)
    state, order = _instances(sdir)
    shown = list(instances) or order
    out = sys.stdout
    printer: Writer = JsonPrinter(out) if as_json else Printer(
        order, out, is_colour=wants_colour(out, app.color), shown=shown)
    files = [(n, sdir.logs_dir / f"{n}.log") for n in shown]
    if request_id is not None:
        _journey(app, printer, files, request_id, state, sdir.logs_dir)
        return
    since = None if since_s is None else time.time() - since_s
    match = matcher(show_probes=show_probes, pattern=pattern, since=since)
    count = lines if lines is not None else None if since is not None else DEFAULT_LINES
    show(printer, files, count, match, since)
    if should_follow:
        try:
            follow(printer, files, matcher(show_probes=show_probes, pattern=pattern))
        except KeyboardInterrupt:
            pass


def _export(app: App, name: str | None, path: Path, since_s: float | None,
            as_json: bool) -> None:
    """--export-trace: the proxy's log as a trace, and one line (or object) saying so."""
    import json

    from epdctl.launch.plan import PROXY_NAME
    from epdctl.launch.state import find_state_dir
    from epdctl.logs.export import export

    ctx = click.get_current_context()
    taken = {"trace_path", "since_s", "as_json", "name"}
    other = [p for p in ctx.command.params if p.name not in taken
             and ctx.get_parameter_source(p.name or "") is not click.core.ParameterSource.DEFAULT]
    if other:
        flag = other[0].human_readable_name if isinstance(other[0], click.Argument) \
            else max(other[0].opts, key=len)
        raise click.UsageError(f"--export-trace does not take {flag}: it reads the proxy's "
                               "log whole (--since AGE narrows it)")
    sdir = find_state_dir(app.state_root, name, past_runs=True)
    since = None if since_s is None else time.time() - since_s
    exported = export(sdir.logs_dir / f"{PROXY_NAME}.log", path, since)
    click.echo(json.dumps(exported.as_json(path)) if as_json else exported.summary(path))


def _instances(sdir: StateDir) -> tuple[RunState | None, list[str]]:
    """The run's state (None if gone) and every log's name: the topology's order, then the
    logs of instances it no longer has (a live change removed them)."""
    from epdctl.errors import EpdctlError, NotRunningError, StateError

    state: RunState | None
    try:
        state = sdir.read()
    except (NotRunningError, StateError):
        state = sdir.last_run()  # after `down`, or with a corrupt state.json
    kept = sorted(p.stem for p in sdir.logs_dir.glob("*.log") if p.stem != "supervisor")
    order = [s.name for s in state.specs] if state is not None else []
    order += [name for name in kept if name not in order]  # instances a live change removed
    if (sdir.logs_dir / "supervisor.log").exists():
        order.append("supervisor")
    if not order:
        raise NotRunningError(f"no logs in {sdir.logs_dir}")
    unknown = [i for i in click.get_current_context().params["instances"] if i not in order]
    if unknown:
        raise EpdctlError(f"no instance `{unknown[0]}` in {sdir.path.name} "
                          f"(instances: {', '.join(order)})")
    return state, order


def _journey(app: App, printer: Writer, files: list[tuple[str, Path]], request_id: str,
             state: RunState | None, logs_dir: Path) -> None:
    from epdctl.errors import EpdctlError
    from epdctl.logs.journey import find

    journey = find(files, request_id)
    if not journey.summary and not journey.lines:
        raise EpdctlError(f"no line of {logs_dir} names request `{request_id}`")
    for line in [*journey.summary, *journey.lines]:
        printer.write(line)
    engines = {s.name for s in state.engines} if state is not None else set()
    if state is not None and not any(line.instance in engines for line in journey.lines) and (
            not any(s.log_requests for s in state.engines)):
        app.err.print(f"Note: {HINT}.", markup=False, highlight=False)
